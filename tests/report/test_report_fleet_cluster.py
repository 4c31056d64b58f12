"""The fleet report over what the REAL hooks wrote on the dev cluster.

The prolog and epilog hooks run inside the nodes' namespaces (as slurmd runs them, see
tests/hooks/test_hooks_cluster.py): node2 is pointed at the recorded H100 fixture with mlx5_3/1 down,
so its prolog drains it through slurmctld with the real `bv: ib: ...` reason. A job that
"moved" (node[1-2], then node[1,3] after node2's prolog failed) and a failing job on node3
are archived by `bv archive ingest --job`, then `bv report fleet` must name the cause, the
requeue, the drained node and the jobs' outcomes. Running the hooks directly (not a real Slurm
requeue, ~2.5 min) keeps this a ~20 s test.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import DevCluster
from tests.hooks.test_hooks_cluster import cluster, node_state, point_at, run_in_node

pytestmark = [pytest.mark.cluster]
__all__ = ["cluster"]  # the fixture, imported for pytest

# Fresh ids on every run: the dev cluster's archive outlives `devcluster down`, and an id
# archived by an earlier run would make these reports duplicates (not stored again).
_BASE = 4_000_000 + (time.time_ns() // 1_000_000) % 10_000_000 * 2
JOB_MOVED, JOB_FAILED = _BASE + 1, _BASE + 2


def _hook(c: DevCluster, node: str, phase: str, job: int, nodelist: str, n: int,
          exit2: str | None = None) -> None:
    env = {"SLURM_JOB_ID": str(job), "SLURM_JOB_USER": "alice", "SLURM_JOB_PARTITION": "debug",
           "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(n)}
    if exit2 is not None:
        env["SLURM_JOB_EXIT_CODE2"] = exit2
    res = run_in_node(c, node, phase, env)
    assert "hook error" not in res.stderr, res.stderr


def test_report_over_real_hook_reports(cluster: DevCluster) -> None:
    for node in ("node1", "node3"):
        point_at(cluster, node, "h100-healthy")
    point_at(cluster, "node2", "h100-ib-port-down")
    since = time.time() - 1
    # attempt 1 on node[1-2]: node2's prolog fails and drains node2 (Slurm would requeue)
    _hook(cluster, "node1", "prolog", JOB_MOVED, "node[1-2]", 2)
    _hook(cluster, "node2", "prolog", JOB_MOVED, "node[1-2]", 2)
    assert node_state(cluster, "node2")[1].startswith("bv: ib: mlx5_3/1")
    # attempt 2 on node[1,3] completes
    _hook(cluster, "node3", "prolog", JOB_MOVED, "node[1,3]", 2)
    _hook(cluster, "node1", "epilog", JOB_MOVED, "node[1,3]", 2, "0:0")
    _hook(cluster, "node3", "epilog", JOB_MOVED, "node[1,3]", 2, "0:0")
    # a job on node3 that fails with exit code 3
    _hook(cluster, "node3", "prolog", JOB_FAILED, "node3", 1)
    _hook(cluster, "node3", "epilog", JOB_FAILED, "node3", 1, "3:0")
    for job in (JOB_MOVED, JOB_FAILED):
        cluster.bv("archive", "ingest", "--job", str(job), "--timeout-min", "0")

    rep = json.loads(cluster.bv("report", "fleet", "--since", str(since), "--json").stdout)
    causes = {(c["cause"], c["source"]): c["count"] for c in rep["interruptions"]["by_cause"]}
    assert causes == {("ib", "prolog"): 1}, causes
    assert rep["requeues"]["jobs_requeued"] == 1
    assert rep["requeues"]["by_cause"] == {"prolog failure": 1}
    assert rep["fleet"]["out_now"] == ["node2"]
    worst = rep["worst_nodes"][0]
    assert (worst["node"], worst["class"], worst["causes"], worst["out_now"]) == (
        "node2", "cpu", {"ib": 1}, True)
    g = rep["goodput"]
    assert g["jobs"] == 2 and g["basis"] == "node_hours"  # the dev cluster's class has no GPUs
    assert g["jobs_by_outcome"]["completed"] == 1 and g["jobs_by_outcome"]["failed"] == 1
