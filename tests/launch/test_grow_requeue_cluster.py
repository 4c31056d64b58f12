"""A grow, then a requeue, on the REAL dev cluster (issue 33 section 4).

A 2-node DDP job loses its second node (`slurm/devcluster crash`), the supervisor grows the
same job by node3 (site.yaml launch.grow_deadline_s) and relaunches on node1 and node3
(node3 keeps the copy of the goodput events); then `bv requeue` checkpoints and requeues it,
and it ends in its next Slurm attempt. node3 ran no prolog of the job in attempt 0, and its
epilog there runs with SLURM_JOB_RESTART_COUNT already 1: the epilog must file it under
restart 0 from Slurm's record (bluevela/slurm/job_record.py) and collect the keeper's copy,
and the ingest must archive every report with no duplicate or conflict.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import DEVCLUSTER, DevCluster
from tests.launch.test_grow_cluster import (
    ready_to_grow,
    second_node_at_step_9,
    stop_and_revive,
    submit_ddp,
)
from tests.launch.test_recovery_cluster import _finish, _output, _wait_for

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(900)
def test_a_grown_nodes_epilog_after_a_requeue_is_its_attempts(devcluster: DevCluster,
                                                               tmp_path: Path) -> None:
    site = ready_to_grow(devcluster, tmp_path)
    workdir = tmp_path / "job"
    proc = submit_ddp(devcluster, workdir, site, steps=60)
    crashed: str | None = None
    try:
        job, crashed = second_node_at_step_9(workdir, proc)
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        # attempt 2 runs on the grown node; then bv's requeue (checkpoint, Slurm requeue)
        _wait_for("progress of attempt 2", lambda: re.search(
            r"^step=\d+ attempt=2$", _output(workdir), re.M), 150, proc)
        text = _output(workdir)
        m = re.search(r"\(grown (\S+) in [\d.]+ s, same job, no Slurm requeue\)", text)
        assert m is not None, text
        grown = m.group(1)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
        crashed = None
        devcluster.bv("requeue", job)
        out = _finish(proc, 400)
        assert proc.returncode == 0, out
    finally:
        stop_and_revive(devcluster, proc, crashed)
    show = devcluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=1" in show, show

    archive = tmp_path / "archive"
    archive.mkdir()
    arch = ("archive", "--archive-dir", str(archive))
    ing = json.loads(devcluster.bv(*arch, "ingest", "--job", job, "--wait", "60",
                                   "--timeout-min", "0", "--json", timeout=120).stdout)
    assert ing["duplicates"] == 0 and ing["conflicts"] == [] and not ing["quarantined"], ing
    shown = json.loads(devcluster.bv(*arch, "show", job, "--json").stdout)
    (n3,) = [n for n in shown["nodes"] if n["node"] == grown]
    epilogs = {e["restart"]: e for e in
               [n3["epilog"], *(x["epilog"] for x in n3.get("earlier") or [])] if e is not None}
    assert 0 in epilogs, n3  # before: filed under restart 1
    mine = epilogs[0]
    assert mine["slurm_job"]["requeued"] is True and mine["slurm_job"]["restarts"] == 1, mine
    # the keeper's copy of attempt 0's events (node3 was the relaunch's second node)
    rec = mine.get("goodput_events")
    assert rec is not None and rec["restart"] == 0 and rec["copy_on"] == grown, mine
    assert [g["nodes"] for g in rec["grows"]] == [[grown]], rec
    led = json.loads(devcluster.bv(*arch, "show", job, "--goodput", "--json").stdout)
    assert led["phases_s"]["queue_hold"] < 120, led  # from Slurm's submit time
