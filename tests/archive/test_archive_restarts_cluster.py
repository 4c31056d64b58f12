"""A real Slurm requeue on the dev cluster: both attempts' reports reach the archive.

Slurm keeps the job id over a requeue and tells the hooks SLURM_JOB_RESTART_COUNT (already
the next attempt's in the epilog of the attempt the requeue ends). Before the reports carried
it, attempt 1's prolog/epilog reports had the same spool names as attempt 0's
(replacing them, or dropped at ingest as duplicates), so the archive kept one attempt. The
requeued job waits out `cred_expire` (20 s on the dev cluster) before it runs again: ~35 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import DevCluster

pytestmark = [pytest.mark.cluster]

# Attempt 0 sleeps until requeued; attempt 1 (SLURM_RESTART_COUNT=1) ends at once.
SCRIPT = '#!/bin/sh\nif [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 300; fi\n'


def _job(c: DevCluster, job: int) -> dict[str, str]:
    out = c.run(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _wait(c: DevCluster, job: int, what: str, ok: object, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = _job(c, job)
        if ok(info):  # type: ignore[operator]
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job}: not {what} after {timeout} s: {info}")


@pytest.mark.timeout(300)
def test_requeued_job_keeps_both_attempts_in_the_archive(devcluster: DevCluster,
                                                         tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    since = time.time() - 1
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    out = devcluster.run(["sbatch", "--parsable", "--requeue", "-N", "2", "-o",
                          str(tmp_path / "out-%j.txt"), str(script)], cwd=tmp_path).stdout
    job = int(out.strip().split(";")[0])
    _wait(devcluster, job, "running", lambda i: i.get("JobState") == "RUNNING", 60)
    devcluster.run(["scontrol", "requeue", str(job)])
    info = _wait(devcluster, job, "completed after a restart",
                 lambda i: i.get("JobState") == "COMPLETED", 180)
    assert info["Restarts"] == "1", info
    # A fresh archive (the cluster's may hold other sessions' files); wait for the last
    # attempt's epilogs as EpilogSlurmctld would.
    archive = tmp_path / "archive"
    archive.mkdir()
    arch = ("archive", "--archive-dir", str(archive))
    ing = json.loads(devcluster.bv(*arch, "ingest", "--job", str(job), "--wait", "60",
                                   "--json", timeout=120).stdout)
    assert ing["jobs_archived"] == [job] and not ing["quarantined"], ing
    assert ing["reports_ingested"] == 8, ing  # 2 nodes x prolog/epilog x 2 attempts
    shown = json.loads(devcluster.bv(*arch, "show", str(job), "--json").stdout)
    assert shown["restarts"] == 1 and shown["exit_code"] == 0, shown
    attempts = shown["attempts"]
    assert [a["restart"] for a in attempts] == [0, 1], attempts
    for a in attempts:
        assert a["first_prolog_unix_s"] is not None and a["last_epilog_unix_s"] is not None, a
    assert attempts[0]["last_epilog_unix_s"] <= attempts[1]["first_prolog_unix_s"], attempts
    # Slurm counts the requeue before attempt 0's epilog runs (its SLURM_JOB_RESTART_COUNT is
    # 1): the epilog takes its attempt from its own prolog, so it is not attempt 1's.
    epilogs = [n["epilog"] for n in shown["nodes"]] + [e["epilog"] for n in shown["nodes"]
                                                        for e in n["earlier"]]
    assert sorted(e["restart"] for e in epilogs) == [0, 0, 1, 1], epilogs
    assert attempts[1]["exit_code"] == 0, attempts
    text = devcluster.bv(*arch, "show", str(job)).stdout
    assert "requeued 1 time(s)" in text and "\n1\tnode[1-2]\t" in text, text
    rep = json.loads(devcluster.bv("report", "fleet", "--archive-dir", str(archive),
                                   "--since", str(since), "--json").stdout)
    req = rep["requeues"]
    assert (req["jobs_requeued"], req["requeues"], req["jobs_exact"], req["attempts"]) == \
        (1, 1, 1, 2), req
    assert req["by_cause"] == {"requeue": 1}, req
    assert req["requeue_gap_h"] > 0, req
