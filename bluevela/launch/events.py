"""Goodput events: what the in-job supervisor saw happen to each launch, for the ledger.

Three places touch them (docs/resilience.md, "Where the time went: goodput events"):

1. The ranks. `bluevela.runtime.checkpoint_saved(step)` / `checkpointing(step)` send ONE
   signed UDP datagram per checkpoint to the supervisor's beat socket (the same address and
   key as the heartbeat, `BV_HEARTBEAT` / `BV_JOB_SECRET`), non-blocking, never raising:

       bvck1 <rank> <step> <pid> <seq> <start_age_ms> <end_age_ms> <mac>

   (ages: how long before the send the save started and ended; `mac` as for beats, over the
   rest of the line). A dead or absent supervisor costs the loop one failed `sendto`.
2. The supervisor (`EventLog`, as the job's user). Per Slurm attempt it appends one JSON line
   per event to `<dir>/bv-goodput.<job>.r<restart>.u<uid>.<random>.jsonl` (dir:
   ``BV_EVENTS_DIR``, else /tmp, checked by `dir_layout`; created O_EXCL|O_NOFOLLOW, mode
   0600): the launch (time, attempt, nodes), the first progress, one line per checkpoint
   (step, first start, last end, rank count; the ranks' datagrams folded in memory), the
   step's end (kind, when the failure happened, when it was detected, cause, lost nodes),
   the requeue; once per Slurm attempt the job's submit/start time and time limit from
   ``squeue``. A checkpoint datagram is range-checked (rank, step, ages within the step's
   life) and its sequence number must rise per (rank, pid), as for heartbeats. The file is
   bounded as the epilog reads it (MAX_FILE_BYTES, MAX_LINES), with room kept for the lines
   that close a launch (CLOSE_RESERVE).
3. The epilog (root) of the node the supervisor ran on: `collect_files()` reads that file as
   hostile input (a directory no other user can fill or replace, at most MAX_SCAN entries
   scanned, names and owner filtered by the job's uid before the MAX_FILES cap; a directory
   fd, O_NOFOLLOW|O_NONBLOCK, a regular file owned by the job's user, at most
   `MAX_FILE_BYTES`, every field checked, the host must be this node) and folds it into one
   bounded dict that goes into the node's epilog report under `goodput_events` (the path
   reports already take into the archive); the files are removed once that report is
   spooled. A bad file is logged and left out; the report is spooled all the same. The
   ledger (bluevela/report/goodput.py) checks the dict again with `validate()` and clamps it
   to the job's allocation before using it.

4. The copy (issue 28): the supervisor's node is the batch node, and when it dies its epilog
   never runs and its file is lost with it. So the supervisor also streams every line it
   writes, in order, to the agent of a second node of the step (`keeper_of`: the step's first
   node that is not its own) over the step's signed channel (bluevela/launch/wire.py: the
   step's secret, an HMAC per line, bounded lines: `copy_messages` cuts an event line into
   parts of COPY_CHUNK characters), the lines written so far first, at most COPY_OUT_MAX
   bytes ahead of the socket (`CopySender`, pumped each tick). The agent (`CopyWriter`, as
   the job's user) appends them to ``bv-goodput.<job>.r<restart>.u<uid>.<random>.copy.jsonl``
   in ITS node's events directory, with the same directory rules, flags, mode and bounds;
   each line once and in order; and when the supervisor's connection ends without the step's
   end, one `gone` line with the time. A later step's keeper gets the whole backlog and, once
   caught up, removes the older copies on its node. That node's epilog reads the copy as it
   reads a record (`collect_files`: a ``.copy`` file may name another node as its host; the
   node it lies on is root's word, `copy_on`), and every reader merges the copies and the
   batch node's own file with `merge_records` (same event twice = once). The ledger then
   names the batch node as the lost node when its prolog came and its epilog never did.
   Without a second node (a one-node step) there is no copy: the attempt is then known only
   from the other reports and its time is unattributed ("no supervisor record").

Standard library only: the supervisor and the hooks import it.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bluevela.launch.wire import NAME_MAX, bounded_int, fresh_seq, mac, safe_name
from bluevela.util.fs import read_bounded

logger = logging.getLogger(__name__)

CKPT_MAGIC = "bvck1"
EVENTS_DIR_ENV = "BV_EVENTS_DIR"
DEFAULT_DIR = "/tmp"
MAX_DATAGRAM = 256
MAX_CKPTS = 4096  # per launch kept one by one in the record; later saves are summed
MAX_LAUNCHES = 64
# The writer's bounds are the reader's: the supervisor never writes a file the epilog refuses.
MAX_LINES = 65536
MAX_FILE_BYTES = 2 << 20
MAX_CAUSE = 600
MAX_NODES = 1024  # node names listed per launch (a bigger job keeps the count)
MAX_STEP = 1 << 62
MAX_RANK = 1 << 20
MAX_AGE_MS = 7 * 86400 * 1000
# The longest `end` line (cause of MAX_CAUSE characters JSON-escaped at worst 12 bytes each,
# MAX_NODES names of NAME_MAX+3 characters quoted) and `requeue` line: the room the writer
# keeps free while a launch is open, so the events that close it always fit.
END_LINE_MAX = 400 + 12 * MAX_CAUSE + MAX_NODES * (NAME_MAX + 3 + 3)
REQUEUE_LINE_MAX = 64
CLOSE_RESERVE = END_LINE_MAX + REQUEUE_LINE_MAX
MAX_SCAN = 100_000  # directory entries the epilog looks at (a flooded /tmp stops there)
CKPT_WINDOW = 8  # recent saves the supervisor folds late ranks into
MAX_FILES = 8  # files of one attempt (owned by the job's user) the epilog reads
# Unix times must fall between these (2001 .. 2286): anything else is not a clock reading.
T_MIN, T_MAX = 1e9, 1e10
KINDS = ("ok", "failed", "lost", "hang", "signal", "terminated")
_NAME_RE = re.compile(
    r"^bv-goodput\.([0-9]{1,12})\.r([0-9]{1,5})\.u([0-9]{1,10})\.[0-9a-f]{16}(\.copy)?"
    r"\.jsonl$")
COPY_CHUNK = 1200  # characters of an event line per channel message (wire.MAX_LINE: 4096)
COPY_OUT_MAX = 64 * 1024  # bytes the copy's sender queues at once (the channel's MAX_OUT: 256 KB)


# --------------------------------------------------------------------------------------------
# The checkpoint datagram (ranks -> supervisor)


@dataclass(frozen=True)
class CkptMsg:
    rank: int
    step: int
    pid: int
    seq: int
    start_age_s: float
    end_age_s: float


def format_ckpt(msg: CkptMsg, key: bytes) -> bytes:
    body = (f"{CKPT_MAGIC} {msg.rank} {msg.step} {msg.pid} {msg.seq} "
            f"{max(0, int(msg.start_age_s * 1000))} {max(0, int(msg.end_age_s * 1000))}"
            ).encode("ascii")
    return body + b" " + mac(key, body)


def parse_ckpt(data: bytes, key: bytes) -> CkptMsg | None:
    """The checkpoint in a datagram signed with `key`, or None (never raises)."""
    try:
        if len(data) > MAX_DATAGRAM or not data.startswith(CKPT_MAGIC.encode()):
            return None
        body, _, tag = data.rpartition(b" ")
        if not hmac.compare_digest(tag, mac(key, body)):
            return None
        w = body.decode("ascii").split()
        if len(w) != 7:
            return None
        start, end = bounded_int(w[5], 0, MAX_AGE_MS), bounded_int(w[6], 0, MAX_AGE_MS)
        if end > start:  # ended before it started
            return None
        return CkptMsg(bounded_int(w[1], 0, MAX_RANK), bounded_int(w[2], -1, MAX_STEP), bounded_int(w[3], 1, 1 << 22),
                       bounded_int(w[4], 0, MAX_STEP), start / 1000.0, end / 1000.0)
    except (UnicodeDecodeError, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------------------------
# The supervisor's record


def events_dir(env: Mapping[str, str]) -> str:
    value = env.get(EVENTS_DIR_ENV, "")
    return value if value.startswith("/") and "\0" not in value else DEFAULT_DIR


class EventsDirError(OSError):
    """An events directory that another user could fill or replace (one-line reason)."""


def dir_layout(st: os.stat_result, path: str) -> str:
    """How files are laid out in an events directory with this lstat/fstat result:
    ``shared`` (root-owned with the sticky bit, like /tmp: the files lie in it, and no
    user can rename or remove another's) or ``per-user`` (root-owned, writable by root
    only: the files lie in ``<dir>/<uid>/``, which root creates for each user). Raises
    EventsDirError for anything else: a link, not a directory, owned by a user (they could
    swap files under the epilog), or writable by group/others without the sticky bit."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise EventsDirError(f"{path} is not a directory (a symlink is refused)")
    if st.st_uid not in (0, os.geteuid()):
        raise EventsDirError(f"{path} is owned by uid {st.st_uid}, not root: its owner can "
                             "replace any record in it")
    if st.st_mode & stat.S_ISVTX:
        return "shared"
    if st.st_mode & 0o022:
        raise EventsDirError(f"{path} is writable by group or others without the sticky "
                             f"bit (mode {stat.S_IMODE(st.st_mode):04o}): another user could "
                             "rename or remove the job's record; use mode 1777 or 0755 with "
                             "per-user directories")
    return "per-user"


