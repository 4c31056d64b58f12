"""The hook's environment: `/etc/bluevela/hook.env`, and what Slurm passes, validated.

Slurm does not pass slurmd's environment to the prolog, so site settings reach the hooks
through a root-owned file of `KEY=VALUE` lines (`/etc/bluevela/hook.env`, or `$BV_HOOK_ENV`;
`BV_HOOK_ENV=none` skips it). Only `BV_*` keys and `SLURM_CONF` are accepted; the file must be
a regular file (not a symlink) owned by root (or us) and not writable by group or others.

Values the job's owner controls (SLURM_JOB_COMMENT, SLURM_JOB_WORK_DIR, SLURM_JOB_STDOUT,
SLURM_JOB_STDERR, SLURM_JOB_NAME, SLURM_JOB_EXTRA, SLURM_JOB_CONSTRAINTS) are never read
here: nothing of theirs can become a shell word or a path. The node name and job id are
validated (`bluevela.util.fs`) before they name any file; user and partition are kept as data
(control characters removed, length bounded).

Isolation: slurmd starts its hooks in its own working directory. The shims `cd /` and run
`python -I -m bluevela.hooks` (no cwd on the import path, PYTHON* variables and user
site-packages ignored; `isolate` re-executes that way when started otherwise), and the site
file is only `$BV_SITE` (from hook.env) or /etc/bluevela/site.yaml, never `./site.yaml`.
A hook.env with fixture keys (`FIXTURE_KEYS`) makes every run log a WARNING line.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from bluevela.errors import UnsafeValueError
from bluevela.util.fs import safe_job_id, safe_node_name

logger = logging.getLogger(__name__)

HOOK_ENV = Path("/etc/bluevela/hook.env")
# Keys that make the checks read recorded fixtures instead of this node's hardware (the dev
# cluster and tests set them): a production hook that has one says so in every run's log.
# A future fixture key is named BV_FAKE_* or BV_FIXTURE_* (or added here).
FIXTURE_KEYS = ("BV_SYSFS_ROOT", "BV_NVML_SNAPSHOT", "BV_KMSG")
FIXTURE_PREFIXES = ("BV_FAKE_", "BV_FIXTURE_")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_KEY = re.compile(r"^(BV_[A-Z0-9_]+|SLURM_CONF)$")
MAX_HOOK_ENV = 64 << 10


def parse_hook_env(text: str) -> dict[str, str]:
    """`KEY=VALUE` lines (optional `export `, `#` comments, one pair of quotes) -> accepted keys."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _KEY.match(key):
            logger.warning("hook.env line %d ignored: only BV_* and SLURM_CONF keys are accepted", n)
            continue
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if "\0" in value:
            continue
        out[key] = value
    return out


def read_hook_env(path: Path) -> dict[str, str]:
    """Parse the hook.env at `path`; {} when absent or refused (logged).

    Refused: a symlink, not a regular file, not owned by root or us, group/other-writable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        logger.warning("cannot open %s: %s", path, exc.strerror or exc)
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            logger.error("%s is not a regular file: ignored", path)
            return {}
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            logger.error("%s must be owned by root and not group/other-writable: ignored", path)
            return {}
        data = os.read(fd, MAX_HOOK_ENV)
    finally:
        os.close(fd)
    return parse_hook_env(data.decode("utf-8", "replace"))


def load_hook_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Apply hook.env to `environ` (default os.environ); also give the hook a PATH.

    Slurm runs hooks with no PATH: a default is set, and `BV_SLURM_BIN` (a directory, from
    hook.env) is put in front of it for sites whose Slurm is elsewhere.
    """
    env = os.environ if environ is None else environ
    chosen = env.get("BV_HOOK_ENV") or str(HOOK_ENV)
    values = {} if chosen == "none" else read_hook_env(Path(chosen))
    env.update(values)
    if not env.get("PATH"):
        env["PATH"] = DEFAULT_PATH
    slurm_bin = env.get("BV_SLURM_BIN")
    if slurm_bin and os.path.isabs(slurm_bin) and slurm_bin not in env["PATH"].split(":"):
        env["PATH"] = f"{slurm_bin}:{env['PATH']}"
    return values


