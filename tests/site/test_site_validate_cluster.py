"""`bv site validate --cluster` against the live dev cluster (real sinfo, real `scontrol show
config`, the cluster's real spool and archive): every node has a class, the directories are
root's and 0755, bv's flags are merged into the cluster's own lines, and the lines that differ
(the dev cluster runs the checkout's shims) are marked to merge. A few seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import DevCluster

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]


def test_site_validate_against_the_dev_cluster(devcluster: DevCluster) -> None:
    p = devcluster.run([sys.executable, "-m", "bluevela", "site", "validate", "--cluster",
                        "--json", str(REPO / "site.yaml")], check=False, timeout=120)
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stdout + p.stderr
    data = json.loads(p.stdout)
    found = {(f["check"], f["status"]) for f in data["findings"]}
    assert ("node classes", "OK") in found
    timeouts = [f["message"] for f in data["findings"] if f["check"] == "timeouts"]
    # prolog and epilog against PrologEpilogTimeout, the healthcheck against slurmd's 60 s
    assert len(timeouts) == 3 and timeouts[0].startswith("prolog worst case ")
    assert any(t.startswith("healthcheck worst case ") and t.endswith("(slurmd's kill)")
               for t in timeouts), timeouts
    assert timeouts[0].endswith("<= PrologEpilogTimeout=65534")  # the dev cluster's: no limit
    assert ("spool", "OK") in found and ("archive", "OK") in found
    lines = {x["line"]: x["in_place"] for x in data["slurm_conf"]}
    # The dev cluster's own flags are kept, bv's are in them already.
    assert lines["PrologFlags=Alloc"] is True
    assert lines["SchedulerParameters=nohold_on_prolog_fail,sched_interval=5,bf_interval=5,"
                 "permit_job_expansion"] is True
    # It runs this checkout's shims, not /opt/bluevela's: said, as a WARNING (exit 1).
    assert lines["Prolog=/opt/bluevela/prolog_epilog/prolog"] is False
    assert data["status"] in ("WARNING", "OK") and p.returncode == (data["status"] == "WARNING")
    # A node without a class: the site file without the class that holds node2 and node3.
    import yaml

    site = yaml.safe_load((REPO / "site.yaml").read_text())
    for nc in site["node_classes"].values():
        if "node" in str(nc.get("nodes", "")):
            nc["nodes"] = "node1"
    narrow = Path(devcluster.state_dir) / "site-narrow.yaml"
    narrow.write_text(yaml.safe_dump(site))
    try:
        q = devcluster.run([sys.executable, "-m", "bluevela", "site", "validate", "--cluster",
                            str(narrow)], check=False, timeout=120)
    finally:
        narrow.unlink()
    assert q.returncode == 2, q.stdout + q.stderr
    assert "CRITICAL: node classes: 2 of 3 nodes in sinfo have no node class" in q.stdout
    assert "node2, node3" in q.stdout