def site_events_dir(environ: Mapping[str, str] | None = None) -> str:
    """The events directory the hooks use: BV_EVENTS_DIR from hook.env (`BV_HOOK_ENV`,
    else /etc/bluevela/hook.env, when readable), else from `environ`, else /tmp."""
    from pathlib import Path

    from bluevela.hooks.env import HOOK_ENV, read_hook_env

    environ = os.environ if environ is None else environ
    chosen = environ.get("BV_HOOK_ENV") or str(HOOK_ENV)
    values = {} if chosen == "none" else read_hook_env(Path(chosen))
    return events_dir({**environ, **values})


def events_dir_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """`bv site validate`'s check of the hooks' events directory: a one-line problem, or
    None when the epilog can trust it (`dir_layout`)."""
    path = site_events_dir(environ)
    if not os.path.lexists(path):
        return (f"goodput events directory {path} ({EVENTS_DIR_ENV}) does not exist: no "
                "job's goodput events can be recorded")
    problem = check_events_dir(path)[1]
    return None if problem is None else f"goodput events directory: {problem}"


def check_events_dir(path: str) -> tuple[str, str | None]:
    """(layout, problem) of the events directory at `path` for `bv site validate`: the
    problem is None when the epilog can trust it. Never raises."""
    try:
        layout = dir_layout(os.lstat(path), path)
    except EventsDirError as exc:
        return "", str(exc)
    except OSError as exc:
        return "", f"{path}: {exc.strerror or exc}"
    return layout, None


