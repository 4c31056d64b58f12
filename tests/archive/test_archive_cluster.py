"""End to end on the real dev cluster: a 3-node job's prolog and epilog reports, written by the
real hooks into the spool, ingested and shown."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_node_job_is_archived_with_each_node_health_and_the_exit_status(
        devcluster, tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    proc = devcluster.bv("submit", "--wait", "-N", "3", "--procs-per-node", "1", "--json",
                         str(REPO / "examples" / "train_ddp.py"), "--steps", "3", "--fail",
                         check=False, cwd=tmp_path, timeout=400)
    assert proc.stdout.strip(), proc.stderr
    sub = json.loads(proc.stdout)
    job_id = sub["job_id"]
    assert sorted(sub["nodes"]) == ["node1", "node2", "node3"], sub
    # A fresh archive: the cluster's own may hold other sessions' files. Node epilogs may
    # still run after the job ends: wait for them, as EpilogSlurmctld does.
    archive = tmp_path / "archive"
    archive.mkdir()
    arch = ("archive", "--archive-dir", str(archive))
    ing = json.loads(devcluster.bv(*arch, "ingest", "--job", str(job_id), "--wait", "120",
                                   "--json", timeout=300).stdout)
    assert ing["jobs_archived"] == [job_id], ing
    assert ing["reports_ingested"] == 6 and not ing["quarantined"], ing

    job = json.loads(devcluster.bv(*arch, "show", str(job_id), "--json").stdout)
    assert [n["node"] for n in job["nodes"]] == ["node1", "node2", "node3"]
    assert job["completion"] == "all_reported" and job["missing_nodes"] == []
    assert job["num_nodes"] == 3
    assert job["exit_code"] == sub["exit_code"] != 0, (job["exit_code"], sub)
    for n in job["nodes"]:
        for phase in ("prolog", "epilog"):
            rep = n[phase]
            assert rep is not None, (n["node"], phase)
            health = rep["health"]
            assert health["status"] in ("OK", "WARNING", "CRITICAL", "UNKNOWN")
            assert health["checks"] and all(c["status"] for c in health["checks"])
            assert rep["phase"] == phase
        assert n["epilog"]["exit_code"] == job["exit_code"]
    assert Path(job["archive_file"]).is_file()
    assert devcluster.bv(*arch, "verify").returncode == 0
    assert not list(Path(devcluster.env["BV_SPOOL_DIR"]).glob(f"{job_id}.*.json"))
    if shutil.which("h5dump"):
        dump = subprocess.run(["h5dump", "-d", "/jobs", job["archive_file"]],
                              capture_output=True, text=True, timeout=60, check=True)
        assert str(job_id) in dump.stdout
