"""A process and what runs under it, read from /proc; and stopping them.

The node agent finds torchrun's workers here (to send them SIGUSR1 only once they handle it)
and kills a step's whole tree when the step is aborted; the supervisor reaps its srun. Linux
only (``/proc/PID/stat``, ``/proc/PID/environ``, ``/proc/PID/status``); standard library only.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

# After SIGKILL, how long to wait for a process to be gone. One stuck in the kernel (D state:
# a hung NFS or GPU driver call) may never go: it is left to Slurm's own kill (proctrack,
# UnkillableStepTimeout) rather than hold the agent or the supervisor forever.
KILLED_WAIT_S = 10.0


class Proc(Protocol):
    """What the stopping functions need of a process: torchrun's Popen, or the warm start's
    stand-in for it (launch/warm.py `WarmRun`, whose pid leads the ranks' process group)."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` now."""
    return _children(pid)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _has_local_rank(pid: int) -> bool:
    try:
        return b"\0LOCAL_RANK=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler installed for `sig` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    frontier = [pid]
    while frontier:
        for child in _children(frontier.pop()):
            found.append(child)
            frontier.append(child)
    return found


def worker_pids(torchrun_pid: int) -> list[int]:
    """torchrun's workers: descendants that have LOCAL_RANK in their environment while their
    parent does not (the torchrun agent sets it for its workers only; a worker's own children,
    e.g. data loaders, inherit it and are skipped)."""
    found: list[int] = []
    frontier = [torchrun_pid]
    while frontier:
        parent = frontier.pop()
        for child in _children(parent):
            if _has_local_rank(child) and not _has_local_rank(parent):
                found.append(child)
            else:
                frontier.append(child)
    return sorted(found)


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; False when it is already gone, or is no longer ours (EPERM: the
    pid was reused by another user's process since it was read)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(proc: Proc, sig: int) -> None:
    """`sig` to the process group `proc` leads (started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise


def kill_tree(proc: Proc) -> None:
    """SIGKILL everything under `proc` and its group: the workers may sit in sessions of
    their own, so by pid first, then the group."""
    for pid in descendants(proc.pid):
        signal_pid(pid, signal.SIGKILL)
    kill_group(proc, signal.SIGKILL)


def reap(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    """Wait up to `wait_s` for `proc` to end, then SIGKILL it and wait (`wait_killed`)."""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        wait_killed(proc)


def wait_killed(proc: Proc, wait_s: float = KILLED_WAIT_S) -> bool:
    """Wait up to `wait_s` for a process sent SIGKILL; False (and a warning) when it is still
    there: stuck in the kernel, it is left to Slurm rather than waited for without end."""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d still there %.0f s after SIGKILL (stuck in the kernel?): "
                       "left to Slurm", proc.pid, wait_s)
        return False
    return True
