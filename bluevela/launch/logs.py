"""Reading a job's output file, optionally following it until the job ends.

The output path is the job owner's choice. Run as root (an operator's `bv logs 1234`), opening
it naively would follow the owner's symlink or hard link to /etc/shadow and print it. So as root
the file is opened with the owner's credentials (effective uid, gid and groups switched for the
`open` only, as OpenSSH does for a user's files): the kernel then grants exactly what the owner
could read themselves, whatever links sit in the path. On top of that, a final component that is
a symlink is refused (O_NOFOLLOW), and anything but a regular file (a directory, a FIFO that
would block us, a device) is refused after opening it non-blocking. Run as anyone else, the
kernel already limits the read to what that user may read.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bluevela.errors import SlurmError
from bluevela.slurm.client import AttemptRecord, JobInfo, SlurmClient
from bluevela.util.term import printable

logger = logging.getLogger(__name__)


def log_path(client: SlurmClient, job_id: int) -> Path:
    return _path_of(client.job(job_id))


def _path_of(info: JobInfo) -> Path:
    if not info.stdout:
        raise SlurmError(f"Slurm reports no output file for job {info.job_id}")
    path = Path(info.stdout)
    if not path.is_absolute() and info.work_dir:
        path = Path(info.work_dir) / path
    return path


@contextmanager
def as_owner(user: str) -> Iterator[None]:
    """Run the body with `user`'s effective uid, gid and groups when we are root (else as is).

    Raises:
        SlurmError: root, and `user` is not a known account here (nothing is opened).
    """
    if os.geteuid() != 0:
        yield
        return
    import pwd

    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise SlurmError(f"job owner {printable(user)!r} is not a user on this host; not "
                         "opening its output file as root") from None
    if pw.pw_uid == 0:
        yield
        return
    saved_groups, saved_egid = os.getgroups(), os.getegid()
    os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
    os.setegid(pw.pw_gid)
    os.seteuid(pw.pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(saved_egid)
        os.setgroups(saved_groups)


def open_log(path: Path, owner: str) -> int | None:
    """A read-only descriptor of the job's output file; None while it does not exist yet.

    Raises:
        SlurmError: a symlink (as root), not a regular file, or not readable by the owner.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if os.geteuid() == 0:
        flags |= os.O_NOFOLLOW
    shown = printable(path)
    try:
        with as_owner(owner):
            fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SlurmError(f"{shown}: is a symbolic link; bv logs does not follow a job's "
                             "links as root") from None
        if exc.errno == errno.EACCES and os.geteuid() == 0:
            raise SlurmError(f"{shown}: the job's owner {printable(owner)!r} cannot read it, so "
                             "neither does bv logs") from None
        raise SlurmError(f"{shown}: cannot open: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise SlurmError(f"{shown}: is {kind}, not a job's output file")
    return fd


def _read_from(fd: int, pos: int) -> tuple[bytes, int]:
    chunks: list[bytes] = []
    while True:
        data = os.pread(fd, 1 << 20, pos)
        if not data:
            return b"".join(chunks), pos
        chunks.append(data)
        pos += len(data)


def stream_log(
    client: SlurmClient, job_id: int, *, follow: bool = False, poll_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[str]:
    """Yield the output file's text; with `follow`, keep yielding until the job is terminal."""
    info = client.job(job_id)
    path = _path_of(info)
    fd: int | None = None
    pos = 0
    try:
        while True:
            if fd is None:
                fd = open_log(path, info.user)
                if fd is None and not follow:
                    raise SlurmError(f"{printable(path)}: no such file (job not started yet?)")
            if fd is not None:
                data, pos = _read_from(fd, pos)
                if data:
                    yield data.decode("utf-8", errors="replace")
            if not follow:
                return
            if client.job(job_id).state.is_terminal():
                # One last read after the end: the final lines may land after the state change.
                if fd is None:
                    fd = open_log(path, info.user)
                if fd is not None:
                    rest, pos = _read_from(fd, pos)
                    if rest:
                        yield rest.decode("utf-8", errors="replace")
                return
            sleep(poll_s)
    finally:
        if fd is not None:
            os.close(fd)


def read_log(info: JobInfo) -> str:
    """The whole output file of a job (opened as `open_log` does); SlurmError if missing."""
    path = _path_of(info)
    fd = open_log(path, info.user)
    if fd is None:
        raise SlurmError(f"{printable(path)}: no such file (job not started yet?)")
    try:
        data, _ = _read_from(fd, 0)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def attempt_log(client: SlurmClient, job_id: int, attempt: int) -> str:
    """Attempt `attempt`'s slice of the job's appended output (split on bv's banners)."""
    from bluevela.launch.attempts import split_attempts

    parts = split_attempts(read_log(client.job(job_id)))
    if not 1 <= attempt <= len(parts):
        raise SlurmError(f"job {job_id} has {len(parts)} attempt(s) in its output; "
                         f"no attempt {attempt}")
    return parts[attempt - 1].text


def with_causes(info: JobInfo) -> JobInfo:
    """`info` with each attempt's cause from bv's banners/end lines, where the output file is
    readable (else unchanged: Slurm's own record still names the state)."""
    if not info.attempts:
        return info
    from dataclasses import replace

    from bluevela.launch.attempts import attempt_causes, split_attempts

    try:
        text = read_log(info)
    except (SlurmError, OSError) as exc:
        logger.debug("no causes from the output of job %s: %s", info.job_id, exc)
        return info
    # Banners also count relaunches inside one allocation (spares): they name Slurm's attempts
    # only when the counts agree; otherwise Slurm's recorded state stands alone, but for
    # attempts that never printed a banner (a prolog's refusal).
    banners = len(split_attempts(text))
    if banners < len(info.attempts):
        return replace(info, attempts=_never_started(info.attempts, len(info.attempts) - banners))
    if banners != len(info.attempts):
        return info
    causes = attempt_causes(text)
    attempts = tuple(replace(rec, cause=causes.get(rec.attempt, rec.cause))
                     for rec in info.attempts)
    return replace(info, attempts=attempts)


# A Slurm attempt requeued this soon after its start, in a job whose output has fewer banners
# than Slurm has attempts, most likely never reached bv's supervisor: a node's prolog refused
# it (the prolog's worst case is under PrologEpilogTimeout, 300 s by default; docs/byos.md,
# "Why did my job start late, or go back to PENDING?").
NEVER_STARTED_S = 300
NEVER_STARTED = ("requeued before bv's supervisor started (no banner for it): most likely a "
                 "node's prolog found the node unhealthy and Slurm requeued the job "
                 "(bv health nodes shows the drain and its reason)")


def _never_started(attempts: tuple[AttemptRecord, ...], missing: int
                   ) -> tuple[AttemptRecord, ...]:
    """`attempts` with the NEVER_STARTED cause on the `missing` shortest REQUEUED ones that
    lasted at most NEVER_STARTED_S and have no cause yet."""
    from dataclasses import replace

    from bluevela.slurm.states import JobState

    short = sorted((r.end_time - r.start_time, r.attempt) for r in attempts
                   if r.state is JobState.REQUEUED and not r.cause
                   and r.start_time is not None and r.end_time is not None
                   and 0 <= r.end_time - r.start_time <= NEVER_STARTED_S)
    chosen = {attempt for _, attempt in short[:missing]}
    return tuple(replace(r, cause=NEVER_STARTED) if r.attempt in chosen else r
                 for r in attempts)


def bv_attempts_of(info: JobInfo) -> list[dict[str, object]]:
    """bv's attempts of a job from its output file (`attempts.bv_attempts`); [] when the file
    cannot be read."""
    from bluevela.launch.attempts import bv_attempts

    try:
        return bv_attempts(read_log(info))
    except (SlurmError, OSError) as exc:
        logger.debug("no bv attempts from the output of job %s: %s", info.job_id, exc)
        return []
