"""The spool: node reports written atomically by prolog/epilog hooks, read by ingest.

A report is one JSON file `<spool>/<job_id>.<node>.<phase>.json` (the job's first run) or
`<spool>/<job_id>.<node>.<phase>.r<k>.json` (its k-th restart after a requeue, which keeps the
job id: without the `r<k>` a requeued attempt's report would replace or duplicate the first
one's), built only from a validated job id, node name, phase and restart count (never from a
value the job's owner controls), written through a temporary file with O_EXCL|O_NOFOLLOW,
fsynced, renamed, and the directory fsynced. The epilog's series side file is named
`<job_id>.<node>.series.bvts`, or `<job_id>.<node>.r<k>.series.bvts` after a restart.

The report format (schema 1) and its reader are in `archive/reports.py`.

Reading side (ingest): `scan_spool` lists the report files and refuses anything else (symlinks,
non-regular files, names that are not `<job>.<node>.<phase>[.r<k>].json`); `archive.reports.load_report` reads one
without following a symlink and validates it; `quarantine` moves a refused or malformed entry
to `<spool>/quarantine/` next to a `.reason` file; `mark_done` moves ingested reports to
`<spool>/done/` once the archive holding them is durable.

Every read, move and unlink in the spool is relative to directory file descriptors opened
with O_DIRECTORY|O_NOFOLLOW (`SpoolDir`, `util.fs.open_dir`): a `done/` or `quarantine/`
swapped for a symlink between a check and a move never sends a file outside the spool, and
`done/`/`quarantine/` must belong to the ingest user (docs/archive.md, "Ownership").
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import select
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bluevela.errors import ArchiveError, UnsafeValueError
from bluevela.util.fs import (
    atomic_write_at,
    ensure_dir,
    open_dir,
    owner_problem,
    safe_job_id,
    safe_node_name,
)

logger = logging.getLogger(__name__)

SCHEMA = 1
Phase = Literal["prolog", "epilog"]
PHASES: tuple[str, ...] = ("prolog", "epilog")
DONE_DIR = "done"
QUARANTINE_DIR = "quarantine"
MAX_REPORT_BYTES = 4 << 20
STALE_TEMP_S = 3600.0  # a writer's temporary file older than this belongs to a dead writer

MAX_RESTART = 65535  # the archive's restart column is uint16 (archive/schema.py)
# restart k >= 1: `.r<k>` before the suffix, k without leading zeros, at most 5 digits.
_RESTART = r"(?:\.r([1-9][0-9]{0,4}))?"
_NAME_RE = re.compile(r"^([0-9]{1,12})\.(.+)\.(prolog|epilog)" + _RESTART + r"\.json$")
# The epilog's window of sampler data (bluevela.telemetry.window, archive/series_ingest.py). The
# node part is non-greedy: `<job>.n1.r2.series.bvts` is node n1's restart 2 (a node whose own
# name ends in `.r<k>` is told apart by the side file's header: archive/series_ingest.py).
SERIES_SUFFIX = ".series.bvts"
_SERIES_RE = re.compile(r"^([0-9]{1,12})\.(.+?)" + _RESTART + r"\.series\.bvts$")
_TEMP_RE = re.compile(r"^\..+\.[0-9]+\.tmp$")
# Limits shared with the archive schema (bluevela/archive/schema.py): identifier columns are
# fixed-width, so a longer value is refused here rather than truncated there.


class ReportError(ArchiveError):
    """A spool entry is not a valid node report (it goes to quarantine, ingest goes on)."""


def safe_restart(value: Any) -> int:
    """A restart count (SLURM_JOB_RESTART_COUNT) as an int in [0, MAX_RESTART]; None is 0.

    Raises:
        UnsafeValueError: not a non-negative integer in range.
    """
    if value is None:
        return 0
    if isinstance(value, str) and value.isdigit() and len(value) <= 5:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RESTART:
        raise UnsafeValueError(f"restart count {value!r} is not an integer in "
                               f"[0, {MAX_RESTART}]")
    return value


def _restart_part(restart: Any) -> str:
    k = safe_restart(restart)
    return f".r{k}" if k else ""


def report_name(job_id: int | str, node: str, phase: str, restart: int = 0) -> str:
    """The spool file name for a report; raises UnsafeValueError on anything odd."""
    if phase not in PHASES:
        raise UnsafeValueError(f"unknown report phase {phase!r}")
    return f"{safe_job_id(job_id)}.{safe_node_name(node)}.{phase}{_restart_part(restart)}.json"


def write_report(spool: Path, report: dict[str, Any], *, timeout_s: float | None = None) -> Path:
    """Write one node report into the spool atomically; return its path.

    Args:
        timeout_s: None: write here. A number (the hooks: SPOOL_WRITE_TIMEOUT_S): write in a
            child process and wait at most this long, so a hung spool (an NFS server gone) costs
            the prolog seconds instead of reaching PrologEpilogTimeout, where Slurm drains
            the node itself, outside the fleet breaker.

    Raises:
        UnsafeValueError: job id, node or phase not safe for a file name.
        SpoolTimeoutError: no answer from the spool within `timeout_s`.
        OSError: the write failed (ENOSPC...); nothing half-written is left behind.
    """
    restart = safe_restart(report.get("restart"))
    name = report_name(report["job_id"], report["node"], report["phase"], restart)
    body = {"schema": SCHEMA, "kind": "node_report", **report, "restart": restart}
    data = json.dumps(body, sort_keys=True, default=str).encode()
    path = write_spool_file(spool, name, data, timeout_s=timeout_s)
    logger.debug("spooled %s (%d bytes)", path, len(data))
    return path


def write_spool_file(spool: Path, name: str, data: bytes, *,
                     timeout_s: float | None = None) -> Path:
    """Write `data` as `spool/name` atomically (temp file, fsync, rename; the spool made 0755
    if missing, the name opened inside the directory's fd). `timeout_s`: None writes here; a
    number writes in a child and waits at most that long (`run_bounded`), so a hung spool
    costs the hook seconds. The one writer of node reports and series side files.

    Raises:
        SpoolTimeoutError: no answer from the spool within `timeout_s`.
        OSError: the write failed; nothing half-written is left behind.
    """
    def write() -> None:
        ensure_dir(spool, 0o755)
        fd = open_dir(spool)
        try:
            atomic_write_at(fd, name, data, 0o644)
        finally:
            os.close(fd)

    if timeout_s is None:
        write()
    else:
        run_bounded(write, timeout_s, f"spool {spool}")
    return spool / name


# The hooks' bound on one spool write (a report is a few kB: milliseconds on a live file
# system). Part of the prolog's worst case (bluevela.hooks.budget).
SPOOL_WRITE_TIMEOUT_S = 10.0


class SpoolTimeoutError(TimeoutError):
    """The spool did not answer in time (a hung file system); the writer was left behind."""


def run_bounded(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Run `fn` (file system calls only) in a forked child; wait at most `timeout_s`.

    A call stuck in the kernel on a hung mount cannot be interrupted from a thread, and a
    process with such a thread cannot exit either; a child can be left behind. The child keeps
    no descriptor of ours (not the hook lock, not slurmd's output pipe: slurmd would wait for
    its EOF) but the pipe that reports its outcome, and its stdio is /dev/null.

    Raises:
        SpoolTimeoutError: no outcome within `timeout_s` (the child goes on alone).
        OSError: `fn` failed in the child (its errno and message).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (exercised by tests/archive/test_spool_bounded.py)
        code = 0
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(null, target)
            os.closerange(3, w)
            os.closerange(w + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
            try:
                fn()
            except OSError as exc:
                code = exc.errno or errno.EIO
                os.write(w, (exc.strerror or str(exc)).encode()[:1000])
            except BaseException as exc:
                code = errno.EIO
                os.write(w, f"{type(exc).__name__}: {exc}".encode()[:1000])
        finally:
            os._exit(code if 0 <= code < 256 else errno.EIO)
    os.close(w)
    try:
        deadline = time.monotonic() + timeout_s
        message = b""
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(0.0, left))
            if not ready:
                raise SpoolTimeoutError(
                    errno.ETIMEDOUT, f"{what}: no answer in {timeout_s:g} s (a hung file "
                    f"system?); the writer, pid {pid}, is left behind")
            chunk = os.read(r, 4096)
            if not chunk:
                break
            message += chunk
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        err = code if code > 0 else errno.EIO
        raise OSError(err, message.decode(errors="replace") or os.strerror(err))


def series_name(job_id: int | str, node: str, restart: int = 0) -> str:
    """The spool file name of a node's series side file; raises UnsafeValueError."""
    return f"{safe_job_id(job_id)}.{safe_node_name(node)}{_restart_part(restart)}{SERIES_SUFFIX}"


def parse_report_name(name: str) -> tuple[int, str, str, int]:
    """Split `<job>.<node>.<phase>[.r<k>].json` into its validated parts (restart 0 without
    `.r<k>`).

    Raises:
        UnsafeValueError: the name is not exactly a report name built from safe values.
    """
    m = _NAME_RE.match(name)
    if not m:
        raise UnsafeValueError(f"not a report file name: {name!r}")
    job_id = safe_job_id(m.group(1))
    node = safe_node_name(m.group(2))
    return job_id, node, m.group(3), safe_restart(m.group(4))


def parse_series_name(name: str) -> tuple[int, str, int] | None:
    """Split `<job>.<node>[.r<k>].series.bvts` (None: not a series name).

    Raises:
        UnsafeValueError: a series name whose job id, node or restart is not safe.
    """
    m = _SERIES_RE.match(name)
    if not m:
        return None
    return safe_job_id(m.group(1)), safe_node_name(m.group(2)), safe_restart(m.group(3))


@dataclass(frozen=True)
class SpoolEntry:
    """One report file found in the spool (its name already validated)."""

    name: str
    job_id: int
    node: str
    phase: str
    restart: int = 0

    @property
    def key(self) -> tuple[int, str, str, int]:
        return (self.job_id, self.node, self.phase, self.restart)


@dataclass
class SpoolScan:
    """What `scan_spool` found: report entries, and refused entries with the reason."""

    entries: list[SpoolEntry] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    series: list[SpoolEntry] = field(default_factory=list)  # phase "series" side files


def check_spool_dir(spool: Path) -> None:
    """Raise ArchiveError unless `spool` is a plain, readable directory (not a symlink)."""
    try:
        st = os.lstat(spool)
    except FileNotFoundError:
        raise ArchiveError(f"spool directory {spool} does not exist") from None
    except OSError as exc:
        raise ArchiveError(f"cannot read spool directory {spool}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise ArchiveError(f"spool {spool} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise ArchiveError(f"spool {spool} is not a directory")


class SpoolDir:
    """The spool, opened once (O_DIRECTORY|O_NOFOLLOW): what ingest reads, moves and unlinks
    is named relative to this fd and to the fds of its `done/` and `quarantine/`.

    Raises:
        ArchiveError: the spool is missing, a symlink, not a directory or unreadable.
    """

    def __init__(self, path: Path) -> None:
        check_spool_dir(path)
        self.path = Path(path)
        try:
            self.fd = open_dir(path)
        except (OSError, UnsafeValueError) as exc:
            raise ArchiveError(f"cannot open spool directory {path}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from exc

    def subdir(self, name: str, mode: int | None) -> int:
        """Open (create with `mode` if missing and `mode` is given) `done/` or `quarantine/`:
        never through a symlink, and only when it belongs to us and nobody else may write it.

        Raises:
            FileNotFoundError: missing, and `mode` is None.
            ArchiveError: a symlink, not a directory, someone else's, or not creatable.
        """
        try:
            fd = open_dir(name, self.fd, create=mode)
        except FileNotFoundError:
            if mode is None:
                raise
            raise ArchiveError(f"cannot create {self.path / name}") from None
        except (OSError, UnsafeValueError) as exc:
            raise ArchiveError(f"{self.path / name}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from exc
        problem = owner_problem(os.fstat(fd))
        if problem:
            os.close(fd)
            raise ArchiveError(f"{self.path / name} is {problem}; refusing to move reports "
                               "into it (docs/archive.md, Ownership)")
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SpoolDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _opened(spool: Path | SpoolDir) -> Iterator[SpoolDir]:
    if isinstance(spool, SpoolDir):
        yield spool
    else:
        with SpoolDir(spool) as sd:
            yield sd


def scan_spool(spool: Path | SpoolDir, job_id: int | None = None) -> SpoolScan:
    """List the spool's report files; refuse symlinks, non-regular files and odd names.

    Writers' temporary files (`.<name>.<pid>.tmp`) are skipped; those older than an hour
    belong to a dead writer and are removed.

    Args:
        spool: the spool directory.
        job_id: only this job's entries (the EpilogSlurmctld path).

    Raises:
        ArchiveError: the spool is missing, not a directory, a symlink or unreadable.
    """
    with _opened(spool) as sd:
        return _scan(sd, job_id)


def _scan(sd: SpoolDir, job_id: int | None) -> SpoolScan:
    scan = SpoolScan()
    prefix = f"{job_id}." if job_id is not None else ""
    now = time.time()
    try:
        with os.scandir(sd.fd) as it:
            for de in it:
                name = de.name
                if name in (DONE_DIR, QUARANTINE_DIR) and de.is_dir(follow_symlinks=False):
                    continue
                if not name.startswith(prefix):
                    continue
                if name.startswith("."):
                    if _TEMP_RE.match(name) and de.is_file(follow_symlinks=False):
                        _remove_stale_temp(sd, de, now)
                    continue
                if de.is_symlink():
                    scan.refused.append((name, "a symlink (never followed)"))
                    continue
                if not de.is_file(follow_symlinks=False):
                    scan.refused.append((name, "not a regular file"))
                    continue
                try:
                    series = parse_series_name(name)
                    if series is not None:
                        job, node, restart = series
                        scan.series.append(SpoolEntry(name, job, node, "series", restart))
                        continue
                    job, node, phase, restart = parse_report_name(name)
                except UnsafeValueError as exc:
                    scan.refused.append((name, str(exc)))
                    continue
                scan.entries.append(SpoolEntry(name, job, node, phase, restart))
    except OSError as exc:
        raise ArchiveError(f"cannot read spool directory {sd.path}: {exc.strerror}") from exc
    scan.entries.sort(key=lambda e: (e.job_id, e.node, e.restart, e.phase))
    return scan


def _remove_stale_temp(sd: SpoolDir, de: os.DirEntry[str], now: float) -> None:
    try:
        if now - de.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
            os.unlink(de.name, dir_fd=sd.fd)
            logger.info("removed a dead writer's temporary file %s", sd.path / de.name)
    except OSError:
        pass


def _unique_name(dir_fd: int, name: str) -> str:
    target, n = name, 1
    while True:
        try:
            os.stat(target, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return target
        target = f"{name}.{n}"
        n += 1


def quarantine(spool: Path | SpoolDir, name: str, reason: str) -> Path | None:
    """Move a spool entry to `<spool>/quarantine/` with a `<name>.reason` file beside it.

    The entry is renamed, never opened or followed (a symlink moves as a link), relative to the
    fds of the spool and of `quarantine/`. Returns the new path, or None when the entry
    vanished meanwhile.

    Raises:
        ArchiveError: the quarantine directory cannot be made, is not ours, or not writable.
    """
    with _opened(spool) as sd:
        qdir = sd.path / QUARANTINE_DIR
        qfd = sd.subdir(QUARANTINE_DIR, 0o700)
        try:
            target = _unique_name(qfd, name)
            try:
                os.rename(name, target, src_dir_fd=sd.fd, dst_dir_fd=qfd)
            except FileNotFoundError:
                return None
            text = f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {reason}\n"
            atomic_write_at(qfd, target + ".reason", text.encode(), 0o600)
            os.fsync(sd.fd)
        except OSError as exc:
            raise ArchiveError(f"cannot quarantine {name!r} in {qdir}: "
                               f"{exc.strerror or exc}") from exc
        finally:
            os.close(qfd)
    logger.warning("quarantined spool entry %r: %s", name, reason)
    return qdir / target


def mark_done(spool: Path | SpoolDir, names: list[str], *, delete: bool = False) -> int:
    """Move ingested reports to `<spool>/done/` (or delete them); return how many moved.

    Call only after the archive holding them is durable. A name that vanished is skipped.
    Moves and unlinks are relative to the fds of the spool and of `done/`.

    Raises:
        ArchiveError: the done directory cannot be made or is not ours, or a move failed.
    """
    if not names:
        return 0
    moved = 0
    with _opened(spool) as sd:
        dfd = -1 if delete else sd.subdir(DONE_DIR, 0o755)
        try:
            for name in names:
                try:
                    if delete:
                        os.unlink(name, dir_fd=sd.fd)
                    else:
                        os.replace(name, name, src_dir_fd=sd.fd, dst_dir_fd=dfd)
                    moved += 1
                except FileNotFoundError:
                    continue
            if not delete:
                os.fsync(dfd)
            os.fsync(sd.fd)
        except OSError as exc:
            raise ArchiveError(f"cannot move ingested reports out of {sd.path}: "
                               f"{exc.strerror or exc}") from exc
        finally:
            if dfd >= 0:
                os.close(dfd)
    return moved


def prune_done(spool: Path | SpoolDir, max_age_s: float) -> int:
    """Delete reports in `<spool>/done/` older than `max_age_s`; return how many."""
    if max_age_s <= 0:
        return 0
    cutoff = time.time() - max_age_s
    removed = 0
    with _opened(spool) as sd:
        try:
            dfd = sd.subdir(DONE_DIR, None)
        except FileNotFoundError:
            return 0
        except ArchiveError as exc:
            logger.warning("done/ not pruned: %s", exc)
            return 0
        try:
            with os.scandir(dfd) as it:
                for de in it:
                    try:
                        if de.is_file(follow_symlinks=False) and \
                                de.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(de.name, dir_fd=dfd)
                            removed += 1
                    except OSError:
                        continue
        finally:
            os.close(dfd)
    return removed
