"""Issue 24: a busy or shared node is judged on what is not in use.

Real processes read from the real /proc: a stand-in slurmstepd (its `comm` and title as Slurm
22.05's, `slurmstepd: [<job>.batch]`, seen on the dev cluster) with a child standing for the
job's GPU process; the GPU listing is a recorded-format NVML snapshot naming those pids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.context import ProbeContext
from bluevela.health.jobprocs import owners, process_job, running_jobs
from bluevela.health.result import Status
from bluevela.health.runner import for_jobs_here, plan_tier
from bluevela.site import NodeClass, Site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
JOB = 904242

# The stand-in slurmstepd: leaves the test's process tree (as a real one is slurmd's, not the
# hook's: below the hook it would count as the hook's own), renames itself as slurmstepd does,
# starts the "job" (a sleeping child), prints both pids, then waits.
_STEPD = """
import os, subprocess, sys, time
if os.fork():
    os._exit(0)
with open('/proc/self/comm', 'w') as fh:
    fh.write('slurmstepd')
child = subprocess.Popen([sys.argv[1], '-c', 'import time; time.sleep(120)'])
print(os.getpid(), child.pid, flush=True)
time.sleep(120)
"""


_DETACHED = """
import os, time
if os.fork():
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def _detached(argv0: str, env: dict[str, str] | None = None) -> int:
    """A sleeping process outside the test's process tree (init's child), named `argv0`."""
    p = subprocess.Popen([argv0, "-c", _DETACHED], executable=sys.executable, env=env,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    pid = int(p.stdout.readline())
    p.wait()
    return pid


@pytest.fixture
def job() -> Iterator[tuple[int, int]]:
    """(slurmstepd pid, the job's process pid) of a running stand-in job JOB."""
    launcher = subprocess.Popen([f"slurmstepd: [{JOB}.batch]", "-c", _STEPD, sys.executable],
                                executable=sys.executable, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        pids = [int(p) for p in launcher.stdout.readline().split()]
        launcher.wait()
        yield pids[0], pids[1]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        launcher.wait()


def _snapshot(tmp_path: Path, pids: list[int], name: str = "nvml") -> Path:
    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    procs = [{"pid": p, "used_memory_bytes": 1 << 30} for p in pids]
    snap["gpus"][0]["compute_processes"] = procs
    snap["recheck"] = {"after_s": 1.0, "gpus": [
        {"index": 0, "clocks_event_reasons": 1, "compute_processes": procs, "errors": {}}]}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(snap))
    return path


def _ctx(cls: NodeClass, snap: Path, phase: str, **kw: object) -> ProbeContext:
    return ProbeContext(cls, "h100", root=Path("/"), nvml_snapshot=snap, phase=phase, **kw)  # type: ignore[arg-type]


def test_running_jobs_and_process_owner_from_proc(job: tuple[int, int]) -> None:
    stepd, child = job
    here = running_jobs(Path("/"))
    assert stepd in here.jobs[JOB]
    assert process_job(Path("/"), child) == JOB
    assert process_job(Path("/"), os.getpid()) is None or os.environ.get("SLURM_JOB_ID")


def test_healthcheck_does_not_count_a_running_jobs_process(
        h100: NodeClass, job: tuple[int, int], tmp_path: Path) -> None:
    """slurmd runs the healthcheck at every start: a running job's process on GPU0 is not a
    leftover (9058adc: CRITICAL `GPU0 1 leftover process(es)`, a drain under the job)."""
    _, child = job
    r = get_check("gpu").run_once(_ctx(h100, _snapshot(tmp_path, [child]), "healthcheck"))
    assert r.status is Status.OK, r.summary
    assert r.metrics["job_processes_count"] == 1 and r.metrics["processes_count"] == 0


def test_a_finished_jobs_process_is_still_a_leftover(h100: NodeClass, tmp_path: Path) -> None:
    """A process whose environment names a job that no longer runs here (it escaped its
    job: reparented, SLURM_JOB_ID still set) is a leftover."""
    orphan = _detached("python3", {**os.environ, "SLURM_JOB_ID": str(JOB + 1)})
    try:
        assert process_job(Path("/"), orphan) == JOB + 1
        r = get_check("gpu").run_once(_ctx(h100, _snapshot(tmp_path, [orphan]), "healthcheck"))
        assert r.status is Status.CRITICAL and "GPU0 1 leftover process(es)" in r.summary
    finally:
        os.kill(orphan, signal.SIGKILL)


def test_a_job_without_gpus_on_a_shared_node(h100: NodeClass, job: tuple[int, int],
                                             tmp_path: Path) -> None:
    """Another job's process on the GPUs, a job given no GPUs (no SLURM_JOB_GPUS): its
    prolog is OK (9058adc: every GPU counted, the other job's process a leftover: drained);
    the MPS server is no leftover either."""
    _, child = job
    mps = _detached("/usr/bin/nvidia-cuda-mps-server")
    try:
        snap = _snapshot(tmp_path, [child, mps])
        r = get_check("gpu").run_once(_ctx(h100, snap, "prolog", job_id=JOB + 7))
        assert r.status is Status.OK, r.summary
        found = owners(Path("/"), [child, mps])
        assert found.jobs == {child: JOB} and found.mps == {mps}
    finally:
        os.kill(mps, signal.SIGKILL)


def test_nccl_never_runs_next_to_a_running_job(site: Site, h100: NodeClass,
                                                job: tuple[int, int], tmp_path: Path) -> None:
    snap = _snapshot(tmp_path, [])
    full = plan_tier(site, "full")
    plan, why = for_jobs_here(full, _ctx(h100, snap, "healthcheck"))
    assert "nccl" in full.checks and "nccl" not in plan.checks
    assert why is not None and str(JOB) in why
    # A prolog: its own job does not count; another job without the job's GPUs: left out;
    # with the job's GPUs known, nccl runs on those (checks/nccl.py).
    assert "nccl" in for_jobs_here(full, _ctx(h100, snap, "prolog", job_id=JOB))[0].checks
    assert "nccl" not in for_jobs_here(full, _ctx(h100, snap, "prolog", job_id=1))[0].checks
    kept = for_jobs_here(full, _ctx(h100, snap, "prolog", job_id=1, job_gpus=(2, 3)))[0]
    assert "nccl" in kept.checks


def test_an_idle_node_keeps_nccl(site: Site, h100: NodeClass, tmp_path: Path) -> None:
    full = plan_tier(site, "full")
    # An idle node: a root whose /proc holds no process (this machine's own /proc may show a
    # job: the suite's other worker runs its dev cluster's jobs beside this one).
    idle = tmp_path / "idle-root"
    (idle / "proc").mkdir(parents=True)
    assert not running_jobs(idle).jobs
    ctx = ProbeContext(h100, "h100", root=idle, nvml_snapshot=_snapshot(tmp_path, []),
                       phase="healthcheck")
    assert for_jobs_here(full, ctx) == (full, None)


def test_prolog_nccl_uses_only_the_jobs_gpus(h100: NodeClass) -> None:
    from bluevela.health.checks.nccl import job_gpus_subset

    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "2,3"}
    ctx = ProbeContext.from_env(h100, "h100", env=env, phase="prolog")
    assert ctx.job_id == 77 and job_gpus_subset(ctx) == (2, 3)
    # Only CUDA_VISIBLE_DEVICES (the same indexes in the prolog): used the same way.
    ctx = ProbeContext.from_env(h100, "h100", env={"CUDA_VISIBLE_DEVICES": "5"}, phase="prolog")
    assert job_gpus_subset(ctx) == (5,)
    every = ProbeContext.from_env(h100, "h100", env={"SLURM_JOB_GPUS": "0-7"}, phase="prolog")
    assert job_gpus_subset(every) is None  # all of the class's: as before
    assert job_gpus_subset(ProbeContext.from_env(h100, "h100", env=env,
                                                 phase="healthcheck")) is None
