"""Which running Slurm job a process belongs to, read from `<root>/proc` (no call to Slurm).

Used by the gpu check (a running job's process on a GPU is not a leftover) and by the hooks
(the healthcheck never runs nccl on a node with jobs; the prolog's nccl uses the job's GPUs).

- **Running jobs here**: every job with a live `slurmstepd` on this node. slurmstepd names
  itself `slurmstepd: [<job>.<step>]` (`/proc/<pid>/cmdline`; `.batch`, `.extern`, `.0`,
  `.interactive`; a heterogeneous component `<job>+<n>.<step>`), which Slurm 20.11 to 24.11
  all do. A slurmstepd survives a slurmd restart, so this is right exactly when the
  healthcheck runs at slurmd start. Nodes of the dev cluster share one pid namespace: a
  slurmstepd in another network namespace (`/proc/<pid>/ns/net`) is another node's and is
  skipped (on a real node slurmd, its slurmstepds and its hooks share the host's, so nothing
  is skipped; the UTS namespace would not do: a restarted dev slurmd gets a new one while its
  jobs' slurmstepds keep the old).
- **A process's job**: the first of (1) its ancestry (`stat` parents) up to a slurmstepd,
  (2) its cgroup path naming `job_<id>` (proctrack/cgroup: v1 `/slurm/uid_<u>/job_<id>/...`,
  v2 `/system.slice/slurmstepd.scope/job_<id>/...`), (3) `SLURM_JOB_ID` in its environment.
  It is a running job's process only when that job runs here: a process left behind by a
  finished job (reparented to init, its cgroup or environment still naming the job) is a
  leftover.
- **MPS**: `nvidia-cuda-mps-server` and `nvidia-cuda-mps-control` appear among a GPU's compute
  processes; they are the GPU's sharing daemons, never a job's leftovers.

Reads are bounded (4 KiB of `stat`, 64 KiB of `environ`) and never follow a process's own
files anywhere else; an unreadable process maps to no job.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_STEPD = re.compile(rb"^slurmstepd: \[([0-9]{1,12})(?:\+[0-9]{1,6})?\.")
_CGROUP_JOB = re.compile(r"/job_([0-9]{1,12})(?:/|$)")
_ENV_JOB = re.compile(rb"(?:^|\0)SLURM_JOB_ID=([0-9]{1,12})(?:\0|$)")
MPS_DAEMONS = frozenset({"nvidia-cuda-mps-server", "nvidia-cuda-mps-control"})
MAX_DEPTH = 64


def _read(path: Path, limit: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _pids(proc: Path) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def parent_pid(proc: Path, pid: int) -> int | None:
    """The parent of `pid` from `<proc>/<pid>/stat`; None when unreadable."""
    raw = _read(proc / str(pid) / "stat", 4096)
    if raw is None:
        return None
    fields = raw.rpartition(b")")[2].split()  # the command name may hold spaces and ')'
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def stepd_job(proc: Path, pid: int) -> int | None:
    """The job of a slurmstepd process (from its title), else None."""
    raw = _read(proc / str(pid) / "cmdline", 256)
    m = _STEPD.match(raw or b"")
    return int(m.group(1)) if m else None


def _netns(proc: Path, pid: int | str) -> str | None:
    try:
        return os.readlink(proc / str(pid) / "ns" / "net")
    except OSError:
        return None


@dataclass(frozen=True)
class NodeJobs:
    """The jobs running on this node, by their slurmstepd processes.

    Attributes:
        jobs: job id -> its slurmstepd pids here.
    """

    jobs: dict[int, frozenset[int]]

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(self.jobs)

    def others(self, job_id: int | None) -> frozenset[int]:
        """The running jobs other than `job_id` (the hook's own)."""
        return frozenset(j for j in self.jobs if j != job_id)


def running_jobs(root: Path) -> NodeJobs:
    """Every job with a live slurmstepd on this node, read from `<root>/proc`."""
    proc = root / "proc"
    mine = _netns(proc, "self")
    jobs: dict[int, set[int]] = {}
    for pid in _pids(proc):
        comm = _read(proc / str(pid) / "comm", 64)
        if comm is None or comm.strip() != b"slurmstepd":
            continue
        job = stepd_job(proc, pid)
        if job is None:
            continue
        theirs = _netns(proc, pid)
        if mine is not None and theirs is not None and theirs != mine:
            continue  # another (dev cluster) node's step
        jobs.setdefault(job, set()).add(pid)
    return NodeJobs({j: frozenset(p) for j, p in jobs.items()})


def process_job(root: Path, pid: int, stepds: dict[int, int] | None = None) -> int | None:
    """The job `pid` belongs to by ancestry, cgroup or environment (see the module docstring);
    None when nothing names one. `stepds` maps slurmstepd pids to their jobs (a faster
    ancestry walk); without it each ancestor's title is read."""
    proc = root / "proc"
    cur: int | None = pid
    for _ in range(MAX_DEPTH):
        if cur is None or cur <= 1:
            break
        job = stepds.get(cur) if stepds is not None else stepd_job(proc, cur)
        if job is not None:
            return job
        cur = parent_pid(proc, cur)
    raw = _read(proc / str(pid) / "cgroup", 8192)
    if raw:
        for line in raw.decode(errors="replace").splitlines():
            m = _CGROUP_JOB.search(line.partition(":")[2].partition(":")[2])
            if m:
                return int(m.group(1))
    env = _ENV_JOB.search(_read(proc / str(pid) / "environ", 64 << 10) or b"")
    return int(env.group(1)) if env else None


def is_mps_daemon(root: Path, pid: int) -> bool:
    """`pid` is an MPS daemon (its argv[0]'s name; `comm` is cut at 15 characters)."""
    raw = _read(root / "proc" / str(pid) / "cmdline", 4096)
    if not raw:
        return False
    return os.path.basename(raw.split(b"\0", 1)[0].decode(errors="replace")) in MPS_DAEMONS


@dataclass(frozen=True)
class ProcessOwners:
    """What the GPU processes of one reading are, besides leftovers.

    Attributes:
        jobs: pid -> the running job it belongs to.
        mps: MPS daemons.
        running: the jobs running on this node.
    """

    jobs: dict[int, int]
    mps: frozenset[int]
    running: frozenset[int]


def owners(root: Path, pids: Iterable[int], node: NodeJobs | None = None) -> ProcessOwners:
    """Map `pids` (a GPU's compute processes) to running jobs and MPS daemons."""
    node = running_jobs(root) if node is None else node
    stepds = {p: j for j, ps in node.jobs.items() for p in ps}
    jobs: dict[int, int] = {}
    mps: set[int] = set()
    for pid in set(pids):
        if is_mps_daemon(root, pid):
            mps.add(pid)
            continue
        if not node.jobs:
            continue  # no job runs here: nothing can be a running job's
        job = process_job(root, pid, stepds)
        if job is not None and job in node.jobs:
            jobs[pid] = job
    return ProcessOwners(jobs, frozenset(mps), node.ids)
