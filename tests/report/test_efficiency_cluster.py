"""On the real dev cluster: a DDP job with one CPU-throttled node names that node as the
straggler in `bv archive show JOB --efficiency`.

`slurm/devcluster throttle node2 --cpu 25` caps node2's CPU cgroup (its slurmd, so the job's
worker there, and its sampler) at a quarter of a CPU; the 3-node training loop is CPU-bound, so
node2's cgroup is throttled in most 1 s samples while node1/node3 are never capped. ~30-40 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import DEVCLUSTER

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_throttled_node_is_named_the_straggler(devcluster, tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    throttle = [sys.executable, str(DEVCLUSTER), "throttle", "node2"]
    ident = devcluster.env.get("BV_DEVCLUSTER_ID", "0")
    v1 = Path(f"/sys/fs/cgroup/cpu/bv{ident}/node2/cpu.cfs_quota_us")
    v2 = Path(f"/sys/fs/cgroup/bv{ident}/node2/cpu.max")
    quota = v1 if v1.exists() else v2
    devcluster.run([*throttle, "--cpu", "25"])
    try:
        assert quota.read_text().split()[0] != ("-1" if quota == v1 else "max")
        proc = devcluster.bv("submit", "--wait", "-N", "3", "--procs-per-node", "1", "--json",
                             str(REPO / "examples" / "train_ddp.py"), "--steps", "1500",
                             check=False, cwd=tmp_path, timeout=240)
    finally:
        devcluster.run([*throttle, "--cpu", "off"])
    assert quota.read_text().split()[0] == ("-1" if quota == v1 else "max")
    assert proc.stdout.strip(), proc.stderr
    sub = json.loads(proc.stdout)
    job_id = sub["job_id"]
    assert sub["exit_code"] == 0, sub
    archive = tmp_path / "archive"
    archive.mkdir()
    arch = ("archive", "--archive-dir", str(archive))
    ing = json.loads(devcluster.bv(*arch, "ingest", "--job", str(job_id), "--wait", "120",
                                   "--json", timeout=200).stdout)
    assert ing["jobs_archived"] == [job_id], ing

    eff = json.loads(devcluster.bv(*arch, "show", str(job_id), "--efficiency", "--json").stdout)
    assert eff["nodes"] == 3 and eff["steady"]["basis"] == "CPU busy"
    assert eff["steady"]["samples"] >= 8, eff["steady"]  # 1 s samples over the training loop
    assert [s["node"] for s in eff["stragglers"]] == ["node2"], eff["stragglers"]
    ev = eff["stragglers"][0]
    assert ev["evidence"].startswith("node2: CPU throttled "), ev
    assert ev["metrics"]["cpu_throttled"]["value"] >= 0.3, ev
    per = {p["node"]: p for p in eff["per_node"]}
    assert per["node1"]["cpu_throttled_share"] == 0 and per["node3"]["cpu_throttled_share"] == 0
    assert not per["node1"]["straggler"] and not per["node3"]["straggler"]

    text = devcluster.bv(*arch, "show", str(job_id), "--efficiency").stdout
    assert "stragglers: 1 node(s):" in text and "node2: CPU throttled" in text, text
    assert "node1:" not in text and "node3:" not in text
