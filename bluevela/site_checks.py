"""`bv site validate`: the site file checked against the cluster it runs on.

Gather, then evaluate: `gather()` reads the facts once (`sinfo`, `scontrol show config`, the
stat and the mount of the spool and the archive, the slurm.conf additions of the installed
`slurm/hooks.conf`) into `SiteFacts`; each `check_*` is a pure function of those facts that
returns `Finding`s. `validate()` runs them all; the CLI (bluevela/cli/cmd_site.py) prints.

A check that cannot run (Slurm unreachable, a directory missing here) is a WARNING, never an
error: `bv site validate` also runs on hosts that are not the controller.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.health.result import Status, worst

if TYPE_CHECKING:
    import subprocess

    from bluevela.site import Site

logger = logging.getLogger(__name__)

# hooks.conf keys whose value is a comma-separated set: bv's flags are ADDED to the site's own.
LIST_KEYS = frozenset({"PrologFlags", "SchedulerParameters", "HealthCheckNodeState"})
# Keys whose value is a number of seconds bv needs at least (the site may keep a larger one).
AT_LEAST_KEYS = frozenset({"PrologEpilogTimeout"})
# Keys bv needs set (non-zero) whatever the value: the site's choice (hooks.conf says why).
ANY_VALUE_KEYS = frozenset({"HealthCheckInterval"})
NFS_TYPES = frozenset({"nfs", "nfs4"})

Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Finding:
    """One line of `bv site validate`: a status, the check's name, the fact."""

    status: Status
    check: str
    message: str

    def line(self) -> str:
        return f"{self.status.name}: {self.check}: {self.message}"


@dataclass(frozen=True)
class Mount:
    """The mount a path is on (from /proc/self/mountinfo)."""

    point: str
    fstype: str
    source: str
    options: str = ""


@dataclass(frozen=True)
class DirFacts:
    """What `validate` needs to know about the spool or the archive."""

    role: str  # "spool" or "archive"
    path: str
    exists: bool
    is_symlink: bool = False
    uid: int = -1
    mode: int = 0
    mount: Mount | None = None
    # Created as root and read back: the owner root's file got (65534 under NFS root_squash);
    # None when not probed (not root, or the directory is missing).
    root_write_uid: int | None = None
    probe_error: str = ""


@dataclass(frozen=True)
class SiteFacts:
    """Everything the checks evaluate, read once."""

    node_classes: Mapping[str, frozenset[str]]  # class -> hostnames
    sinfo_nodes: tuple[str, ...] | None  # None: sinfo did not answer
    sinfo_error: str = ""
    config: Mapping[str, str] | None = None  # `scontrol show config`; None: not reachable
    config_error: str = ""
    wanted: tuple[tuple[str, str], ...] = ()  # hooks.conf KEY=VALUE lines, in order
    dirs: tuple[DirFacts, ...] = ()
    slurm_user_uid: int | None = None
    budget: Sequence[Finding] = field(default_factory=tuple)


# --------------------------------------------------------------------------------------------
# Pure pieces


