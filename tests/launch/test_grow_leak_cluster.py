"""No grow leaves a helper job behind (issue 23; bluevela/launch/grow.py), on the REAL dev cluster.

The grow of a plain `sleep` job (no DDP: `grow()` is called directly, or from inside the job
as the supervisor calls it), interrupted at each point where a helper job `bv-grow-JOB` exists:

- salloc killed while its request pends (its "Pending job allocation N" line is all that names
  the helper);
- slurmctld down (stopped, then started again 12 s later: longer than scancel's own retries)
  when the grow cleans up;
- the job cancelled (Slurm's SIGTERM to the job's processes, then SIGKILL after KillWait) while
  the helper pends, and while it holds a node not yet given to the job.

Each time: no live job named bv-grow-JOB is left, and the grow says why it stopped.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from bluevela.launch.grow import LIVE_STATES, Runner, grow, helper_name, run_cli
from bluevela.slurm.command import SlurmCall
from tests.conftest import DEVCLUSTER, REPO, DevCluster

pytestmark = pytest.mark.cluster


def _helpers(cluster: DevCluster, job: str) -> list[str]:
    out = cluster.run(["squeue", "-h", "-t", LIVE_STATES, "-n", helper_name(job), "-o", "%i %T"],
                      check=False).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def _state(cluster: DevCluster, job: str) -> str:
    return cluster.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"],
                       check=False).stdout.strip()


def _until(what: str, cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not callable(cond) or not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _sbatch(cluster: DevCluster, cwd: Path, *args: str) -> str:
    return cluster.run(["sbatch", "--parsable", "-o", "/dev/null", *args], cwd=cwd).stdout.strip()


def _running(cluster: DevCluster, *jobs: str) -> None:
    _until(f"jobs {jobs} running", lambda: all(_state(cluster, j) == "RUNNING" for j in jobs), 60)


@pytest.mark.timeout(300)
def test_salloc_killed_or_slurmctld_down_leaves_no_helper(devcluster: DevCluster,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    for key, value in devcluster.env.items():
        monkeypatch.setenv(key, value)
    job = _sbatch(devcluster, tmp_path, "-N1", "-w", "node1", "--exclusive", "-t", "30",
                  "--wrap", "sleep 600")
    blocker = _sbatch(devcluster, tmp_path, "-N2", "-w", "node[2-3]", "--exclusive",
                      "--wrap", "sleep 600")
    said: list[str] = []
    restarts: list[threading.Thread] = []

    def ctld(action: str) -> None:
        devcluster.run([sys.executable, str(DEVCLUSTER), "ctld", action])

    def restart() -> None:
        time.sleep(12)
        ctld("start")

    def runner(stop_ctld: bool) -> Runner:
        def run(argv: Sequence[str], timeout: float, cwd: str | None) -> SlurmCall:
            if argv[0] != "salloc":
                return run_cli(argv, timeout, cwd)
            # No node is free: salloc waits; killed at 3 s as a hung one is at its timeout.
            proc = run_cli(argv, 3.0, cwd)
            said.append(proc.stderr)
            if stop_ctld:
                ctld("stop")
                t = threading.Thread(target=restart)
                t.start()
                restarts.append(t)
            return proc
        return run

    try:
        _running(devcluster, job, blocker)
        # 1. salloc killed while pending.
        res = grow(job, ["node1"], [], 20, run=runner(False))
        assert not res.ok and "no node granted" in res.why and "timed out" in res.why, res.why
        assert "Pending job allocation" in said[-1], said
        assert res.left == [] and _helpers(devcluster, job) == []
        # 2. The same, and slurmctld stopped before the cleanup, back 12 s later.
        t0 = time.monotonic()
        res = grow(job, ["node1"], [], 20, run=runner(True))
        took = time.monotonic() - t0
        for t in restarts:
            t.join(60)
        assert "Pending job allocation" in said[-1], said
        assert not res.ok and res.left == [], (res.why, res.left)
        assert took > 12, took  # it waited for slurmctld to come back
        assert _helpers(devcluster, job) == []
        assert _state(devcluster, job) == "RUNNING"
    finally:
        for t in restarts:
            t.join(60)
        devcluster.run([sys.executable, str(DEVCLUSTER), "ctld", "start"], check=False)
        devcluster.run(["scancel", job, blocker], check=False)


GROW_IN_JOB = """\
import os, sys, time
from pathlib import Path
from bluevela.launch.grow import grow, run_cli

point, out = sys.argv[1], Path(sys.argv[2])

def run(argv, timeout, cwd):
    proc = run_cli(argv, timeout, cwd)
    if argv[0] == "salloc" and point == "granted":
        out.with_suffix(".granted").write_text(proc.stderr)
        time.sleep(60)  # the job is cancelled here: the helper holds its node
    return proc

job = os.environ["SLURM_JOB_ID"]
res = grow(job, [os.environ["SLURMD_NODENAME"]], [], 60, run=run)
out.write_text(f"ok={res.ok} left={res.left} why={res.why}\\n")
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["pending", "granted"])
def test_a_job_cancelled_during_its_grow_leaves_no_helper(devcluster: DevCluster,
                                                          tmp_path: Path, point: str) -> None:
    """The grow runs inside the job (as in the supervisor); `scancel JOB` while the helper
    pends (no node free) or holds its node (granted, not yet given to the job)."""
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    script = tmp_path / "grow_in_job.py"
    script.write_text(GROW_IN_JOB)
    out = tmp_path / "grow.out"
    job = devcluster.run(["sbatch", "--parsable", "-N1", "-w", "node1", "--exclusive", "-t", "30",
                          "-o", str(tmp_path / "job.log"), f"--export=ALL,PYTHONPATH={REPO}",
                          "--wrap", f"exec {sys.executable} {script} {point} {out}"],
                         cwd=tmp_path).stdout.strip()
    blocker = ""
    if point == "pending":
        blocker = _sbatch(devcluster, tmp_path, "-N2", "-w", "node[2-3]", "--exclusive",
                          "--wrap", "sleep 600")
    try:
        if point == "pending":
            _until("a pending helper", lambda: any(
                h.endswith("PENDING") for h in _helpers(devcluster, job)), 60)
        else:
            _until("the helper granted", out.with_suffix(".granted").exists, 60)
            assert len(_helpers(devcluster, job)) == 1
        devcluster.run(["scancel", job])
        _until("the grow's report", out.exists, 20)
        report = out.read_text()
        assert "ok=False left=[] why=the job is ending (SIGTERM)" in report, report
        assert _helpers(devcluster, job) == []
        if blocker:
            devcluster.run(["scancel", blocker])
        devcluster.wait_idle(timeout=60)  # the helper's node too
    finally:
        devcluster.run(["scancel", job, *([blocker] if blocker else [])], check=False)
