"""Host facts for the `node` check: mount liveness, processes (services, D state), EDAC
memory errors and the kernel clock. Gatherers read through the probe's root; the `evaluate_*`
functions are pure and return `(Status, text)` problems that `evaluate_node` merges.

Sources (formats are the kernel's):
- mounts: `statvfs` and a directory read of `<root>/<mount>` (and, for `mount_write_dirs`, a
  file written, read back and removed) in a forked child per mount, bounded by
  `node.mount_probe_timeout_s`: a hung Lustre/GPFS/NFS mount blocks in the kernel and still
  appears in /proc/mounts; the child is SIGKILLed and the mount reported hung.
- processes: `<root>/proc/<pid>/stat` (proc(5): `pid (comm) state ppid ... flags ...
  starttime`), kernel threads (flags & PF_KTHREAD) skipped. One pass gives both the running
  services (by comm, which the kernel truncates to 15 characters) and the processes in
  uninterruptible sleep. A process named as a service also has its owner read
  (`<root>/proc/<pid>/status` `Uid:` real and effective; not the /proc dir's owner, which a
  process that makes itself non-dumpable turns into root): any user can name a process
  `nv-fabricmanage`, only the service's owner (`node.service_owners`, else root) counts.
  Owner names resolve through `<root>/etc/passwd`. How long a process has been in D is told by the state dir: a
  process (pid + starttime) in D in every reading since it was first seen so.
- EDAC: `<root>/sys/devices/system/edac/mc/mc<N>/ce_count`, `ue_count` (and
  `dimm<M>/dimm_label`, `dimm_ue_count`, `dimm_ce_count` to name the DIMM).
- clock: adjtimex(2) read-only (modes 0): a syscall, not a file, so it is read only when the
  root is `/` (a fixture root has no kernel clock to offer).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import select
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.health.result import Status, duration_text
from bluevela.health.state import read_json, write_json

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeThresholds

logger = logging.getLogger(__name__)

HOST_STATE = "host_state.json"  # in the node's state dir: EDAC counts, D-state first seen
EDAC_MC = "sys/devices/system/edac/mc"
PF_KTHREAD = 0x00200000
STA_UNSYNC = 0x0040
TIME_ERROR = 5
COMM_LEN = 15  # TASK_COMM_LEN - 1
PROBE_PREFIX = ".bv-probe."  # + 32 random hex digits
PROBE_NAME_TRIES = 8


# -- mounts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MountProbe:
    """One mount's answer: `state` "ok", "hung" (no answer in `timeout_s`) or "error"."""

    mount: str
    state: str
    detail: str = ""
    timeout_s: float = 0.0
    seconds: float = 0.0


def _probe_one(path: Path, write_dir: Path | None) -> str:
    """What the child does: statvfs, read the directory, optionally write/read/remove a file.
    Returns "" when all answered, else the first error as text."""
    step = "statvfs"
    try:
        os.statvfs(path)
        step = "readdir"
        with os.scandir(path) as it:
            next(it, None)
        if write_dir is not None:
            step = "write"
            return _write_probe(write_dir)
    except OSError as exc:
        return f"{step}: {exc.strerror or exc}"
    return ""


