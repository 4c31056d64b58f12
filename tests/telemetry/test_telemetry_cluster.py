"""On the real dev cluster: a DDP job's time series land in the archive.

Every dev node runs the node sampler (1 s interval, per-node CPU cgroup) started by
`slurm/devcluster up`; the job's epilogs cut its window into the spool, and ingest builds
`<archive>/series/<job>.h5`, read here with h5py alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from bluevela.telemetry.format import read_file

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_ddp_job_series_holds_every_node_within_the_job_window(devcluster,
                                                                 tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    proc = devcluster.bv("submit", "--wait", "-N", "3", "--procs-per-node", "1", "--json",
                         str(REPO / "examples" / "train_ddp.py"), "--steps", "12",
                         "--step-s", "0.25", check=False, cwd=tmp_path, timeout=240)
    assert proc.stdout.strip(), proc.stderr
    sub = json.loads(proc.stdout)
    job_id, nodes = sub["job_id"], sorted(sub["nodes"])
    assert sub["exit_code"] == 0, sub
    archive = tmp_path / "archive"
    archive.mkdir()
    arch = ("archive", "--archive-dir", str(archive))
    ing = json.loads(devcluster.bv(*arch, "ingest", "--job", str(job_id), "--wait", "120",
                                   "--json", timeout=200).stdout)
    assert ing["jobs_archived"] == [job_id] and not ing["quarantined"], ing
    job = json.loads(devcluster.bv(*arch, "show", str(job_id), "--json").stdout)
    start, end = job["start_unix_s"], job["end_unix_s"]
    spool = Path(devcluster.env["BV_SPOOL_DIR"])
    assert not list(spool.glob(f"{job_id}.*.series.bvts"))  # moved to done/ with the reports
    assert len(list((spool / "done").glob(f"{job_id}.*.series.bvts"))) == 3
    # Where each node's sampler took its CPU figures: its own cgroup (named after the node),
    # never the host-wide /proc/stat that every dev node shares.
    sources = {}
    for node in nodes:
        [side] = (spool / "done").glob(f"{job_id}.{node}.*series.bvts")
        sources[node] = read_file(side, strict=True).header.components["node"]["cpu_source"]
    for node, src in sources.items():
        assert src.startswith("cgroup ") and src.endswith(f"/{node}"), sources

    with h5py.File(archive / "series" / f"{job_id}.h5", "r") as f:
        assert f.attrs["format"] == "bluevela-job-series" and f.attrs["job_id"] == job_id
        assert [n.decode() if isinstance(n, bytes) else n for n in f["nodes"][()]] == nodes
        t = f["time"][()]
        assert f.attrs["interval_s"] == 1.0 and np.allclose(np.diff(t), 1.0)
        busy = f["node/cpu_busy_pct"][()]
        throttled = f["node/cpu_throttled_pct"][()]
        assert f["gpu/util_pct"].shape[:2] == (3, 0)  # CPU nodes: no GPUs
    inside = (t >= start - 1.5) & (t <= end + 0.5)
    assert inside.all(), (t[0] - start, t[-1] - end)
    for i, node in enumerate(nodes):
        have = np.isfinite(busy[i])
        assert have.sum() >= 3, (node, busy[i])  # a few seconds of 1 s samples
        # Per-node CPU from the node's own cgroup: the job's worker kept this node busy.
        assert np.nanmax(busy[i]) > 1.0, (node, busy[i])
        assert np.isfinite(throttled[i][have]).all()