def open_user_dir(env: Mapping[str, str], uid: int) -> int:
    """A directory fd where the files of user `uid` lie (see `dir_layout`), checked; the
    caller closes it. Raises OSError (EventsDirError when the directory is refused)."""
    path = events_dir(env)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        layout = dir_layout(os.fstat(dfd), path)
    except OSError:
        os.close(dfd)
        raise
    if layout == "shared":
        return dfd
    try:
        ufd = os.open(str(uid), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(ufd)
    if st.st_uid not in (uid, 0) or st.st_mode & 0o022:
        os.close(ufd)
        raise EventsDirError(f"{path}/{uid} is not the user's own directory (owner "
                             f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
    return ufd


def ensure_user_dir(env: Mapping[str, str], uid: int, gid: int) -> None:
    """The prolog's part (root) in a per-user layout: ``<dir>/<uid>`` exists, a directory
    owned by the user, mode 0700. Nothing to do in a shared layout. Never raises (logged)."""
    path = events_dir(env)
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if dir_layout(os.fstat(dfd), path) != "per-user":
            return
        try:
            os.mkdir(str(uid), 0o700, dir_fd=dfd)
        except FileExistsError:
            return  # root made it (only root writes here); open_user_dir checks it
        fd = os.open(str(uid), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dfd)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("goodput events directory for uid %d not made in %s: %s", uid, path,
                       exc.strerror or exc)
    finally:
        os.close(dfd)


def slurm_times(job: str, timeout: float = 10.0) -> dict[str, float | None]:
    """Submit time, start time and time limit (s) of `job`, read once at the supervisor's
    start with ``squeue -h -j JOB -o %V|%S|%l`` (local times; a read, never an action on
    the job), each None when unknown. Bounded by `timeout`; never raises."""
    out: dict[str, float | None] = {"submit": None, "start": None, "time_limit_s": None}
    try:
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%V|%S|%l"],
                              capture_output=True, text=True, check=False, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return out
    words = (proc.stdout.strip().splitlines() or [""])[0].split("|")
    if proc.returncode != 0 or len(words) != 3:
        return out
    for key, value in (("submit", words[0]), ("start", words[1])):
        try:
            out[key] = time.mktime(time.strptime(value.strip(), "%Y-%m-%dT%H:%M:%S"))
        except (ValueError, OverflowError):
            pass
    out["time_limit_s"] = parse_limit(words[2].strip())
    return out


def parse_limit(text: str) -> float | None:
    """Slurm's `[days-]hours:minutes:seconds` (or `minutes:seconds`, `minutes`) in seconds."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = rest.split(":")
    try:
        nums = [int(p) for p in parts]
        d = int(days)
    except ValueError:
        return None
    if len(nums) == 3:
        h, m, s = nums
    elif len(nums) == 2:
        h, m, s = 0, nums[0], nums[1]
    elif len(nums) == 1:
        h, m, s = 0, nums[0], 0
    else:
        return None
    return float(((d * 24 + h) * 60 + m) * 60 + s)


class EventLog:
    """The supervisor's side. Every method is best-effort: an error disables the log (one
    line on stderr), never the supervisor.

    Bounded as the epilog reads (MAX_FILE_BYTES, MAX_LINES), with CLOSE_RESERVE bytes kept
    free while a launch is open: when the file is full, later saves are left out, never the
    `end` that closes the launch or the requeue. One `ckpt` line per save, not per rank: the
    ranks' datagrams of one step are folded in memory (first start, last end, rank count)
    and the line is written when the next save starts, the step ends or the job requeues
    (a 1,024 x 8-rank job: ~100 bytes per save instead of 8,192 lines)."""

    def __init__(self, fd: int | None, host: str) -> None:
        self.fd = fd
        self.host = host
        self.launch_no = 0
        self.started_mono = 0.0
        self.first_progress = False
        self.ckpts: dict[int, list[float]] = {}  # step -> [start, end, ranks], recent saves
        self.dirty: dict[int, None] = {}  # steps whose line is not written yet, in order
        self.ck_seqs: dict[tuple[int, int], int] = {}  # (rank, pid) -> last seq, this launch
        self.signal_mono: float | None = None
        self.lines = 0
        self.bytes = 0
        self.open_launch = False  # a launch line is written and its end not yet
        self.skipping = False  # this launch's line did not fit: its events are left out
        self.full_logged = False
        # The copy on a second node (`CopySender`): every line written, in order, and the
        # current step's keeper agent's channel.
        self.written: list[bytes] = []
        self.copy: CopySender | None = None

    @classmethod
    def open(cls, env: Mapping[str, str], host: str, *, query: bool = True) -> EventLog:
        job, restart = env.get("SLURM_JOB_ID", ""), env.get("SLURM_RESTART_COUNT") or "0"
        if not job.isdigit() or not restart.isdigit() or len(job) > 12 or len(restart) > 5:
            return cls(None, host)
        uid = os.getuid()
        name = f"bv-goodput.{job}.r{int(restart)}.u{uid}.{secrets.token_hex(8)}.jsonl"
        fd = None
        try:
            dfd = open_user_dir(env, uid)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_APPEND | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            logger.warning("no goodput events: cannot create %s in %s: %s", name,
                           events_dir(env), exc.strerror or exc)
        log = cls(fd, host)
        info: dict[str, Any] = {"e": "job", "t": time.time(), "host": host, "job": int(job),
                                "restart": int(restart)}
        if query and fd is not None:
            info.update(slurm_times(job))
        log._write(info)
        return log

    def _write(self, rec: dict[str, Any], *, closing: bool = False) -> bool:
        """Append one line; False when it was left out (no file, or no room for it)."""
        if self.fd is None:
            return False
        data = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        # A line that opens or fills a launch leaves room for the lines that close it.
        room = MAX_FILE_BYTES - (0 if closing else CLOSE_RESERVE)
        if self.bytes + len(data) > room or self.lines + (1 if closing else 3) > MAX_LINES:
            if not self.full_logged:
                self.full_logged = True
                logger.warning("goodput events full (%d lines, %d bytes): later %s events "
                               "are left out", self.lines, self.bytes, rec.get("e"))
            return False
        try:
            os.write(self.fd, data)
        except OSError as exc:
            logger.warning("goodput events stopped: %s", exc.strerror or exc)
            self.close()
            return False
        self.lines += 1
        self.bytes += len(data)
        self.written.append(data)
        if self.copy is not None:
            self.copy.pump(self.written)
        return True

    def attach(self, chan: Any) -> None:
        """Stream every line, the ones written so far first, to this step's keeper agent
        over its signed channel (`wire.Channel`): the copy its node's epilog reads when the
        supervisor's own node dies (`CopyWriter`). A later step's keeper replaces it."""
        if self.fd is None:
            return
        self.copy = CopySender(chan)
        self.copy.pump(self.written)

    def pump(self) -> None:
        """Send more of the copy's backlog (the supervisor's tick): the channel is fed at most
        COPY_OUT_MAX bytes ahead of what the socket took, so a long backlog never breaks it."""
        if self.copy is not None:
            self.copy.pump(self.written)

    def close(self) -> None:
        self._flush_ckpts()
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None

    @staticmethod
    def wall(mono: float) -> float:
        return time.time() - (time.monotonic() - mono)

    def launch(self, attempt: int, launch: int, nodes: list[str], spares: int,
               started_mono: float) -> None:
        self._flush_ckpts()
        self.launch_no = launch
        self.started_mono = started_mono
        self.first_progress = False
        self.ckpts, self.dirty, self.ck_seqs = {}, {}, {}
        self.skipping = not self._write({
            "e": "launch", "t": self.wall(started_mono), "attempt": attempt, "launch": launch,
            "n_nodes": len(nodes), "nodes": nodes[:MAX_NODES], "spares": spares})
        self.open_launch = not self.skipping

    def progress(self, mono: float) -> None:
        if not self.first_progress:
            self.first_progress = True
            if not self.skipping:
                self._write({"e": "progress", "t": self.wall(mono), "launch": self.launch_no})

    def datagram(self, data: bytes, key: bytes, max_ranks: int, now_mono: float) -> bool:
        """Record a checkpoint datagram of this step; True when it was one (valid or not).
        A datagram whose sequence number is not above the last one of its (rank, pid) is a
        replay and changes nothing (as for heartbeats)."""
        if not data.startswith(CKPT_MAGIC.encode()):
            return False
        msg = parse_ckpt(data, key)
        life = now_mono - self.started_mono + 5
        if msg is None or msg.rank >= max_ranks or msg.start_age_s > life:
            return True
        if not fresh_seq(self.ck_seqs, (msg.rank, msg.pid), msg.seq, 4 * max_ranks):
            return True  # a replayed or reordered datagram
        now = time.time()
        start, end = now - msg.start_age_s, now - msg.end_age_s
        have = self.ckpts.get(msg.step)
        if have is not None:  # another rank's save of the same step: one save, widest span
            have[0], have[1], have[2] = min(have[0], start), max(have[1], end), have[2] + 1
        else:
            self._flush_ckpts()  # a new save: the ones before it are complete
            self.ckpts[msg.step] = [start, end, 1]
            while len(self.ckpts) > CKPT_WINDOW:  # a late rank of an older save: a 2nd line
                del self.ckpts[next(iter(self.ckpts))]
        self.dirty[msg.step] = None
        return True

    def _flush_ckpts(self) -> None:
        """One line per save changed since its last line."""
        for step in list(self.dirty):
            c = self.ckpts.get(step)
            if c is not None and not self.skipping:
                self._write({"e": "ckpt", "launch": self.launch_no, "step": step,
                             "t0": round(c[0], 3), "t1": round(c[1], 3), "ranks": int(c[2])})
        self.dirty = {}

    def signal(self, mono: float) -> None:
        if self.signal_mono is None:
            self.signal_mono = mono

    def step_ended(self, kind: str, cause: str, lost: list[str], failed_mono: float | None,
                   detected_mono: float | None, gone_mono: float) -> None:
        """The step's end. For a signal the failure and its detection are the signal."""
        self._flush_ckpts()
        if kind in ("signal", "terminated") and self.signal_mono is not None:
            failed_mono = detected_mono = max(self.signal_mono, self.started_mono)
        failed = self.wall(failed_mono) if failed_mono is not None else None
        detected = self.wall(detected_mono) if detected_mono is not None else None
        if self.skipping:
            return
        names = [n for n in sorted(lost) if safe_name(n) == n][:MAX_NODES]
        self._write({"e": "end", "launch": self.launch_no, "kind": kind,
                     "cause": cause[:MAX_CAUSE], "nodes": names,
                     "failed": failed, "detected": detected, "gone": self.wall(gone_mono)},
                    closing=True)
        self.open_launch = False

    def requeue(self) -> None:
        self._flush_ckpts()
        self._write({"e": "requeue", "t": time.time()}, closing=True)