def fixture_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """The warning line for a hook whose environment points the checks at fixtures, or None.

    `BV_NODE_CLASS` only counts alongside a fixture root: on its own it is a legitimate
    per-node override.
    """
    env = os.environ if environ is None else environ
    redirects = [k for k in FIXTURE_KEYS if env.get(k)]
    redirects += sorted(k for k in env if k.startswith(FIXTURE_PREFIXES) and env.get(k))
    if not redirects:
        return None
    shown = ", ".join(f"{k}={_data(env.get(k), 200)}" for k in redirects)
    if env.get("BV_NODE_CLASS"):
        shown += f", BV_NODE_CLASS={_data(env.get('BV_NODE_CLASS'), 64)}"
    return (f"FIXTURES IN USE: {shown}: the checks read recorded files, not this node's "
            "hardware (remove these keys from hook.env on a production node)")


def site_events_dir(environ: Mapping[str, str] | None = None) -> str:
    """The events directory the hooks use: BV_EVENTS_DIR from hook.env (`BV_HOOK_ENV`,
    else /etc/bluevela/hook.env, when readable), else from `environ`, else /tmp."""
    from bluevela.goodput.events_dir import events_dir

    environ = os.environ if environ is None else environ
    chosen = environ.get("BV_HOOK_ENV") or str(HOOK_ENV)
    values = {} if chosen == "none" else read_hook_env(Path(chosen))
    return events_dir({**environ, **values})


def events_dir_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """`bv site validate`'s check of the hooks' events directory: a one-line problem, or
    None when the epilog can trust it (`goodput.events_dir.dir_layout`)."""
    from bluevela.goodput.events_dir import EVENTS_DIR_ENV, check_events_dir

    path = site_events_dir(environ)
    if not os.path.lexists(path):
        return (f"goodput events directory {path} ({EVENTS_DIR_ENV}) does not exist: no "
                "job's goodput events can be recorded")
    problem = check_events_dir(path)[1]
    return None if problem is None else f"goodput events directory: {problem}"


def isolate(module: str) -> None:
    """Make `python -m <module>` (a root entry point) independent of where it was started.

    slurmd starts its hooks in its own working directory; with `-m`, Python puts that
    directory first on the import path, and PYTHONPATH/PYTHONSTARTUP/user site-packages would
    be honoured too. The shims run `python -I -m ...` from `/`; this re-executes the same way
    when started otherwise (an old shim, by hand). What this interpreter imported before
    getting here (the package's `__init__`) is already done: the shims are the real fix.
    """
    import sys

    os.chdir("/")
    if sys.flags.isolated or not sys.executable:
        return
    orig = list(getattr(sys, "orig_argv", []))
    flags = orig[1:orig.index("-m")] if "-m" in orig else []
    argv = [sys.executable, "-I", *(f for f in flags if f != "-I"), "-m", module, *sys.argv[1:]]
    os.execv(sys.executable, argv)


def _data(value: str | None, limit: int = 128) -> str:
    """A value kept only as data: printable characters, bounded length."""
    if not value:
        return ""
    return "".join(ch for ch in value if ch.isprintable())[:limit]


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if re.fullmatch(r"-?[0-9]{1,10}", value) else None


def parse_exit(code2: str | None, raw: str | None) -> tuple[int | None, int | None]:
    """(exit_code, signal) from SLURM_JOB_EXIT_CODE2 ('3:0') or the raw wait status."""
    if code2:
        m = re.fullmatch(r"\s*([0-9]{1,3}):([0-9]{1,3})\s*", code2)
        if m:
            sig = int(m.group(2))
            return int(m.group(1)), (sig or None)
    status = _int(raw)
    if status is None or status < 0:
        return None, None
    if status & 0x7F:
        return None, status & 0x7F
    return (status >> 8) & 0xFF, None


def parse_derived(value: str | None) -> int | None:
    """SLURM_JOB_DERIVED_EC ('3:0', or a raw wait status as a number) -> exit code."""
    if not value:
        return None
    if ":" in value:
        code, _ = parse_exit(value, None)
        return code
    code, sig = parse_exit(None, value)
    return code if sig is None else 128 + sig


