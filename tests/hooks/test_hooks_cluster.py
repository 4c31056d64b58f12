"""The hooks on the REAL dev cluster (slurm/devcluster): drain, requeue, resume, operator drains.

Each node reads its own /etc/bluevela/hook.env (a per-node mount namespace), so pointing a
node at a fixture tree is editing that file. node1/node3 get the healthy H100 fixture, node2
one with mlx5_3/1 down. Run alone with its own cluster:

    BV_DEVCLUSTER_ID=1 python -m pytest tests/hooks/test_hooks_cluster.py

Takes ~2.5 min: with `nohold_on_prolog_fail` Slurm 22.05 requeues the batch job with a
BeginTime ~2 min ahead (139 s measured here), and that wait is the bulk of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.slurm.cli_client import node_reason_current
from tests.conftest import DevCluster
from tests.fixture_trees import materialized

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
HOSTILE_COMMENT = "$(touch /tmp/bv-pwned-comment);`touch /tmp/bv-pwned-comment2`"
CANARIES = [Path("/tmp/bv-pwned-comment"), Path("/tmp/bv-pwned-comment2"),
            Path("/tmp/bv-pwned-workdir")]


def point_at(cluster: DevCluster, node: str, fixture: str) -> None:
    cluster.set_hook_env(
        node,
        SLURM_CONF=cluster.env["SLURM_CONF"],
        BV_NODE_CLASS="h100",
        BV_SYSFS_ROOT=str(FIXTURES / fixture / "root"),
        BV_NVML_SNAPSHOT=str(FIXTURES / fixture / "nvml.json"),
    )


def requeued_off_node1(cluster: DevCluster, cwd: Path, reason: str, timeout: float) -> None:
    """A 2-node examples/train_ddp.py job while node1's hook.env fails its prolog (node2 and
    node3 healthy): node1's prolog drains it with `reason`, Slurm requeues the job, and it
    completes on node[2-3]."""
    point_at(cluster, "node2", "h100-healthy")
    point_at(cluster, "node3", "h100-healthy")
    t0 = time.monotonic()
    p = cluster.bv("submit", "--wait", "--json", "-N", "2", "--procs-per-node", "1",
                   str(REPO / "examples" / "train_ddp.py"), cwd=cwd, timeout=timeout,
                   check=False)
    took = time.monotonic() - t0
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    job = json.loads(p.stdout)
    assert job["state"] == "COMPLETED" and sorted(job["nodes"]) == ["node2", "node3"], job
    assert job["restarts"] >= 1
    state, got = node_state(cluster, "node1")
    assert state == "drained" and got == reason, (state, got)
    print(f"\njob {job['job_id']} requeued off node1, completed in {took:.0f} s; "
          f"node1: {got}")


def node_state(cluster: DevCluster, node: str) -> tuple[str, str]:
    """sinfo's state and reason, the reason as bv reads it: none for a node in service (24.11
    keeps a resumed node's old drain reason)."""
    out = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"]).stdout.strip()
    state, _, reason = out.splitlines()[0].partition("|")
    current = reason != "none" and node_reason_current(state)
    return state.rstrip("*~#!%$@^-"), (reason if current else "")