def failure_time(lost: Mapping[str, str], last_seen: Mapping[str, float], started: float,
                 detected: float, hang_progress: float | None) -> float:
    """When the step's failure happened (monotonic): a hang at the stuck rank's last progress;
    a node silent for --node-timeout at its agent's last message; a node that never
    connected at the step's start; anything else (a closed connection, a rank's exit) when
    it was seen, which is within one supervisor tick of it."""
    if hang_progress is not None:
        return min(hang_progress, detected)
    times = [detected]
    for node, why in lost.items():
        if why.startswith("silent for") and node in last_seen:
            times.append(last_seen[node])
        elif why.startswith("its agent never connected"):
            times.append(started)
    return min(times)


# --------------------------------------------------------------------------------------------
# The copy on a second node: a record the batch node's death cannot take


def keeper_of(nodes: list[str], host: str) -> str | None:
    """The node of a step that keeps the copy of the supervisor's events: the step's first
    node other than the supervisor's (None for a step on the supervisor's node alone)."""
    return next((n for n in nodes if n != host), None)


def copy_messages(n: int, line: bytes) -> list[dict[str, Any]]:
    """Line `n` of the events file as signed-channel messages (`ev`: part `i` of `k`)."""
    text = line.decode("utf-8", "replace").rstrip("\n")
    parts = [text[i:i + COPY_CHUNK] for i in range(0, len(text), COPY_CHUNK)] or [""]
    return [{"t": "ev", "n": n, "i": i, "k": len(parts), "d": d} for i, d in enumerate(parts)]