@dataclass(frozen=True)
class HookContext:
    """What Slurm tells a hook, validated.

    Attributes:
        phase: prolog, epilog or healthcheck.
        node: this node's Slurm name (SLURMD_NODENAME, else the short hostname), validated.
        job_id: validated, None for the healthcheck.
        user, partition: data only.
        nodelist_expr: SLURM_NODELIST as Slurm wrote it (a compressed hostlist expression)
            when every name it stands for is a valid node name, else "". The reports carry it
            as it is: expanding it, checking each name and compressing it again cost every
            node O(N log N) (6 ms a hook at 4,096 nodes, 0.2 ms at 64: issue 27).
        nodelist: the job's nodes (each a validated name), expanded when first asked for;
            () when unparsable.
        job_gpus: the GPU indexes the job was given here (SLURM_JOB_GPUS); None: unknown.
    """

    phase: str
    node: str
    job_id: int | None = None
    user: str = ""
    partition: str = ""
    num_nodes: int | None = None
    nodelist_expr: str = ""
    restart_count: int = 0
    exit_code: int | None = None
    exit_signal: int | None = None
    derived_exit_code: int | None = None
    job_gpus: tuple[int, ...] | None = None

    @classmethod
    def from_env(cls, phase: str, env: MutableMapping[str, str] | None = None) -> HookContext:
        """Read and validate.

        Raises:
            UnsafeValueError: the node name or the job id is not plain.
        """
        env = os.environ if env is None else env
        node = safe_node_name(env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])
        job_id: int | None = None
        if phase != "healthcheck":
            raw = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
            if raw is None:
                raise UnsafeValueError(f"{phase}: SLURM_JOB_ID is not set")
            job_id = safe_job_id(raw)
        exit_code = exit_signal = derived = None
        if phase == "epilog":
            exit_code, exit_signal = parse_exit(env.get("SLURM_JOB_EXIT_CODE2"),
                                                env.get("SLURM_JOB_EXIT_CODE"))
            derived = parse_derived(env.get("SLURM_JOB_DERIVED_EC"))
        expr = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        return cls(
            phase=phase,
            node=node,
            job_id=job_id,
            user=_data(env.get("SLURM_JOB_USER"), 64),
            partition=_data(env.get("SLURM_JOB_PARTITION"), 64),
            num_nodes=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")),
            nodelist_expr=_checked_expr(expr),
            restart_count=_int(env.get("SLURM_JOB_RESTART_COUNT")) or 0,
            exit_code=exit_code,
            exit_signal=exit_signal,
            derived_exit_code=derived,
            job_gpus=_job_gpus(env.get("SLURM_JOB_GPUS")) if phase != "healthcheck" else None,
        )

    @cached_property
    def nodelist(self) -> tuple[str, ...]:
        return _nodelist(self.nodelist_expr)


def _job_gpus(value: str | None) -> tuple[int, ...] | None:
    from bluevela.health.context import parse_gpu_list

    return parse_gpu_list(value)


_MAX_NODES = 100_000
# What Slurm writes: comma-separated pieces, each a name or `prefix[ranges]suffix`.
_NAME_CHARS = r"[A-Za-z0-9_.-]"
_RANGES = r"[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*"
_PIECE = re.compile(rf"({_NAME_CHARS}*)\[({_RANGES})\]({_NAME_CHARS}*)|({_NAME_CHARS}+)")


def _checked_expr(expr: str) -> str:
    """`expr` when it is a list of pieces `name` or `prefix[a-b,c]suffix` whose every name is a
    valid node name (checked per piece: its prefix, suffix and widest number), with fewer
    than _MAX_NODES names; else the names are expanded and checked one by one (`_nodelist`)
    and `expr` kept only when they all pass."""
    count, pos = 0, 0
    while pos < len(expr):
        m = _PIECE.match(expr, pos)
        end = m.end() if m else -1
        if m is None or (end < len(expr) and expr[end] != ","):
            break
        if m.group(4) is not None:
            if not _safe(m.group(4)):
                return ""
            count += 1
        else:
            prefix, suffix, width = m.group(1), m.group(3), 0
            for part in m.group(2).split(","):
                lo, _, hi = part.partition("-")
                if int(hi or lo) < int(lo):
                    return ""
                count += int(hi or lo) - int(lo) + 1
                width = max(width, len(lo), len(hi))
            if not _safe(prefix + "0" * width + suffix):
                return ""
        if count >= _MAX_NODES:
            break
        pos = end + 1
        if pos == len(expr):  # a trailing comma
            break
    else:
        return expr
    names = _nodelist(expr)
    return expr if names and len(names) < _MAX_NODES else ""


def _safe(name: str) -> bool:
    try:
        safe_node_name(name)
    except UnsafeValueError:
        return False
    return True


def _nodelist(expr: str | None) -> tuple[str, ...]:
    if not expr:
        return ()
    import hostlist

    try:
        names = hostlist.expand_hostlist(expr)
        return tuple(safe_node_name(n) for n in names[:_MAX_NODES])
    except (hostlist.BadHostlist, UnsafeValueError):
        logger.warning("unparsable SLURM_NODELIST ignored")
        return ()