def run_in_node(cluster: DevCluster, node: str, phase: str,
                slurm_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a hook inside the node's namespaces (its hostname, its /etc/bluevela), as slurmd
    would: an environment with nothing but Slurm's variables, no PATH."""
    pid = (cluster.state_dir / "run" / f"slurmd.{node}.pid").read_text().strip()
    nsenter = shutil.which("nsenter")
    assert nsenter, "nsenter is needed to enter a node's namespaces"
    assigns = [f"{k}={v}" for k, v in (slurm_env or {}).items()]
    return subprocess.run(
        [nsenter, "-t", pid, "-m", "-u", "-n", "--", "/usr/bin/env", "-i", *assigns,
         sys.executable, "-m", "bluevela.hooks", phase],
        capture_output=True, text=True, timeout=240, check=False)


@pytest.fixture
def cluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    """The shared cluster, clean before and restored after (hook.env files, drains; a bv
    drain left by someone else would trip the fleet breaker)."""
    with devcluster.clean(settle=True):
        for c in CANARIES:
            c.unlink(missing_ok=True)
        yield devcluster


def test_broken_node_drained_job_requeued_then_resumed(cluster: DevCluster, tmp_path: Path) -> None:
    point_at(cluster, "node1", "h100-healthy")
    point_at(cluster, "node2", "h100-ib-port-down")
    point_at(cluster, "node3", "h100-healthy")
    workdir = tmp_path / "work $(touch bv-pwned-workdir)"
    workdir.mkdir()

    # 1. A 2-node job lands on node[1-2]; node2's prolog drains node2 and fails; Slurm
    #    requeues the job, which completes on node1 and node3.
    t0 = time.monotonic()
    p = cluster.bv("submit", "--wait", "--json", "-N", "2", "--procs-per-node", "1",
                   "--comment", HOSTILE_COMMENT, str(REPO / "examples" / "train_ddp.py"),
                   cwd=workdir, timeout=400, check=False)
    took = time.monotonic() - t0
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    job = json.loads(p.stdout)
    assert job["state"] == "COMPLETED" and job["exit_code"] == 0
    assert sorted(job["nodes"]) == ["node1", "node3"], job
    assert job["restarts"] >= 1  # it was requeued
    print(f"\nrequeued job {job['job_id']} completed in {took:.0f} s")

    state, reason = node_state(cluster, "node2")
    assert state == "drained"
    assert reason.startswith("bv: ib: mlx5_3/1 state DOWN"), reason
    spool = Path(cluster.env["BV_SPOOL_DIR"])
    report = json.loads((spool / f"{job['job_id']}.node2.prolog.json").read_text())
    assert report["drained"] is True and report["health"]["status"] == "CRITICAL"
    assert json.loads((spool / f"{job['job_id']}.node1.epilog.json").read_text())["exit_code"] == 0
    assert not any(c.exists() for c in CANARIES)
    assert not (workdir / "bv-pwned-workdir").exists()

    nodes = {n["node"]: n for n in json.loads(cluster.bv("health", "nodes", "--json").stdout)}
    assert nodes["node2"]["drained_by_bluevela"] is True
    assert nodes["node2"]["last_report"]["status"] in ("CRITICAL", "UNKNOWN")

    # 1b. Fleet breaker: 1 of 3 nodes already drained by bv (33% >= 15%): another broken node
    #     is reported loudly but not drained, and its prolog lets the job proceed (exit 0).
    point_at(cluster, "node1", "h100-gpu-pcie-x8")
    # The job's epilog on node1 may still be running after its report is spooled (seen on
    # 24.11): the healthcheck then skips this interval, as it should; the next one runs.
    deadline = time.monotonic() + 60
    while True:
        hc = run_in_node(cluster, "node1", "healthcheck")
        if "is running: healthcheck skipped" not in hc.stderr or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "fleet breaker: 1/3 nodes already drained" in hc.stderr, hc.stderr
    pro = run_in_node(cluster, "node1", "prolog", {"SLURM_JOB_ID": "999999"})
    assert pro.returncode == 0 and "fleet breaker" in pro.stderr, pro.stderr
    assert node_state(cluster, "node1") == ("idle", "")
    (spool / "999999.node1.prolog.json").unlink()
    point_at(cluster, "node1", "h100-healthy")

    # 2. The port is fixed; `bv health resume` (from this login node) returns node2.
    point_at(cluster, "node2", "h100-healthy")
    p = cluster.bv("health", "resume", "node2")
    assert "node2: resumed" in p.stdout
    assert node_state(cluster, "node2") == ("idle", "")

    # 3. The healthcheck hook drains a broken idle node, and resumes it once it passes.
    point_at(cluster, "node2", "h100-ib-rate-hdr")
    hc = run_in_node(cluster, "node2", "healthcheck")
    assert hc.returncode == 0, hc.stderr
    state, reason = node_state(cluster, "node2")
    assert state == "drained" and reason.startswith("bv: ib: mlx5_6/1 rate 200 Gb/s < 400"), reason
    point_at(cluster, "node2", "h100-healthy")
    hc = run_in_node(cluster, "node2", "healthcheck")
    assert "resumed node2" in hc.stderr, hc.stderr
    assert node_state(cluster, "node2") == ("idle", "")

    # 4. An operator's drain is never touched: not by the healthcheck, not by bv health resume.
    cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=maint: dimm swap"])
    hc = run_in_node(cluster, "node3", "healthcheck")
    assert hc.returncode == 0 and "left alone" in hc.stderr, hc.stderr
    p = cluster.bv("health", "resume", "node3", check=False)
    assert p.returncode == 1
    assert "drained by an operator (reason: 'maint: dimm swap')" in p.stderr
    assert node_state(cluster, "node3") == ("drained", "maint: dimm swap")


def test_healthy_cpu_nodes_pass_their_own_hooks(cluster: DevCluster) -> None:
    """The dev cluster's own class (cpu): the prolog passes, and a job's epilog is spooled."""
    p = cluster.bv("submit", "--wait", "--json", "-N", "1", str(REPO / "examples" / "train_ddp.py"),
                   cwd=Path(os.environ.get("TMPDIR", "/tmp")), timeout=300, check=False)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    job = json.loads(p.stdout)
    assert job["state"] == "COMPLETED" and job["restarts"] == 0
    node = job["nodes"][0]
    spool = Path(cluster.env["BV_SPOOL_DIR"])
    deadline = time.monotonic() + 30
    epilog = spool / f"{job['job_id']}.{node}.epilog.json"
    while not epilog.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    prolog = json.loads((spool / f"{job['job_id']}.{node}.prolog.json").read_text())
    assert prolog["health"]["status"] in ("OK", "WARNING"), prolog["health"]
    assert json.loads(epilog.read_text())["telemetry"]["job_wall_s"] > 0
    prom = cluster.node_dir(node) / "metrics" / "bluevela.prom"
    assert 'bluevela_check_status{check="node"} 0' in prom.read_text()


def test_nightly_drain_is_not_resumed_by_the_healthcheck(cluster: DevCluster) -> None:
    """The hourly healthcheck resumed a nightly drain (`bv: nightly <date>: ...`) once
    gpu/ib/node/nccl passed, without re-measuring what the nightly found. Now it stays until
    an operator resumes it (`bv health resume`), which also frees its breaker slot."""
    point_at(cluster, "node2", "h100-healthy")
    reason = "bv: nightly 2026-11-25: gemm 512 TFLOP/s < floor 700"
    cluster.run(["scontrol", "update", "NodeName=node2", "State=DRAIN", f"Reason={reason}"])
    hc = run_in_node(cluster, "node2", "healthcheck")
    assert hc.returncode == 0 and "a nightly drain" in hc.stderr, hc.stderr
    assert node_state(cluster, "node2") == ("drained", reason)
    p = cluster.bv("health", "resume", "node2")
    assert "node2: resumed" in p.stdout
    assert node_state(cluster, "node2") == ("idle", "")
