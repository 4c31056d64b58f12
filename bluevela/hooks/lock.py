"""One bluevela hook run at a time on a node: an flock on `<state>/hook.lock`.

Two runs at once see each other: the healthcheck's nccl workers look like a job's leftover
GPU processes to a prolog, two nccl checks share the GPUs, both may drain. So:

- a **healthcheck** that finds another hook running skips its run (exit 0, one INFO line):
  the next interval runs it;
- a **prolog or epilog** waits for the lock, at most `BV_HOOK_LOCK_WAIT_S` (default 65 s:
  slurmd kills a HealthCheckProgram after 60 s, which releases the lock; a prolog or epilog
  ahead of it takes a few seconds, or about a minute with nccl). Still held after that, the
  holder is hung (a stuck NVML call, D state): the run goes ahead anyway with a WARNING line,
  because a node whose previous hook hangs is exactly one whose checks must run before a
  job starts on it. Slurm's PrologEpilogTimeout (300 s in slurm/hooks.conf) covers the wait
  plus the run.

The lock file is root-owned, 0600, opened without following a symlink and close-on-exec; it
holds `<pid> <phase> <job>` of the holder for the log line of whoever waits. The kernel drops
the lock when the holder exits, however it exits. Without a usable state directory the lock
falls back to `/run/bluevela/hook.lock`.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from bluevela.util.fs import open_dir, owner_problem, try_flock

logger = logging.getLogger(__name__)

LOCK_NAME = "hook.lock"
FALLBACK_DIR = Path("/run/bluevela")
DEFAULT_WAIT_S = 65.0
POLL_S = 0.1


def wait_s(phase: str, environ: Mapping[str, str] | None = None) -> float:
    """How long `phase` waits for another hook: 0 for the healthcheck, else
    `$BV_HOOK_LOCK_WAIT_S` (default 65 s, at most 250 s)."""
    if phase == "healthcheck":
        return 0.0
    env = os.environ if environ is None else environ
    try:
        value = float(env.get("BV_HOOK_LOCK_WAIT_S") or DEFAULT_WAIT_S)
    except ValueError:
        return DEFAULT_WAIT_S
    return min(max(value, 0.0), 250.0) if value == value else DEFAULT_WAIT_S


def _open(directory: Path) -> int:
    """The lock file's fd in `directory` (created 0700 if missing, must be ours)."""
    dfd = open_dir(directory, create=0o700)
    try:
        problem = owner_problem(os.fstat(dfd))
        if problem:
            raise PermissionError(f"{directory} is {problem}")
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dfd)
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{directory / LOCK_NAME} is not a regular file of ours")
    return fd


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 128, 0).decode(errors="replace").split()
    except OSError:
        return "another hook"
    if len(text) >= 2:
        job = f" job {text[2]}" if len(text) >= 3 and text[2] != "-" else ""
        return f"the {text[1]}{job} (pid {text[0]})"
    return "another hook"


def _acquire(fd: int, phase: str, job_id: int | None, wait: float) -> bool:
    """Take the flock within `wait` s; False when a healthcheck must skip its run."""
    deadline = time.monotonic() + wait
    waited = False
    while True:
        try:
            if try_flock(fd):
                break
        except OSError as exc:
            logger.warning("cannot take the hook lock: %s; running without it", exc.strerror)
            return True
        holder = _holder(fd)
        if phase == "healthcheck":
            logger.info("%s is running: healthcheck skipped (the next interval runs it)", holder)
            return False
        if time.monotonic() >= deadline:
            logger.warning("%s still holds the hook lock after %g s (hung?): the %s runs "
                           "alongside it", holder, wait, phase)
            return True
        if not waited:
            logger.info("%s is running: the %s waits for it (at most %g s)", holder, phase, wait)
            waited = True
        time.sleep(POLL_S)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {phase} {job_id if job_id is not None else '-'}\n".encode(),
                  0)
    except OSError:
        pass
    return True


@contextmanager
def hook_lock(state_dir: Path | None, phase: str, job_id: int | None = None, *,
              wait: float | None = None) -> Iterator[bool]:
    """Hold the node's hook lock for one hook run; yields False when the run must be skipped
    (a healthcheck that found another hook running). See the module docstring.

    Never raises of its own: a lock that cannot be opened at all is logged and the run goes
    ahead.
    """
    wait = wait_s(phase) if wait is None else wait
    fd = None
    errors = []
    for directory in ([state_dir] if state_dir is not None else []) + [FALLBACK_DIR]:
        try:
            fd = _open(directory)
            break
        except Exception as exc:  # noqa: BLE001 - any failure: try the next place, then run
            errors.append(f"{directory}: {exc}")
    if fd is None:
        logger.warning("no hook lock (%s): running without one", "; ".join(errors))
        yield True
        return
    try:
        run = _acquire(fd, phase, job_id, wait)
        yield run
    finally:
        os.close(fd)  # releases the flock