class CopySender:
    """The supervisor's side of one keeper's copy: sends line after line, in order, and no
    more than COPY_OUT_MAX bytes ahead of the socket; then `ev_synced` once caught up."""

    def __init__(self, chan: Any) -> None:
        self.chan = chan
        self.next = 0
        self.synced = -1

    def pump(self, written: list[bytes]) -> None:
        chan = self.chan
        if chan.broken is not None:
            return
        while self.next < len(written) and len(chan.out) < COPY_OUT_MAX:
            for msg in copy_messages(self.next, written[self.next]):
                chan.send(msg)
            self.next += 1
        if self.next == len(written) and self.synced != self.next:
            self.synced = self.next
            chan.send({"t": "ev_synced", "n": self.next})


class CopyWriter:
    """The keeper agent's side (as the job's user, on its own node): appends the lines of
    the supervisor's events file it is sent to ``<dir>/bv-goodput.<job>.r<restart>.u<uid>.
    <random>.copy.jsonl`` in its node's events directory, with the supervisor's rules
    (`open_user_dir`, O_EXCL|O_NOFOLLOW, mode 0600) and bounds (MAX_FILE_BYTES, MAX_LINES,
    a line at most END_LINE_MAX). Lines are taken in order, each once: a repeated or
    out-of-order one changes nothing. When the supervisor vanishes (its connection ends
    without the step's end), `gone()` appends when the keeper saw it go. Once caught up
    (`ev_synced`), the copies an earlier step's keeper left on this node are removed: this
    one holds every line of them. Never raises."""

    def __init__(self, env: Mapping[str, str], node: str) -> None:
        self.env = env
        self.node = node
        self.fd: int | None = None
        self.name = ""
        self.prefix = ""
        self.failed = False
        self.next = 0  # the next line number wanted
        self.parts: list[str] = []
        self.lines = 0
        self.bytes = 0

    def feed(self, msg: Mapping[str, Any]) -> None:
        try:
            if msg.get("t") == "ev_synced":
                if msg.get("n") == self.next and self.fd is not None:
                    self._remove_older()
                return
            n, i, k, d = msg.get("n"), msg.get("i"), msg.get("k"), msg.get("d")
            if not (isinstance(n, int) and isinstance(i, int) and isinstance(k, int)
                    and isinstance(d, str)) or n != self.next or i != len(self.parts) \
                    or not 0 <= i < k <= END_LINE_MAX // COPY_CHUNK + 1:
                return
            self.parts.append(d)
            if len(self.parts) < k:
                return
            line, self.parts = "".join(self.parts), []
            self.next += 1
            self._append(line.encode() + b"\n")
        except (TypeError, ValueError, UnicodeError):
            self.parts = []

    def gone(self) -> None:
        """The supervisor's connection ended: when, in the keeper's words."""
        if self.fd is not None:
            self._append(json.dumps({"e": "gone", "t": time.time(), "on": self.node},
                                    separators=(",", ":")).encode() + b"\n")

    def _open(self, first: bytes) -> None:
        self.failed = True  # one try
        try:
            head = json.loads(first)
            job, restart = int(head["job"]), int(head["restart"])
        except (ValueError, KeyError, TypeError):
            return
        if head.get("e") != "job" or not (0 <= job < 10**12 and 0 <= restart < 10**5):
            return
        uid = os.getuid()
        name = f"bv-goodput.{job}.r{restart}.u{uid}.{secrets.token_hex(8)}.copy.jsonl"
        try:
            dfd = open_user_dir(self.env, uid)
            try:
                self.fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                  | os.O_APPEND | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            logger.warning("no copy of the goodput events: cannot create %s in %s: %s", name,
                           events_dir(self.env), exc.strerror or exc)
            return
        self.name, self.failed = name, False
        self.prefix = f"bv-goodput.{job}.r{restart}.u{uid}."

    def _append(self, data: bytes) -> None:
        if self.fd is None and not self.failed:
            self._open(data)
        if self.fd is None:
            return
        if (len(data) > END_LINE_MAX or self.bytes + len(data) > MAX_FILE_BYTES
                or self.lines + 1 > MAX_LINES):
            return
        try:
            os.write(self.fd, data)
        except OSError as exc:
            logger.warning("copy of the goodput events stopped: %s", exc.strerror or exc)
            os.close(self.fd)
            self.fd, self.failed = None, True
            return
        self.lines += 1
        self.bytes += len(data)

    def _remove_older(self) -> None:
        uid = os.getuid()
        try:
            dfd = open_user_dir(self.env, uid)
        except OSError:
            return
        try:
            with os.scandir(dfd) as entries:
                old = [e.name for n, e in zip(range(MAX_SCAN), entries, strict=False)
                       if e.name.startswith(self.prefix) and e.name.endswith(".copy.jsonl")
                       and e.name != self.name and _NAME_RE.match(e.name)]
            for name in old:
                _unlink(dfd, name, uid)
        except OSError:
            pass
        finally:
            os.close(dfd)