def _write_probe(write_dir: Path) -> str:
    """Write, read back and remove a file under an unpredictable name in `write_dir` (opened
    without following a link); a name someone planted (EEXIST) is passed over, never opened.
    A user of a shared scratch directory cannot plant the name (the old `<host>.<pid>` name
    could be planted for every pid, and the node was drained)."""
    try:
        dfd = os.open(write_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and os.path.islink(write_dir):
            return "open dir: a symlink (never followed)"
        return f"open dir: {exc.strerror or exc}"
    try:
        step = "write"
        payload = f"bluevela mount probe {time.time()} {secrets.token_hex(8)}\n".encode()
        for _ in range(PROBE_NAME_TRIES):
            name = PROBE_PREFIX + secrets.token_hex(16)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            except FileExistsError:
                continue
            break
        else:
            return f"write: {PROBE_NAME_TRIES} random names all existed"
        got, err = b"", ""
        try:
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            step = "read back"
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                got = os.read(fd, len(payload) + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            err = f"{step}: {exc.strerror or exc}"
        try:
            os.unlink(name, dir_fd=dfd)  # ours: O_EXCL made it
        except OSError as exc:
            err = err or f"unlink: {exc.strerror or exc}"
        if not err and got != payload:
            err = "read back differs from what was written"
        return err
    except OSError as exc:
        return f"{step}: {exc.strerror or exc}"
    finally:
        os.close(dfd)


def probe_mounts(root: Path, mounts: list[str], write_dirs: list[str],
                 timeout_s: float) -> list[MountProbe]:
    """Probe every mount in its own forked child, all at once; a child that has not answered
    within `timeout_s` is SIGKILLed (a task blocked on a dead file server may stay in D: it is
    left for init to reap) and its mount reported hung."""
    under = {m: root / m.lstrip("/") for m in mounts}
    writes = _write_dir_of(root, mounts, write_dirs)
    children: dict[int, tuple[str, int, float]] = {}
    results: dict[str, MountProbe] = {}
    for m in mounts:
        rfd, pid = _fork_probe(under[m], writes.get(m))
        children[rfd] = (m, pid, time.monotonic())
    end = time.monotonic() + timeout_s
    bufs: dict[int, bytearray] = {fd: bytearray() for fd in children}
    pending = set(children)
    try:
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(pending), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 4096)
                if chunk:
                    bufs[fd] += chunk
                    continue
                pending.discard(fd)
                m, _pid, started = children[fd]
                results[m] = _answer(m, bytes(bufs[fd]), timeout_s, time.monotonic() - started)
    finally:
        for fd, (m, pid, _) in children.items():
            if fd in pending:
                results[m] = MountProbe(m, "hung", f"no answer in {timeout_s:g} s", timeout_s,
                                        timeout_s)
            _end_probe(fd, pid, kill=fd in pending)
    return [results[m] for m in mounts]


def _write_dir_of(root: Path, mounts: list[str], write_dirs: list[str]) -> dict[str, Path]:
    """Each mount's directory to write in (under `root`): the write dir it holds, the
    deepest mount holding it when several do."""
    writes: dict[str, Path] = {}
    for d in write_dirs:
        owner = max((m for m in mounts if d == m or d.startswith(m.rstrip("/") + "/")),
                    key=len, default=None)
        if owner is not None:
            writes[owner] = root / d.lstrip("/")
    return writes


def _fork_probe(path: Path, write_dir: Path | None) -> tuple[int, int]:
    """Fork a child that probes `path` and writes its JSON answer on a pipe; (the pipe's read
    end, the child's pid)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            os.close(rfd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            err = _probe_one(path, write_dir)
            os.write(wfd, json.dumps({"error": err}).encode())
        except BaseException:  # noqa: BLE001 - report nothing: the parent says why
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    return rfd, pid


def _answer(mount: str, raw: bytes, timeout_s: float, took: float) -> MountProbe:
    """A child's answer (read until its pipe closed) as the mount's probe result."""
    try:
        answer = json.loads(raw.decode() or "null")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return MountProbe(mount, "error", "probe process gave no answer", timeout_s, took)
    if answer.get("error"):
        return MountProbe(mount, "error", str(answer["error"]), timeout_s, took)
    return MountProbe(mount, "ok", "", timeout_s, took)


def _end_probe(fd: int, pid: int, *, kill: bool) -> None:
    """Close a child's pipe and reap it if it is done; SIGKILL it first when it is hung."""
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def evaluate_mounts(probes: list[MountProbe]) -> list[tuple[Status, str]]:
    problems: list[tuple[Status, str]] = []
    for p in probes:
        if p.state == "hung":
            problems.append((Status.CRITICAL, f"mount {p.mount} hung ({p.detail})"))
        elif p.state == "error":
            problems.append((Status.CRITICAL, f"mount {p.mount} unusable ({p.detail})"))
    return problems


# -- processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    state: str
    flags: int
    starttime: int
    uids: tuple[int, int] | None = None  # (real, effective); None: not read

    @property
    def key(self) -> str:
        """Identifies the process across readings (pids are reused)."""
        return f"{self.pid}:{self.starttime}"


def parse_stat(text: str) -> Proc | None:
    """A /proc/<pid>/stat line; None when it does not parse. comm may hold spaces and ')'."""
    head, sep, rest = text.rpartition(")")
    pid_s, _, comm = head.partition(" (")
    fields = rest.split()
    if not sep or not pid_s.strip().isdigit() or len(fields) < 20:
        return None
    try:
        # fields[0] is field 3 (state): flags is field 9, starttime field 22.
        return Proc(int(pid_s), comm, fields[0], int(fields[6]), int(fields[19]))
    except ValueError:
        return None


def parse_status_uids(text: str) -> tuple[int, int] | None:
    """(real, effective) uid from a /proc/<pid>/status text; None when it has no Uid line."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
                return int(fields[1]), int(fields[2])
            return None
    return None


def read_procs(root: Path, owned: frozenset[str] = frozenset()) -> list[Proc]:
    """Every process of `<root>/proc` (kernel threads included; a vanished pid is skipped).
    A process whose comm is in `owned` also gets its uids from `status`, and is skipped when
    they cannot be read (it cannot then stand for a service).

    Raises:
        OSError: `<root>/proc` cannot be listed.
    """
    base = root / "proc"
    out = []
    for name in os.listdir(base):
        if not name.isdigit():
            continue
        try:
            with open(base / name / "stat", encoding="utf-8", errors="replace") as fh:
                proc = parse_stat(fh.read(4096))
        except OSError:
            continue
        if proc is None:
            continue
        if proc.comm in owned:
            try:
                with open(base / name / "status", encoding="utf-8", errors="replace") as fh:
                    uids = parse_status_uids(fh.read(8192))
            except OSError:
                uids = None
            if uids is None:
                continue
            proc = Proc(proc.pid, proc.comm, proc.state, proc.flags, proc.starttime, uids)
        out.append(proc)
    return out


def user_ids(root: Path, names: Iterable[str]) -> dict[str, int | None]:
    """The uid of each user name (`root` is 0, digits are a uid) from `<root>/etc/passwd`;
    None for a name not there (service accounts are local: no NSS lookup)."""
    out: dict[str, int | None] = {}
    want = set()
    for n in names:
        if n == "root":
            out[n] = 0
        elif n.isdigit():
            out[n] = int(n)
        else:
            out[n] = None
            want.add(n)
    if want:
        try:
            text = (root / "etc" / "passwd").read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            f = line.split(":")
            if len(f) >= 3 and f[0] in want and out[f[0]] is None and f[2].isdigit():
                out[f[0]] = int(f[2])
    return out


@dataclass(frozen=True)
class ProcFacts:
    running: frozenset[str]  # comms of live (not zombie) processes
    d_state: dict[str, tuple[str, float]]  # key -> (comm, seconds in D across readings)
    d_state_now: int  # user processes in D in this reading
    tracked: bool  # a state dir holds the first-seen times (else durations are 0)
    # comm -> uids of its live processes whose owner was read (-1: real and effective
    # differ); a comm not here had no owner read.
    owners: dict[str, frozenset[int]] = field(default_factory=dict)
    owner_uids: dict[str, int | None] = field(default_factory=dict)  # user name -> uid


def gather_procs(procs: list[Proc], first_seen: dict[str, float], now: float,
                 tracked: bool, owner_uids: dict[str, int | None] | None = None
                 ) -> tuple[ProcFacts, dict[str, float]]:
    """The facts, and the new first-seen map (only processes in D now stay in it)."""
    live = [p for p in procs if p.state not in ("Z", "X")]
    running = frozenset(p.comm for p in live)
    owners: dict[str, set[int]] = {}
    for p in live:
        if p.uids is not None:
            owners.setdefault(p.comm, set()).add(p.uids[0] if p.uids[0] == p.uids[1] else -1)
    users_d = [p for p in procs if p.state == "D" and not p.flags & PF_KTHREAD]
    seen = {p.key: first_seen.get(p.key, now) for p in users_d}
    d_state = {p.key: (p.comm, now - seen[p.key]) for p in users_d}
    return ProcFacts(running, d_state, len(users_d), tracked,
                     {c: frozenset(u) for c, u in owners.items()}, dict(owner_uids or {})), seen


def service_owner(t: NodeThresholds, name: str) -> str:
    return t.service_owners.get(name, "root")


def evaluate_procs(facts: ProcFacts | None, t: NodeThresholds) -> list[tuple[Status, str]]:
    if facts is None:
        return []
    problems: list[tuple[Status, str]] = []
    for name in t.required_services:
        comm = name[:COMM_LEN]
        if comm not in facts.running:
            problems.append((Status.CRITICAL, f"service {name} not running"))
            continue
        if comm not in facts.owners:
            continue  # owners not read (a Proc list without uids)
        owner = service_owner(t, name)
        uid = facts.owner_uids.get(owner)
        if uid is None:
            problems.append((Status.UNKNOWN, f"service {name}: its owner {owner!r} is not in "
                             f"/etc/passwd"))
        elif uid not in facts.owners[comm]:
            other = ", ".join(str(u) if u >= 0 else "mixed" for u in sorted(facts.owners[comm]))
            problems.append((Status.CRITICAL, f"service {name} not running as {owner} (a "
                             f"process of that name runs as uid {other})"))
    if t.max_d_state_s > 0:
        long = sorted(((secs, key, comm) for key, (comm, secs) in facts.d_state.items()
                       if secs >= t.max_d_state_s), reverse=True)
        if long:
            secs, key, comm = long[0]
            more = f" (+{len(long) - 1} more)" if len(long) > 1 else ""
            problems.append((Status.WARNING, f"{len(long)} process(es) in D state over "
                             f"{t.max_d_state_s:g} s: {comm} pid {key.partition(':')[0]} "
                             f"for {duration_text(secs)}{more}"))
    return problems


# -- EDAC ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EdacMC:
    mc: str
    ce: int
    ue: int
    ue_dimms: tuple[str, ...] = ()  # labels of DIMMs with uncorrected errors
    ce_before: int | None = None


@dataclass(frozen=True)
class EdacFacts:
    mcs: tuple[EdacMC, ...] = ()
    age_s: float | None = None  # since the stored reading
    error: str | None = None


def _int_file(path: Path) -> int | None:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def read_edac(root: Path) -> list[EdacMC]:
    """Memory controllers under `<root>/sys/devices/system/edac/mc`; none when EDAC is absent."""
    base = root / EDAC_MC
    try:
        names = sorted((n for n in os.listdir(base) if n.startswith("mc") and n[2:].isdigit()),
                       key=lambda n: int(n[2:]))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for mc in names:
        ce, ue = _int_file(base / mc / "ce_count"), _int_file(base / mc / "ue_count")
        if ce is None or ue is None:
            continue
        dimms: list[str] = []
        if ue:
            try:
                entries = sorted(os.listdir(base / mc))
            except OSError:
                entries = []
            for d in entries:
                if (d.startswith("dimm") or d.startswith("rank")) and \
                        (_int_file(base / mc / d / "dimm_ue_count") or 0) > 0:
                    try:
                        label = (base / mc / d / "dimm_label").read_text(errors="replace").strip()
                    except OSError:
                        label = ""
                    dimms.append(label or d)
        out.append(EdacMC(mc, ce, ue, tuple(dimms)))
    return out


def evaluate_edac(facts: EdacFacts | None, t: NodeThresholds) -> list[tuple[Status, str]]:
    if facts is None:
        return []
    if facts.error:
        return [(Status.UNKNOWN, f"EDAC unreadable: {facts.error}")]
    problems: list[tuple[Status, str]] = []
    for mc in facts.mcs:
        if mc.ue > t.max_edac_ue:
            where = f" ({', '.join(mc.ue_dimms)})" if mc.ue_dimms else ""
            problems.append((Status.CRITICAL, f"EDAC {mc.mc} {mc.ue} uncorrectable memory "
                             f"error(s) since boot{where}"))
        if (mc.ce_before is not None and facts.age_s is not None and facts.age_s >= 60
                and t.max_edac_ce_per_h > 0):
            inc = mc.ce - mc.ce_before if mc.ce >= mc.ce_before else mc.ce
            per_h = inc * 3600.0 / facts.age_s
            if per_h > t.max_edac_ce_per_h:
                problems.append((Status.WARNING, f"EDAC {mc.mc} corrected memory errors "
                                 f"{per_h:.3g}/h > {t.max_edac_ce_per_h:g}/h (+{inc})"))
    return problems


# -- clock --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClockFacts:
    """adjtimex(2) as read: `state` its return value (5 = TIME_ERROR: unsynchronized)."""

    state: int
    status: int
    offset_us: float
    maxerror_us: int
    error: str | None = None


def read_adjtimex() -> ClockFacts:
    import ctypes

    class Timex(ctypes.Structure):  # struct timex (x86-64 / aarch64 glibc layout)
        _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long),
                    ("freq", ctypes.c_long), ("maxerror", ctypes.c_long),
                    ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                    ("constant", ctypes.c_long), ("precision", ctypes.c_long),
                    ("tolerance", ctypes.c_long), ("time_sec", ctypes.c_long),
                    ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
                    ("ppsfreq", ctypes.c_long), ("jitter", ctypes.c_long),
                    ("shift", ctypes.c_int), ("stabil", ctypes.c_long),
                    ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long),
                    ("errcnt", ctypes.c_long), ("stbcnt", ctypes.c_long),
                    ("tai", ctypes.c_int), ("pad", ctypes.c_int * 11)]

    tx = Timex()  # modes 0: read only
    libc = ctypes.CDLL(None, use_errno=True)
    state = libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        err = ctypes.get_errno()
        return ClockFacts(-1, 0, 0.0, 0, os.strerror(err) or errno.errorcode.get(err, "?"))
    nano = bool(tx.status & 0x2000)  # STA_NANO: offset in ns
    offset_us = tx.offset / 1000.0 if nano else float(tx.offset)
    return ClockFacts(state, tx.status, offset_us, tx.maxerror)


def evaluate_clock(facts: ClockFacts | None, t: NodeThresholds) -> list[tuple[Status, str]]:
    if facts is None or t.max_clock_offset_ms <= 0:
        return []
    if facts.error:
        return [(Status.UNKNOWN, f"clock unreadable: adjtimex: {facts.error}")]
    if facts.state == TIME_ERROR or facts.status & STA_UNSYNC:
        return [(Status.WARNING, f"clock not synchronized (adjtimex: STA_UNSYNC, maxerror "
                 f"{facts.maxerror_us / 1e6:g} s)")]
    off_ms = abs(facts.offset_us) / 1000.0
    if off_ms > t.max_clock_offset_ms:
        return [(Status.WARNING, f"clock offset {off_ms:.1f} ms > {t.max_clock_offset_ms:g} ms")]
    return []


# -- the node check's host part -----------------------------------------------------------------


@dataclass(frozen=True)
class HostFacts:
    mounts: list[MountProbe] = field(default_factory=list)
    procs: ProcFacts | None = None
    edac: EdacFacts | None = None
    clock: ClockFacts | None = None
    errors: tuple[str, ...] = ()


def gather_host(ctx: ProbeContext, mounted: frozenset[str] | None) -> HostFacts:
    """Everything above for the class's thresholds; the state dir keeps EDAC counts and the
    D-state first-seen times between readings."""
    t = ctx.node_class.node
    errors: list[str] = []
    now = time.time()
    probes: list[MountProbe] = []
    if t.mount_probe_timeout_s > 0 and t.required_mounts and mounted is not None:
        live = [m for m in t.required_mounts if (m.rstrip("/") or "/") in mounted]
        if live:
            probes = probe_mounts(ctx.root, live, t.mount_write_dirs, t.mount_probe_timeout_s)
    stored: Any = read_json(ctx.state_dir / HOST_STATE) if ctx.state_dir is not None else None
    stored = stored if isinstance(stored, dict) else {}
    procs: ProcFacts | None = None
    first_seen: dict[str, float] = {}
    if t.required_services or t.max_d_state_s > 0:
        try:
            listed = read_procs(ctx.root, frozenset(n[:COMM_LEN] for n in t.required_services))
        except OSError as exc:
            errors.append(f"processes unreadable: {exc.strerror or exc}")
        else:
            old = stored.get("d_state") if isinstance(stored.get("d_state"), dict) else {}
            old = {k: float(v) for k, v in old.items() if isinstance(v, int | float)}
            uids = user_ids(ctx.root, {service_owner(t, n) for n in t.required_services})
            procs, first_seen = gather_procs(listed, old, now, ctx.state_dir is not None, uids)
    mcs = read_edac(ctx.root)
    edac: EdacFacts | None = None
    if mcs:
        before = stored.get("edac") if isinstance(stored.get("edac"), dict) else {}
        age = now - float(stored["time"]) if isinstance(stored.get("time"), int | float) else None
        mcs = [EdacMC(m.mc, m.ce, m.ue, m.ue_dimms,
                      before.get(m.mc) if isinstance(before.get(m.mc), int) else None)
               for m in mcs]
        edac = EdacFacts(tuple(mcs), age if before else None)
    clock = read_adjtimex() if t.max_clock_offset_ms > 0 and ctx.root == Path("/") else None
    if ctx.state_dir is not None and (procs is not None or mcs):
        write_json(ctx.state_dir / HOST_STATE,
                   {"time": now, "d_state": first_seen, "edac": {m.mc: m.ce for m in mcs}})
    return HostFacts(probes, procs, edac, clock, tuple(errors))


def evaluate_host(facts: HostFacts, t: NodeThresholds) -> tuple[list[tuple[Status, str]],
                                                                 dict[str, float]]:
    """Problems and metrics of the host part."""
    problems = evaluate_mounts(facts.mounts)
    problems += evaluate_procs(facts.procs, t)
    problems += evaluate_edac(facts.edac, t)
    problems += evaluate_clock(facts.clock, t)
    problems += [(Status.UNKNOWN, e) for e in facts.errors]
    metrics: dict[str, float] = {}
    if facts.mounts:
        metrics["mounts_probed_count"] = len(facts.mounts)
        metrics["mount_probe_max_s"] = max(p.seconds for p in facts.mounts)
    if facts.procs is not None:
        metrics["d_state_count"] = facts.procs.d_state_now
    if facts.edac is not None:
        metrics["edac_ue_total"] = sum(m.ue for m in facts.edac.mcs)
        metrics["edac_ce_total"] = sum(m.ce for m in facts.edac.mcs)
    if facts.clock is not None and not facts.clock.error:
        metrics["clock_offset_ms"] = facts.clock.offset_us / 1000.0
        metrics["clock_unsynced"] = bool(facts.clock.status & STA_UNSYNC)
    return problems, metrics