def parse_hooks_conf(text: str) -> list[tuple[str, str]]:
    """The KEY=VALUE lines of slurm/hooks.conf (comments and blank lines skipped)."""
    out: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if sep and key.strip():
            out.append((key.strip(), value.strip()))
    return out


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` as KEY -> value (`KEY = value` lines)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def _flags(value: str) -> list[str]:
    value = value.strip()
    if value in ("", "(null)", "none", "NONE"):
        return []
    return [f.strip() for f in value.split(",") if f.strip()]


def _seconds(value: str) -> float | None:
    word = value.strip().split(" ", 1)[0]
    try:
        return float(word)
    except ValueError:
        return None


def merged_lines(wanted: Sequence[tuple[str, str]],
                 config: Mapping[str, str] | None) -> list[tuple[str, bool]]:
    """The slurm.conf lines bv expects, merged with the running config: (line, already so).

    Flag keys (PrologFlags, SchedulerParameters, HealthCheckNodeState) keep the site's own
    flags and add bv's; PrologEpilogTimeout keeps a larger running value; other keys are bv's
    value (HealthCheckInterval: any non-zero one). Without a config every line is bv's own, and none is known to be in place."""
    out: list[tuple[str, bool]] = []
    for key, value in wanted:
        running = None if config is None else config.get(key)
        if running is None:
            out.append((f"{key}={value}", False))
            continue
        if key in LIST_KEYS:
            have = _flags(running)
            names = {f.split("=", 1)[0].lower() for f in have}
            add = [f for f in _flags(value) if f.split("=", 1)[0].lower() not in names]
            out.append((f"{key}={','.join(have + add)}", not add))
        elif key in ANY_VALUE_KEYS and _seconds(running):
            out.append((f"{key}={running.split(' ', 1)[0]}", True))
        elif key in AT_LEAST_KEYS:
            now, need = _seconds(running), _seconds(value)
            if now is not None and need is not None and (now >= need or now == 0):
                # 0: no limit at all.
                out.append((f"{key}={running.split(' ', 1)[0]}", True))
            else:
                out.append((f"{key}={value}", False))
        else:
            out.append((f"{key}={value}", running.split(" ", 1)[0] == value))
    return out


def check_slurm_conf(facts: SiteFacts) -> list[Finding]:
    """Are bv's slurm.conf additions in the running config?"""
    if facts.config is None:
        return [Finding(Status.WARNING, "slurm.conf",
                        f"running config not readable ({facts.config_error or 'scontrol failed'}):"
                        " the additions of slurm/hooks.conf are not checked")]
    missing = [line for line, ok in merged_lines(facts.wanted, facts.config) if not ok]
    if not missing:
        return [Finding(Status.OK, "slurm.conf", "every addition of hooks.conf is in place")]
    return [Finding(Status.WARNING, "slurm.conf",
                    f"not in the running config: {'; '.join(missing)}")]


def check_slurm_release(config: Mapping[str, str] | None) -> list[Finding]:
    """The running Slurm's release, whether bv was tested on it, and what bv can use there:
    growing a job and, from 25.11, the expedited requeue (bluevela/slurm/releases.py)."""
    from bluevela.slurm import releases

    if config is None:
        return []  # check_slurm_conf says why
    version = config.get("SLURM_VERSION", "").strip()
    rel = releases.release(config)
    if rel is None:
        return [Finding(Status.WARNING, "slurm release",
                        f"cannot read the release from SLURM_VERSION {version!r}")]
    name = f"{rel[0]}.{rel[1]:02d}"
    problem = releases.expansion_problem(config)
    grow = "grow: on" if problem is None else f"grow: off ({problem})"
    expedite = {
        "unavailable": "expedited requeue: not in this release (25.11 and later)",
        "on": f"expedited requeue: on ({releases.EXPEDITE_PARAM})",
        "off": f"expedited requeue: off (SlurmctldParameters lacks {releases.EXPEDITE_PARAM})",
    }[releases.expedite_state(config)]
    if name in releases.TESTED:
        return [Finding(Status.OK, "slurm release",
                        f"Slurm {version}: bv is tested on {name}; {grow}; {expedite}")]
    return [Finding(Status.WARNING, "slurm release",
                    f"Slurm {version}: bv is not tested on {name} (tested: "
                    f"{', '.join(releases.TESTED)}; docs/install.md); {grow}; {expedite}")]


def check_node_classes(facts: SiteFacts) -> list[Finding]:
    """Every node `sinfo` lists must be in one node class of site.yaml."""
    if facts.sinfo_nodes is None:
        return [Finding(Status.WARNING, "node classes",
                        f"sinfo did not answer ({facts.sinfo_error or 'failed'}): not checked")]
    classes = {n: c for c, names in facts.node_classes.items() for n in names}
    missing = sorted(n for n in facts.sinfo_nodes if n not in classes)
    if missing:
        shown = ", ".join(missing[:20]) + (f" (+{len(missing) - 20} more)" if len(missing) > 20
                                           else "")
        return [Finding(Status.CRITICAL, "node classes",
                        f"{len(missing)} of {len(facts.sinfo_nodes)} nodes in sinfo have no node "
                        f"class in site.yaml (their hooks fail open and check nothing): {shown}")]
    return [Finding(Status.OK, "node classes",
                    f"all {len(facts.sinfo_nodes)} nodes in sinfo have a node class")]


def check_directory(d: DirFacts, slurm_user_uid: int | None = None) -> list[Finding]:
    """The spool or the archive: root- (or SlurmUser-) owned, not group/other-writable, and a
    word about NFS root_squash."""
    name = f"{d.role} {d.path}"
    if not d.exists:
        return [Finding(Status.WARNING, d.role, f"{d.path} does not exist on this host "
                        "(create it as docs/install.md 1.3 says; not checked)")]
    out: list[Finding] = []
    owners = {0} | ({slurm_user_uid} if slurm_user_uid is not None else set())
    if d.is_symlink:
        out.append(Finding(Status.WARNING, d.role, f"{name} is a symlink: give site.yaml the "
                           "real path (ingest refuses to follow one)"))
    if d.uid not in owners:
        out.append(Finding(Status.CRITICAL, d.role,
                           f"{name} is owned by uid {d.uid}: it must belong to the ingest user, "
                           "root or SlurmUser"))
    if d.mode & (stat.S_IWGRP | stat.S_IWOTH):
        out.append(Finding(Status.CRITICAL, d.role,
                           f"{name} is group/other-writable (mode {stat.S_IMODE(d.mode):04o}): "
                           "anyone could plant reports or redirect root's ingest; chmod 0755"))
    if d.mount is not None and d.mount.fstype in NFS_TYPES:
        if d.root_write_uid is not None and d.root_write_uid != 0:
            out.append(Finding(Status.CRITICAL, d.role,
                               f"{name} is on NFS ({d.mount.source}) with root squashed: a file "
                               f"root created here belongs to uid {d.root_write_uid}; the hooks "
                               "write as root: export it with no_root_squash"))
        else:
            out.append(Finding(Status.WARNING, d.role,
                               f"{name} is on NFS ({d.mount.source}): the compute nodes' hooks "
                               "write as root, so export it to them with no_root_squash "
                               "(root_squash makes them nobody: reports lost); set "
                               "HDF5_USE_FILE_LOCKING=FALSE for ingest"))
    if d.probe_error:
        out.append(Finding(Status.WARNING, d.role, f"{name}: root could not write a test file "
                           f"({d.probe_error})"))
    if not out:
        out.append(Finding(Status.OK, d.role, f"{name}: owner uid {d.uid}, mode "
                           f"{stat.S_IMODE(d.mode):04o}"
                           + (f", on {d.mount.fstype}" if d.mount else "")))
    return out


def check_timeouts(facts: SiteFacts) -> list[Finding]:
    """Each hook's worst case against its kill (from bluevela.hooks.budget)."""
    return list(facts.budget)


def check_drain_timeout(drain_timeout_s: float, config: Mapping[str, str] | None) -> list[Finding]:
    """health.drain_timeout_s must stay below the controller's MessageTimeout (the hooks' scontrol
    calls give up at drain_timeout_s; Slurm's own RPC retries at MessageTimeout)."""
    if config is None or "MessageTimeout" not in config:
        return []
    mt = _seconds(config["MessageTimeout"])
    if mt is not None and drain_timeout_s >= mt:
        return [Finding(Status.WARNING, "timeouts",
                        f"health.drain_timeout_s ({drain_timeout_s:g} s) is not below Slurm's "
                        f"MessageTimeout ({mt:g} s): a slow drain RPC is cut off before Slurm's "
                        "own answer")]
    return []


# --------------------------------------------------------------------------------------------
# Gathering


def mount_of(path: str, mountinfo: str) -> Mount | None:
    """The mount `path` (absolute, resolved) is on, from /proc/self/mountinfo text."""
    best: Mount | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if not sep or len(parts) < 6 or len(rparts) < 2:
            continue
        point = parts[4].replace("\\040", " ")
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best.point):
                best = Mount(point, rparts[0], rparts[1], rparts[2] if len(rparts) > 2 else "")
    return best


def _root_write_probe(path: str) -> tuple[int | None, str]:
    """As root: create and remove a file in `path`; the uid it got (not 0 on a squashed NFS)."""
    if os.geteuid() != 0:
        return None, ""
    name = f".bv-site-validate-{os.getpid()}"
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=dfd)
        try:
            uid = os.fstat(fd).st_uid
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dfd)
        return uid, ""
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(dfd)


def dir_facts(role: str, path: Path, mountinfo: str) -> DirFacts:
    p = str(path)
    try:
        st = os.lstat(p)
    except OSError:
        return DirFacts(role, p, exists=False)
    is_link = stat.S_ISLNK(st.st_mode)
    if is_link:
        try:
            st = os.stat(p)
        except OSError:
            return DirFacts(role, p, exists=False, is_symlink=True)
    real = os.path.realpath(p)
    uid, err = _root_write_probe(real)
    return DirFacts(role, p, True, is_link, st.st_uid, st.st_mode, mount_of(real, mountinfo),
                    uid, err)


def _run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """One try through the seam to Slurm (bluevela/slurm/command.py), bounded by `timeout`;
    a failure reads as exit 1 with its one-line reason (exit status None: cut, or no such
    command)."""
    import subprocess

    from bluevela.slurm.command import run_slurm

    call = run_slurm(argv, timeout_s=timeout)
    return subprocess.CompletedProcess(list(argv), 0 if call.ok else call.status or 1,
                                       call.stdout, call.why)


def _budget_findings(site: Site, config: Mapping[str, str] | None,
                     partitions: int = 1) -> list[Finding]:
    """The prolog's and the epilog's worst case (bluevela.hooks.budget) against Slurm's
    PrologEpilogTimeout, the healthcheck's against slurmd's 60 s: past it Slurm kills the hook
    (and drains the node itself for a prolog or epilog)."""
    from bluevela.hooks import budget

    raw = None if config is None else config.get("PrologEpilogTimeout")
    timeout = None if raw is None else _seconds(raw)
    out: list[Finding] = []
    for phase in ("prolog", "epilog"):
        b = budget.hook_budget(site, phase, partitions=partitions)
        if timeout is None:
            out.append(Finding(Status.WARNING, "timeouts",
                               f"{b.text()}; PrologEpilogTimeout unknown (running config not "
                               "readable): not compared"))
        elif b.total_s > timeout:
            out.append(Finding(Status.CRITICAL, "timeouts",
                               f"{b.text()} > PrologEpilogTimeout={timeout:g}: Slurm would kill "
                               "the hook and drain the node outside the fleet breaker; raise "
                               "PrologEpilogTimeout or lower the caps in site.yaml"))
        else:
            out.append(Finding(Status.OK, "timeouts",
                               f"{b.text()} <= PrologEpilogTimeout={timeout:g}"))
    # slurmd kills the healthcheck at 60 s whatever slurm.conf says: no config needed.
    hc = budget.healthcheck_problems(site, partitions=partitions)
    for line in hc:
        out.append(Finding(Status.CRITICAL, "timeouts",
                           f"{line}: slurmd would kill it mid-drain; lower "
                           "health.drain_timeout_s"))
    if not hc:
        b = budget.hook_budget(site, "healthcheck", partitions=partitions)
        out.append(Finding(Status.OK, "timeouts",
                           f"{b.text()} <= {budget.HEALTHCHECK_KILL_S:g} (slurmd's kill)"))
    return out


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return " ".join(line.split())[:200]
    return ""


def gather(site: Site, *, hooks_conf: str | None = None, run: Runner = _run,
           mountinfo: str | None = None) -> SiteFacts:
    """Read every fact the checks need, once. Slurm unreachable is a fact, not an error."""
    classes = {name: nc.hostnames for name, nc in site.node_classes.items()}
    sinfo = run(["sinfo", "-h", "-N", "-o", "%N|%P"], 30)
    nodes: tuple[str, ...] | None = None
    partitions = 1  # the most partitions one node is in: the breaker takes a slot in each
    if sinfo.returncode == 0:
        parts: dict[str, set[str]] = {}
        for line in sinfo.stdout.splitlines():
            name, _, part = line.strip().partition("|")
            if name:
                parts.setdefault(name, set()).add(part.rstrip("*"))
        nodes = tuple(sorted(parts))
        partitions = max((len(p) for p in parts.values()), default=1)
    cfg = run(["scontrol", "show", "config"], 30)
    config = parse_config(cfg.stdout) if cfg.returncode == 0 else None
    if hooks_conf is None:
        from bluevela.deploy.data import read_text

        hooks_conf = read_text("slurm/hooks.conf")
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            mountinfo = ""
    slurm_uid: int | None = None
    if config is not None:
        user = config.get("SlurmUser", "")
        # "slurm(64030)"
        if "(" in user and user.endswith(")"):
            num = user.rsplit("(", 1)[1][:-1]
            slurm_uid = int(num) if num.isdigit() else None
    dirs = tuple(dir_facts(role, site.path(role), mountinfo)
                 for role in ("spool", "archive"))
    return SiteFacts(
        node_classes=classes, sinfo_nodes=nodes,
        sinfo_error=_first_line(sinfo.stderr),
        config=config, config_error=_first_line(cfg.stderr),
        wanted=tuple(parse_hooks_conf(hooks_conf)), dirs=dirs, slurm_user_uid=slurm_uid,
        budget=tuple(_budget_findings(site, config, partitions)),
    )


@dataclass(frozen=True)
class Validation:
    """What `bv site validate` prints: the findings and the merged slurm.conf lines."""

    findings: tuple[Finding, ...]
    slurm_lines: tuple[tuple[str, bool], ...]

    @property
    def status(self) -> Status:
        return worst(f.status for f in self.findings)

    def to_dict(self) -> dict[str, object]:
        return {"status": self.status.name,
                "findings": [{"status": f.status.name, "check": f.check, "message": f.message}
                             for f in self.findings],
                "slurm_conf": [{"line": line, "in_place": ok} for line, ok in self.slurm_lines]}


def evaluate(facts: SiteFacts, *, drain_timeout_s: float = 5.0) -> Validation:
    """Every check over `facts` (pure)."""
    findings: list[Finding] = []
    findings += check_timeouts(facts)
    findings += check_drain_timeout(drain_timeout_s, facts.config)
    findings += check_node_classes(facts)
    for d in facts.dirs:
        findings += check_directory(d, facts.slurm_user_uid)
    findings += check_slurm_conf(facts)
    findings += check_slurm_release(facts.config)
    return Validation(tuple(findings), tuple(merged_lines(facts.wanted, facts.config)))


def validate(site: Site, *, run: Runner = _run) -> Validation:
    """Gather the facts of this cluster and evaluate them."""
    facts = gather(site, run=run)
    return evaluate(facts, drain_timeout_s=site.health.drain_timeout_s)