def merge_records(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two validated records of the same Slurm attempt (the supervisor's file and a copy, or
    two copies) as one: every event once. Both are the same line sequence, one maybe cut
    short, so a launch is the one that knows more (its end, more saves), saves are united by
    step, times that only one knows are kept. Idempotent: merge(a, a) == a."""
    if a is None:
        return b
    out = dict(a)
    out["slurm"] = {k: a["slurm"].get(k) if a["slurm"].get(k) is not None
                    else b["slurm"].get(k) for k in a["slurm"]}
    out["requeue"] = a["requeue"] if a["requeue"] is not None else b["requeue"]
    for key in ("gone", "copy_on"):
        if out.get(key) is None and b.get(key) is not None:
            out[key] = b[key]
    mine = {la["launch"]: la for la in a["launches"]}
    merged = []
    for la in b["launches"]:
        have = mine.pop(la["launch"], None)
        if have is None:
            merged.append(la)
            continue
        best = dict(have if have["end"] is not None or la["end"] is None else la)
        steps = {c[0]: c for c in have["ckpts"]}
        for c in la["ckpts"]:
            h = steps.get(c[0])
            steps[c[0]] = c if h is None else [c[0], min(h[1], c[1]), max(h[2], c[2])]
        best["ckpts"] = sorted(steps.values(), key=lambda c: (c[2], c[0]))[:MAX_CKPTS]
        fp = [x for x in (have["first_progress"], la["first_progress"]) if x is not None]
        best["first_progress"] = min(fp) if fp else None
        best["ckpt_more"] = max(have["ckpt_more"], la["ckpt_more"])
        merged.append(best)
    merged.extend(mine.values())
    out["launches"] = sorted(merged, key=lambda la: la["launch"])[:MAX_LAUNCHES]
    return out


# --------------------------------------------------------------------------------------------
# Reading the record (the epilog, as root; the ledger again)


class EventsError(ValueError):
    """An events file or record that does not pass the checks (one-line reason)."""


def _t(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventsError(f"{where} is not a number")
    v = float(value)
    if not (math.isfinite(v) and T_MIN <= v <= T_MAX):
        raise EventsError(f"{where} is not a unix time")
    return v


def _opt_t(value: Any, where: str) -> float | None:
    return None if value is None else _t(value, where)


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise EventsError(f"{where} is not an integer in [{lo}, {hi}]")
    return value


def _nodes(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_NODES:
        raise EventsError(f"{where} is not a list of at most {MAX_NODES} names")
    out = []
    for n in value:
        if not isinstance(n, str) or safe_name(n) != n:
            raise EventsError(f"{where} holds a name that is not a node name")
        out.append(n)
    return out


def fold(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The event lines of one Slurm attempt -> one record (the shape `validate` checks)."""
    rec: dict[str, Any] = {"v": 1, "launches": []}
    by: dict[int, dict[str, Any]] = {}
    for i, ev in enumerate(lines):
        if not isinstance(ev, dict):
            raise EventsError(f"line {i + 1} is not an object")
        kind = ev.get("e")
        where = f"line {i + 1} ({safe_name(kind, 16)})"
        if kind == "job":
            if "host" in rec:
                raise EventsError(f"{where}: a second job line")
            rec["host"] = ev.get("host")
            rec["job"] = ev.get("job")
            rec["restart"] = ev.get("restart")
            rec["opened"] = ev.get("t")
            rec["slurm"] = {k: ev.get(k) for k in ("submit", "start", "time_limit_s")}
            continue
        if kind == "requeue":
            rec["requeue"] = ev.get("t")
            continue
        if kind == "gone":  # a copy's keeper saw the supervisor's connection end
            rec["gone"] = ev.get("t")
            continue
        n = ev.get("launch")
        if kind == "launch":
            if len(by) >= MAX_LAUNCHES or not isinstance(n, int) or n in by:
                raise EventsError(f"{where}: a launch number repeated or too many launches")
            by[n] = {"launch": n, "attempt": ev.get("attempt"), "start": ev.get("t"),
                     "n_nodes": ev.get("n_nodes"), "nodes": ev.get("nodes"),
                     "spares": ev.get("spares"), "first_progress": None, "ckpts": {},
                     "ckpt_more": [0, 0.0], "end": None, "_over": {}}
            rec["launches"].append(by[n])
            continue
        if not isinstance(n, int) or n not in by:
            raise EventsError(f"{where}: an event of no launch")
        la = by[n]
        if kind == "progress":
            la["first_progress"] = la["first_progress"] or ev.get("t")
        elif kind == "ckpt":
            # One line per save (a later line of the same step widens it); the first
            # MAX_CKPTS saves of a launch are kept one by one, the rest summed in ckpt_more.
            step = _int(ev.get("step"), f"{where} step", -1, MAX_STEP)
            t0, t1 = _t(ev.get("t0"), where), _t(ev.get("t1"), where)
            ck = la["ckpts"] if step in la["ckpts"] or len(la["ckpts"]) < MAX_CKPTS \
                else la["_over"]
            have = ck.get(step)
            ck[step] = [step, t0, t1] if have is None else \
                [step, min(have[1], t0), max(have[2], t1)]
        elif kind == "ckpt_more":
            t0, t1 = _t(ev.get("t0"), where), _t(ev.get("t1"), where)
            la["ckpt_more"] = [la["ckpt_more"][0] + 1, la["ckpt_more"][1] + max(0.0, t1 - t0)]
        elif kind == "end":
            la["end"] = {k: ev.get(k) for k in ("kind", "cause", "nodes", "failed", "detected",
                                                 "gone")}
        else:
            raise EventsError(f"{where}: unknown event")
    for la in rec["launches"]:
        la["ckpts"] = sorted(la["ckpts"].values(), key=lambda c: (c[2], c[0]))
        over = la.pop("_over").values()
        la["ckpt_more"] = [la["ckpt_more"][0] + len(over),
                           la["ckpt_more"][1] + sum(max(0.0, c[2] - c[1]) for c in over)]
    return validate(rec)


def validate(rec: Any) -> dict[str, Any]:
    """Check a folded record (from the epilog, or read back from the archive) field by field;
    returns a clean copy. Raises EventsError with a one-line reason."""
    if not isinstance(rec, dict) or rec.get("v") != 1:
        raise EventsError("not a version-1 goodput record")
    host = rec.get("host")
    if not isinstance(host, str) or safe_name(host) != host:
        raise EventsError("host is not a node name")
    slurm = rec.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise EventsError("slurm is not an object")
    limit = slurm.get("time_limit_s")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)
                              or not 0 <= limit <= 366 * 86400):
        raise EventsError("time_limit_s is out of range")
    out: dict[str, Any] = {
        "v": 1, "host": host, "job": _int(rec.get("job"), "job", 0, 10**12),
        "restart": _int(rec.get("restart"), "restart", 0, 65535),
        "opened": _t(rec.get("opened"), "opened"),
        "slurm": {"submit": _opt_t(slurm.get("submit"), "slurm.submit"),
                  "start": _opt_t(slurm.get("start"), "slurm.start"),
                  "time_limit_s": None if limit is None else float(limit)},
        "requeue": _opt_t(rec.get("requeue"), "requeue"), "launches": []}
    if rec.get("gone") is not None:
        out["gone"] = _t(rec["gone"], "gone")
    if rec.get("copy_on") is not None:
        on = rec["copy_on"]
        if not isinstance(on, str) or safe_name(on) != on:
            raise EventsError("copy_on is not a node name")
        out["copy_on"] = on
    launches = rec.get("launches")
    if not isinstance(launches, list) or len(launches) > MAX_LAUNCHES:
        raise EventsError(f"launches is not a list of at most {MAX_LAUNCHES}")
    for i, la in enumerate(launches):
        w = f"launch {i + 1}"
        if not isinstance(la, dict):
            raise EventsError(f"{w} is not an object")
        ckpts = la.get("ckpts")
        if not isinstance(ckpts, list) or len(ckpts) > MAX_CKPTS:
            raise EventsError(f"{w}: ckpts is not a list of at most {MAX_CKPTS}")
        clean_ck = []
        for c in ckpts:
            if not isinstance(c, list) or len(c) != 3:
                raise EventsError(f"{w}: a checkpoint is not [step, start, end]")
            step = _int(c[0], f"{w} checkpoint step", -1, MAX_STEP)
            t0, t1 = _t(c[1], f"{w} checkpoint start"), _t(c[2], f"{w} checkpoint end")
            if t1 < t0:
                raise EventsError(f"{w}: a checkpoint ends before it starts")
            clean_ck.append([step, t0, t1])
        more = la.get("ckpt_more") or [0, 0.0]
        if (not isinstance(more, list) or len(more) != 2
                or not isinstance(more[1], int | float) or not 0 <= more[1] <= 1e9):
            raise EventsError(f"{w}: ckpt_more is not [count, seconds]")
        end = la.get("end")
        clean_end = None
        if end is not None:
            if not isinstance(end, dict) or end.get("kind") not in KINDS:
                raise EventsError(f"{w}: end is not an object with a known kind")
            cause = end.get("cause")
            if not isinstance(cause, str) or len(cause) > MAX_CAUSE:
                raise EventsError(f"{w}: cause is not a short text")
            clean_end = {"kind": end["kind"], "cause": "".join(
                             c if c.isprintable() else "?" for c in cause),
                         "nodes": _nodes(end.get("nodes") or [], f"{w} end nodes"),
                         "failed": _opt_t(end.get("failed"), f"{w} failed"),
                         "detected": _opt_t(end.get("detected"), f"{w} detected"),
                         "gone": _t(end.get("gone"), f"{w} gone")}
        out["launches"].append({
            "launch": _int(la.get("launch"), f"{w} launch", 1, 10**6),
            "attempt": _int(la.get("attempt"), f"{w} attempt", 1, 10**6),
            "start": _t(la.get("start"), f"{w} start"),
            "n_nodes": _int(la.get("n_nodes"), f"{w} n_nodes", 1, 10**6),
            "nodes": _nodes(la.get("nodes"), f"{w} nodes"),
            "spares": _int(la.get("spares"), f"{w} spares", 0, 10**6),
            "first_progress": _opt_t(la.get("first_progress"), f"{w} first_progress"),
            "ckpts": clean_ck,
            "ckpt_more": [_int(more[0], f"{w} ckpt_more", 0, 10**9), float(more[1])],
            "end": clean_end})
    return out


