"""The goodput ledger of real jobs on the REAL dev cluster (issue 18, "Done when").

Three jobs of examples/train_ddp.py that checkpoint every few steps, run through `bv submit`:
one loses a node with `--spare-nodes 1`, one loses a node without a spare (requeued by bv),
one hits its time limit (`-t 2 --signal-before 60`) and is requeued. Each is archived
(`bv archive ingest`) and `bv archive show JOB --goodput --json` must have every phase, the
phases must add up to the job's wall time as Slurm saw it (SubmitTime -> EndTime) within 2 s,
the re-done work must equal the time from the last checkpoint the test saw in the job's output
to the moment the test crashed the node within one step, and the cause must name the crashed
node or the time limit. A node is crashed with `slurm/devcluster crash` (every process of its
namespace SIGKILLed, slurmd included), as tests/test_recovery_cluster.py does.

The supervisor's events go to a directory of this cluster instance (BV_EVENTS_DIR, in the
job's environment and in every node's hook.env): the dev clusters of other developers share
/tmp, their job ids and node names.

Wall time: ~5-7 minutes (the time-limit job alone is 2-3).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hostlist
import pytest

from bluevela.report.goodput import PHASES
from tests.conftest import DEVCLUSTER, REPO, DevCluster
from tests.test_bench_report import CHROMIUM, _chromium, _png_pixels

BANNER = re.compile(r"^==== bv attempt (\d+) job (\d+) nodes (\S+) previous: (.*) ====$", re.M)
CKPT = re.compile(r"^checkpoint step=(\d+) reason=every$", re.M)
STEP_S = 0.4


class Job:
    """A `bv submit --wait` run, its output followed every 0.1 s: when each periodic
    checkpoint line first appeared (wall time), to compare the ledger with."""

    def __init__(self, cluster: DevCluster, cwd: Path, events: Path, *args: str) -> None:
        self.cwd = cwd
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bluevela", "submit", "--wait", *args], cwd=cwd,
            env=cluster.environ(BV_EVENTS_DIR=str(events)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.ckpt_seen: dict[int, float] = {}
        self.submitted: float | None = None  # Slurm's SubmitTime, read in attempt 1
        self.cluster = cluster

    def output(self) -> str:
        files = sorted(self.cwd.glob("bv-*.out"))
        text = files[0].read_text(errors="replace") if files else ""
        now = time.time()
        for m in CKPT.finditer(text):
            self.ckpt_seen.setdefault(int(m.group(1)), now)
        return text

    def wait_for(self, what: str, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output(), re.M):
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended ({self.proc.returncode}) before {what}:\n"
                                     f"{self.proc.stdout.read() if self.proc.stdout else ''}")
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
            time.sleep(0.1)

    def finish(self, timeout: float) -> str:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout:.0f} s") from exc
        assert self.proc.returncode == 0, out
        return out

    def first_attempt(self, timeout: float = 180) -> None:
        self.wait_for("attempt 1", r"^==== bv attempt 1 job", timeout)
        self.submitted = _slurm_time(self.cluster, self.job_id(), "SubmitTime")

    def job_id(self) -> str:
        m = BANNER.search(self.output())
        assert m is not None, self.output()
        return m.group(2)


def _slurm_time(cluster: DevCluster, job_id: str, name: str) -> float:
    """A time of the job as slurmctld has it now (1 s resolution). A requeue (or a shrink)
    moves SubmitTime: the test reads it during the first attempt."""
    line = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return time.mktime(time.strptime(fields[name], "%Y-%m-%dT%H:%M:%S"))


def _ledger(cluster: DevCluster, job_id: str) -> dict[str, Any]:
    for _ in range(60):  # the last epilog's report may land a moment after the job ends
        cluster.bv("archive", "ingest")
        proc = cluster.bv("archive", "show", job_id, "--goodput", "--json", check=False)
        if proc.returncode == 0:
            led = json.loads(proc.stdout)
            if not any("no goodput events" in n for n in led["notes"]) and \
                    led["interruptions"] is not None:
                return led
        time.sleep(1)
    raise AssertionError(f"no ledger for job {job_id}: {proc.stdout} {proc.stderr}")


def _check_sums(cluster: DevCluster, job: Job, led: dict[str, Any]) -> None:
    assert set(led["phases_s"]) == set(PHASES), led["phases_s"]
    assert abs(sum(led["phases_s"].values()) - led["wall_s"]) < 1e-6
    assert job.submitted is not None
    slurm_wall = _slurm_time(cluster, job.job_id(), "EndTime") - job.submitted
    assert abs(led["wall_s"] - slurm_wall) <= 2.0, (led["wall_s"], slurm_wall)
    assert led["phases_s"]["productive"] > 0 and led["phases_s"]["startup"] > 0
    assert led["checkpoints"] >= 2 and led["phases_s"]["checkpoint"] > 0


def _crash_run(cluster: DevCluster, cwd: Path, events: Path, spare: int) -> str:
    ckpt = cwd / "ckpt"
    job = Job(cluster, cwd, events, "-N", "2", "--spare-nodes", str(spare),
              "--procs-per-node", "1", str(REPO / "examples" / "train_ddp.py"),
              "--ckpt-dir", str(ckpt), "--steps", "30", "--step-s", str(STEP_S),
              "--ckpt-every", "4")
    crashed: str | None = None
    try:
        job.first_attempt()
        job.wait_for("step 10 of attempt 1", r"^step=10 attempt=1$", 180)
        first = BANNER.search(job.output())
        assert first is not None
        crashed = hostlist.expand_hostlist(first.group(3))[1]
        job.output()
        last_ckpt = max(job.ckpt_seen)
        cluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        crash_at = time.time()
        job.wait_for("attempt 2", r"^==== bv attempt 2 job", 120)
        cluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
        job.finish(300)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
        if crashed is not None:
            cluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
    job_id = job.job_id()
    led = _ledger(cluster, job_id)
    _check_sums(cluster, job, led)
    (intr,) = led["interruptions"]
    assert intr["kind"] == "lost" and intr["cause"].startswith(f"node failure: {crashed}"), intr
    assert any(e["node"] == crashed and e["history"] == f"bv archive node {crashed}"
               for e in intr["evidence"]), intr
    # The failure is seen within a supervisor tick of the crash (the agent's connection
    # closes with its processes), and what is lost is the work since the last checkpoint.
    assert abs(intr["at"] - crash_at) <= 1.0, (intr["at"], crash_at)
    expected = crash_at - job.ckpt_seen[last_ckpt]
    assert abs(intr["redone_s"] - expected) <= STEP_S + 0.3, (intr["redone_s"], expected)
    assert led["phases_s"]["redone"] == pytest.approx(intr["redone_s"])
    assert led["phases_s"]["detection"] < 1.0
    assert led["phases_s"]["teardown_relaunch"] > 0
    if spare:  # relaunched in the allocation: no requeue hold after the start
        assert led["phases_s"]["queue_hold"] < 10, led["phases_s"]
    else:  # requeued: Slurm's cred_expire hold (20 s in the dev cluster) counts
        assert led["phases_s"]["queue_hold"] >= 15, led["phases_s"]
    return job_id


def _check_fleet(cluster: DevCluster, tmp_path: Path, jobs: dict[str, str]) -> None:
    """`bv report fleet` over the three jobs: each has its ledger row and cause; the page
    shows them, rendered by headless Chromium."""
    page = tmp_path / "fleet.html"
    proc = cluster.bv("report", "fleet", "--since", "2h", "--json", "--html", str(page))
    rep = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    rows = {str(r["job_id"]): r for r in rep["ledger"]["per_job"]}
    for job_id, cause in jobs.items():
        assert job_id in rows, (job_id, sorted(rows))
        row = rows[job_id]
        assert 0 < row["ettr_pct"] < 100
        assert any(i["cause"].startswith(cause) for i in row["interruptions"]), row
        assert row["checkpoint_cost_s"] is not None and row["advice"]["verdict"]
    assert any(k.startswith("node failure") for k in rep["ledger"]["hours_lost_by_cause"])
    assert "time limit" in rep["ledger"]["hours_lost_by_cause"]
    assert rep["goodput"]["jobs_with_ledger"] >= 3
    if not os.path.exists(CHROMIUM):
        return
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.sub(r"<[^>]+>", " ", dom.stdout)
    assert "Where the time went" in body and "ETTR" in body
    for job_id in jobs:
        assert re.search(rf"<td>{job_id}</td>", dom.stdout), job_id
    shot = tmp_path / "shot.png"
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,3000", page.as_uri()], tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    _, _, pixels = _png_pixels(shot.read_bytes())
    assert len(set(pixels)) > 50, "screenshot looks blank"


@pytest.mark.cluster
@pytest.mark.timeout(1200)
def test_goodput_ledger_of_three_real_jobs(devcluster: DevCluster, tmp_path: Path) -> None:
    events = devcluster.state_dir / "goodput-events"
    events.mkdir(mode=0o1777, exist_ok=True)
    for node in devcluster.nodes:
        devcluster.set_hook_env(node, BV_EVENTS_DIR=str(events))
    try:
        devcluster.resume_all()
        devcluster.wait_idle(timeout=120)
        spare_job = _crash_run(devcluster, tmp_path / "spare", events, spare=1)
        devcluster.resume_all()
        devcluster.wait_idle(timeout=120)
        nospare_job = _crash_run(devcluster, tmp_path / "nospare", events, spare=0)
        devcluster.resume_all()
        devcluster.wait_idle(timeout=120)
        # The time limit: 130 steps of 0.5 s cannot fit in one 2-minute attempt whose
        # checkpoint signal comes 60 s (Slurm: up to 120 s) before the end.
        job = Job(devcluster, tmp_path / "limit", events, "-t", "2", "--signal-before", "60",
                  "-N", "1", "--procs-per-node", "1", str(REPO / "examples" / "train_ddp.py"),
                  "--ckpt-dir", str(tmp_path / "limit" / "ckpt"), "--steps", "130",
                  "--step-s", "0.5", "--ckpt-every", "8")
        job.first_attempt()
        job.finish(600)
        led = _ledger(devcluster, job.job_id())
        _check_sums(devcluster, job, led)
        limits = [i for i in led["interruptions"] if i["kind"] == "signal"]
        assert limits and all(i["cause"] == "time limit" for i in limits), led["interruptions"]
        # The workers saved on the signal: at most the step in flight is lost.
        assert all(i["redone_s"] <= 0.5 + 0.3 for i in limits), limits
        assert led["phases_s"]["queue_hold"] >= 15 * len(limits), led["phases_s"]
        _check_fleet(devcluster, tmp_path, {spare_job: "node failure", nospare_job:
                                            "node failure", job.job_id(): "time limit"})
    finally:
        for node in devcluster.nodes:
            devcluster.set_hook_env(node, BV_EVENTS_DIR="")
