"""Issue 24 on the REAL dev cluster: a node running a GPU job is not drained by another job's
prolog (a job without GPUs on the shared node) nor by the healthcheck slurmd runs at every
start (a routine slurmd restart under the job).

The job is real (a batch job on node1 whose process sleeps); node1's GPUs are a recorded-format
NVML snapshot (h100-healthy) listing that process on GPU 0, pointed at through node1's
hook.env (BV_NVML_SNAPSHOT) as the other cluster tests do; the process-to-job mapping reads the
real /proc (the job's real slurmstepd). On 9058adc the prolog of the second job drained node1
`bv: gpu: GPU0 1 leftover process(es)`, and so did the healthcheck at the slurmd restart.
Run alone: `BV_DEVCLUSTER_ID=7 python -m pytest tests/health/test_busy_node_cluster.py` (~25 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DevCluster
from tests.fixture_trees import materialized

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
NODE = "node1"


def _state(cluster: DevCluster, node: str) -> tuple[str, str]:
    out = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"]).stdout.strip()
    state, _, reason = out.splitlines()[0].partition("|")
    return state.rstrip("*~#!%$@^-"), ("" if reason == "none" else reason)


def _job_state(cluster: DevCluster, job: str) -> str:
    out = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
    return out or "GONE"


def _wait(what: str, cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _snapshot(path: Path, pid: int) -> Path:
    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    procs = [{"pid": pid, "used_memory_bytes": 1 << 30}]
    snap["gpus"][0]["compute_processes"] = procs
    snap["recheck"] = {"after_s": 1.0, "gpus": [
        {"index": 0, "clocks_event_reasons": 1, "compute_processes": procs, "errors": {}}]}
    path.write_text(json.dumps(snap))
    return path


def test_a_busy_node_is_not_drained(devcluster: DevCluster, tmp_path: Path) -> None:
    cluster = devcluster
    saved = cluster.hook_env(NODE).read_text()
    cluster.wait_idle(timeout=120)
    cluster.resume_all()
    tmp_path.chmod(0o755)
    pidfile = tmp_path / "gpu-job.pid"
    script = tmp_path / "gpu-job.sh"
    script.write_text(f"#!/bin/bash\necho $$ > {pidfile}\nexec sleep 300\n")
    script.chmod(0o755)
    job = cluster.run(["sbatch", "--parsable", "-w", NODE, "-N1", "-n1", "-o", "/dev/null",
                       str(script)]).stdout.strip()
    other = None
    try:
        _wait("the GPU job's process", lambda: pidfile.exists() and pidfile.read_text().strip(),
              60)
        pid = int(pidfile.read_text())
        cluster.set_hook_env(NODE, BV_NVML_SNAPSHOT=str(_snapshot(tmp_path / "nvml.json", pid)))

        # 1. A job without GPUs lands on the node whose GPU 0 the first job uses.
        other = cluster.run(["sbatch", "--parsable", "-w", NODE, "-N1", "-n1", "-o", "/dev/null",
                             "--wrap", "true"]).stdout.strip()
        spool = Path(cluster.env["BV_SPOOL_DIR"])
        report = spool / f"{other}.{NODE}.prolog.json"
        _wait("the second job's prolog report", report.exists, 60)
        prolog = json.loads(report.read_text())
        gpu = next(c for c in prolog["health"]["checks"] if c["name"] == "gpu")
        assert _state(cluster, NODE)[1] == "", _state(cluster, NODE)
        assert gpu["status"] != "CRITICAL" and prolog["drained"] is False, gpu
        _wait("the second job to end", lambda: _job_state(cluster, other) == "GONE", 60)

        # 2. slurmd restarts under the first job: its HealthCheckProgram runs at the start.
        last = cluster.node_dir(NODE) / "var" / "last_run.json"
        before = time.time()
        slurmd = int((cluster.state_dir / "run" / f"slurmd.{NODE}.pid").read_text())
        os.kill(slurmd, signal.SIGTERM)
        _wait("slurmd to stop", lambda: not Path(f"/proc/{slurmd}").exists(), 30)
        subprocess.run([sys.executable, str(REPO / "slurm" / "devcluster"), "revive", NODE],
                       env=cluster.environ(), check=True, capture_output=True, timeout=120)

        def healthcheck_done() -> bool:
            try:
                run = json.loads(last.read_text())
            except (OSError, ValueError):
                return False
            return run.get("phase") == "healthcheck" and run.get("time", 0) > before

        _wait("the healthcheck at slurmd start", healthcheck_done, 90)
        run = json.loads(last.read_text())
        checks = {c["name"]: c for c in run["health"]["checks"]}
        assert checks["gpu"]["status"] != "CRITICAL", checks["gpu"]
        assert "nccl" not in checks  # never next to a running job
        assert run["drained"] is False and _state(cluster, NODE)[1] == "", _state(cluster, NODE)
        assert _job_state(cluster, job) == "RUNNING"
    finally:
        cluster.run(["scancel", job, *([other] if other else [])], check=False)
        cluster.hook_env(NODE).write_text(saved)
        cluster.wait_idle(timeout=120)
        cluster.resume_all()