def read_events_file(data: bytes) -> dict[str, Any]:
    """Parse one events file's bytes (JSON lines) into a validated record."""
    if len(data) > MAX_FILE_BYTES:
        raise EventsError(f"larger than {MAX_FILE_BYTES} bytes")
    lines: list[dict[str, Any]] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_LINES:
            raise EventsError(f"more than {MAX_LINES} lines")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            if n == data.count(b"\n") + 1:  # a last line cut by a killed writer: skipped
                break
            raise EventsError(f"line {n} is not JSON") from exc
        lines.append(obj)
    return fold(lines)


@dataclass
class Collected:
    """What the epilog read of one attempt: the record, and the files it came from (removed
    only once the report holding the record is spooled: `remove`)."""

    record: dict[str, Any]
    names: list[str]
    uid: int
    env: Mapping[str, str]

    def remove(self) -> None:
        """Remove the files read (never raises): call it after the spool write succeeded."""
        try:
            dfd = open_user_dir(self.env, self.uid)
        except OSError:
            return
        try:
            for name in self.names:
                _unlink(dfd, name, self.uid)
        finally:
            os.close(dfd)


def collect(job_id: int, restart: int, node: str, uid: int | None,
            env: Mapping[str, str] | None = None, *, remove: bool = False
            ) -> dict[str, Any] | None:
    """The epilog's read (as root) of the supervisor's events of this job attempt on this
    node, or None (see `collect_files`); with `remove`, the files read are removed."""
    found = collect_files(job_id, restart, node, uid, env)
    if found is None:
        return None
    if remove:
        found.remove()
    return found.record


def collect_files(job_id: int, restart: int, node: str, uid: int | None,
                  env: Mapping[str, str] | None = None) -> Collected | None:
    """Read the events files of this job attempt on this node, as root, as hostile input.

    Only a directory that no other user can fill or replace is read (`dir_layout`); at most
    MAX_SCAN entries of it are looked at (scandir). The files are named with the job's uid
    and filtered by their owner (the job's user, from lstat) BEFORE the MAX_FILES cap, so
    another user's files, whatever their names, never push the real record out. Never
    follows a symlink, never reads more than MAX_FILE_BYTES; a file that fails a check is
    logged and left out (and kept, for a person to look at). Never raises."""
    if uid is None:
        return None
    env = os.environ if env is None else env
    try:
        dfd = open_user_dir(env, uid)
    except OSError as exc:
        if isinstance(exc, EventsDirError):
            logger.warning("goodput events not read: %s", exc)
        return None
    found: dict[str, Any] | None = None
    by_host: dict[str, dict[str, Any]] = {}
    read: list[str] = []
    try:
        names = []
        with os.scandir(dfd) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_SCAN:
                    logger.warning("goodput events: more than %d entries in %s, the rest "
                                   "not looked at (per-user directories avoid this)",
                                   MAX_SCAN, events_dir(env))
                    break
                m = _NAME_RE.match(entry.name)
                if (m is None or int(m.group(1)) != job_id or int(m.group(2)) != restart
                        or int(m.group(3)) != uid):
                    continue
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                    names.append(entry.name)
        for name in sorted(names)[:MAX_FILES]:
            # A copy (a keeper agent's, of another node's supervisor) names that node as its
            # host; where it lies is root's word.
            copy = name.endswith(".copy.jsonl")
            try:
                rec = _read_one(dfd, name, uid)
                if (rec["host"] != node and not copy) or rec["job"] != job_id \
                        or rec["restart"] != restart:
                    raise EventsError(f"written for job {rec['job']}.r{rec['restart']} on "
                                      f"{rec['host']}, not this node's attempt")
            except (OSError, EventsError) as exc:
                logger.warning("goodput events %s left out: %s", name, exc)
                continue
            read.append(name)
            if copy:
                rec["copy_on"] = node
            by_host[rec["host"]] = merge_records(by_host.get(rec["host"]), rec)
        # this node's own supervisor's record first (with any copy of it merged), else a copy
        found = by_host.get(node) or next(iter(by_host.values()), None)
    except OSError as exc:
        logger.warning("goodput events not read: %s", exc.strerror or exc)
    finally:
        os.close(dfd)
    return None if found is None else Collected(found, read, uid, env)


def _read_one(dfd: int, name: str, uid: int) -> dict[str, Any]:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EventsError("not a regular file")
        if st.st_uid != uid:
            raise EventsError(f"owned by uid {st.st_uid}, not the job's user {uid}")
        return read_events_file(read_bounded(fd, MAX_FILE_BYTES + 1))
    finally:
        os.close(fd)


def _unlink(dfd: int, name: str, uid: int) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def collect_for_epilog(job_id: int, restart: int, node: str,
                       env: Mapping[str, str] | None = None) -> Collected | None:
    """`collect_files` with the job's user from ``SLURM_JOB_UID`` (the epilog's
    environment). The caller removes the files (`Collected.remove`) once spooled."""
    env = os.environ if env is None else env
    raw = env.get("SLURM_JOB_UID", "")
    if not raw.isdigit() or len(raw) > 10:
        return None
    return collect_files(job_id, restart, node, int(raw), env)


def prepare_for_prolog(env: Mapping[str, str] | None = None) -> None:
    """The prolog's part: the job user's directory in a per-user layout (`ensure_user_dir`),
    from ``SLURM_JOB_UID``/``SLURM_JOB_GID``. Never raises."""
    env = os.environ if env is None else env
    uid, gid = env.get("SLURM_JOB_UID", ""), env.get("SLURM_JOB_GID", "")
    if uid.isdigit() and len(uid) <= 10 and gid.isdigit() and len(gid) <= 10:
        ensure_user_dir(env, int(uid), int(gid))
