"""The goodput ledger checks of real jobs on the REAL dev cluster (issue 18, "Done when"),
shared by the scenario tests that run those jobs once: tests/launch/test_recovery_cluster.py (a node
crashed with and without a spare) and tests/launch/test_resilience_submit_cluster.py (a time limit).

`bv archive show JOB --goodput --json` must have every phase, the phases must add up to the
job's wall time as Slurm saw it (SubmitTime -> EndTime) within 2 s, the re-done work must
equal the time from the last checkpoint the test saw in the job's output to the moment the
test crashed the node within one step, and the cause must name the crashed node or the time
limit; `bv report fleet` shows the job's ledger row (its page rendered by headless Chromium).

The supervisor's events go to a directory of this cluster instance (BV_EVENTS_DIR, in the
job's environment and in every node's hook.env): the dev clusters of other developers share
/tmp, their job ids and node names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bluevela.report.fleet_html import MAX_LEDGER_JOBS
from bluevela.report.goodput import PHASES
from tests.bench.test_bench_report import CHROMIUM, _chromium, _png_pixels
from tests.conftest import DevCluster

BANNER = re.compile(r"^==== bv attempt (\d+) job (\d+) nodes (\S+) previous: (.*) ====$", re.M)
CKPT = re.compile(r"^checkpoint step=(\d+) reason=every$", re.M)


@contextmanager
def goodput_events(cluster: DevCluster) -> Iterator[Path]:
    """The events directory of this cluster instance, in every node's hook.env meanwhile."""
    events = cluster.state_dir / "goodput-events"
    events.mkdir(mode=0o1777, exist_ok=True)
    for node in cluster.nodes:
        cluster.set_hook_env(node, BV_EVENTS_DIR=str(events))
    try:
        yield events
    finally:
        for node in cluster.nodes:
            cluster.set_hook_env(node, BV_EVENTS_DIR="")


class Job:
    """A `bv submit --wait` run, its output followed every 0.1 s: when each periodic
    checkpoint line first appeared (wall time), to compare the ledger with."""

    def __init__(self, cluster: DevCluster, cwd: Path, events: Path, *args: str) -> None:
        self.cwd = cwd
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bluevela", "submit", "--wait", *args], cwd=cwd,
            env=cluster.environ(BV_EVENTS_DIR=str(events)), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
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
                out, err = self.proc.communicate()
                raise AssertionError(f"job ended ({self.proc.returncode}) before {what}:\n"
                                     f"{out}{err}")
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
            time.sleep(0.1)

    def finish(self, timeout: float) -> tuple[str, str]:
        """`bv submit --wait`'s stdout and stderr once it has ended (the caller checks its
        exit status, self.proc.returncode)."""
        try:
            return self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"still running after {timeout:.0f} s:\n{out}{err}") from exc

    def first_attempt(self, timeout: float = 180) -> None:
        self.wait_for("attempt 1", r"^==== bv attempt 1 job", timeout)
        self.submitted = slurm_time(self.cluster, self.job_id(), "SubmitTime")

    def job_id(self) -> str:
        m = BANNER.search(self.output())
        assert m is not None, self.output()
        return m.group(2)


def slurm_time(cluster: DevCluster, job_id: str, name: str) -> float:
    """A time of the job as slurmctld has it now (1 s resolution). A requeue (or a shrink)
    moves SubmitTime: the test reads it during the first attempt."""
    line = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return time.mktime(time.strptime(fields[name], "%Y-%m-%dT%H:%M:%S"))


def ledger(cluster: DevCluster, job_id: str) -> dict[str, Any]:
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


def check_sums(cluster: DevCluster, job: Job, led: dict[str, Any]) -> None:
    assert set(led["phases_s"]) == set(PHASES), led["phases_s"]
    assert abs(sum(led["phases_s"].values()) - led["wall_s"]) < 1e-6
    assert job.submitted is not None
    slurm_wall = slurm_time(cluster, job.job_id(), "EndTime") - job.submitted
    assert abs(led["wall_s"] - slurm_wall) <= 2.0, (led["wall_s"], slurm_wall)
    assert led["phases_s"]["productive"] > 0 and led["phases_s"]["startup"] > 0
    assert led["checkpoints"] >= 2 and led["phases_s"]["checkpoint"] > 0


def check_crash_ledger(cluster: DevCluster, job: Job, *, crashed: str,
                       crash: tuple[float, float], resumed_from: int, step_s: float,
                       spare: int) -> None:
    """The ledger of a job that lost node `crashed` while `devcluster crash` ran (`crash`: the
    wall time before it started and after it returned; the kill is somewhere inside, after the
    command's start-up) and resumed from checkpoint `resumed_from`."""
    led = ledger(cluster, job.job_id())
    check_sums(cluster, job, led)
    (intr,) = led["interruptions"]
    assert intr["kind"] == "lost" and intr["cause"].startswith(f"node failure: {crashed}"), intr
    assert any(e["node"] == crashed and e["history"] == f"bv archive node {crashed}"
               for e in intr["evidence"]), intr
    # The failure is seen within a supervisor tick of the crash (the agent's connection
    # closes with its processes) ...
    before, after = crash
    assert before - 0.1 <= intr["at"] <= after + 1.0, (intr["at"], crash)
    # ... and what is lost is the work from the end of the checkpoint the next attempt resumed
    # from to that failure. The test saw that checkpoint's line at most a poll and the output's
    # flush (step_s + 0.3 s) after the save ended; a line seen only after the crash command
    # returned was written while it ran, after `before`.
    assert resumed_from in job.ckpt_seen, (resumed_from, job.ckpt_seen)
    seen = job.ckpt_seen[resumed_from]
    earliest = seen - (step_s + 0.3) if seen <= before else before - (step_s + 0.3)
    low, high = intr["at"] - seen - 0.05, intr["at"] - earliest
    assert low <= intr["redone_s"] <= high, (intr["redone_s"], low, high)
    assert led["phases_s"]["redone"] == pytest.approx(intr["redone_s"])
    assert led["phases_s"]["detection"] < 1.0
    assert led["phases_s"]["teardown_relaunch"] > 0
    if spare:  # relaunched in the allocation: no requeue hold after the start
        assert led["phases_s"]["queue_hold"] < 10, led["phases_s"]
    else:  # requeued: Slurm's cred_expire hold (20 s in the dev cluster) counts
        assert led["phases_s"]["queue_hold"] >= 15, led["phases_s"]


def check_batch_crash_ledger(cluster: DevCluster, job: Job, *, batch: str,
                             crash: tuple[float, float]) -> dict[str, Any]:
    """The ledger of a job whose batch node (the supervisor's) died while `devcluster crash` ran
    (`crash`: the wall time before it and after it): the attempt is known from the copy of its
    events a second node kept (issue 28), and its interruption names the batch node, not "no
    supervisor record"."""
    led = ledger(cluster, job.job_id())
    assert set(led["phases_s"]) == set(PHASES), led["phases_s"]
    assert abs(sum(led["phases_s"].values()) - led["wall_s"]) < 1e-6
    causes = [i["cause"] for i in led["interruptions"]]
    assert not any("no supervisor record" in c for c in causes), led
    (intr,) = led["interruptions"]
    assert intr["kind"] == "lost" and intr["nodes"] == [batch], intr
    assert intr["cause"].startswith(f"node failure: {batch} (the batch node: the supervisor "
                                    "died with it)"), intr
    assert "the copy on node" in intr["detail"], intr
    # the keeper saw the supervisor's connection end within a tick or two of the crash
    assert crash[0] - 0.1 <= intr["at"] <= crash[1] + 2.0, (intr["at"], crash)
    assert led["phases_s"]["checkpoint"] > 0 and led["phases_s"]["productive"] > 0
    assert led["phases_s"]["unattributed"] < 1.0, led["phases_s"]
    # Slurm's noticing the dead node (SlurmdTimeout) is the detection; then the requeue hold
    assert led["phases_s"]["detection"] > 5 and led["phases_s"]["queue_hold"] >= 15, \
        led["phases_s"]
    return led


def check_time_limit_ledger(cluster: DevCluster, job: Job, *, step_s: float) -> None:
    """The ledger of a job requeued at its time limit (checkpoint signal)."""
    led = ledger(cluster, job.job_id())
    check_sums(cluster, job, led)
    limits = [i for i in led["interruptions"] if i["kind"] == "signal"]
    assert limits and all(i["cause"] == "time limit" for i in limits), led["interruptions"]
    # The workers saved on the signal: at most the step in flight is lost.
    assert all(i["redone_s"] <= step_s + 0.3 for i in limits), limits
    assert led["phases_s"]["queue_hold"] >= 15 * len(limits), led["phases_s"]


def check_fleet(cluster: DevCluster, tmp_path: Path, jobs: dict[str, str], *,
                page: bool = True) -> None:
    """`bv report fleet` over these jobs (id -> the cause it must show): each has its
    ledger row and cause; with `page`, the page shows them, rendered by headless Chromium."""
    html = tmp_path / "fleet.html"
    proc = cluster.bv("report", "fleet", "--since", "2h", "--json", "--html", str(html))
    rep = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    rows = {str(r["job_id"]): r for r in rep["ledger"]["per_job"]}
    for job_id, cause in jobs.items():
        assert job_id in rows, (job_id, sorted(rows))
        row = rows[job_id]
        assert 0 < row["ettr_pct"] < 100
        assert any(i["cause"].startswith(cause) for i in row["interruptions"]), row
        assert row["checkpoint_cost_s"] is not None and row["advice"]["verdict"]
    lost = rep["ledger"]["hours_lost_by_cause"]
    if "node failure" in jobs.values():
        assert any(k.startswith("node failure") for k in lost), lost
    if "time limit" in jobs.values():
        assert "time limit" in lost, lost
    assert rep["goodput"]["jobs_with_ledger"] >= len(jobs)
    if not page or not os.path.exists(CHROMIUM):
        return
    dom = _chromium(["--dump-dom", html.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.sub(r"<[^>]+>", " ", dom.stdout)
    assert "Where the time went" in body and "ETTR" in body
    # The page's per-job table holds the jobs with the lowest ETTR (the suite's archive holds
    # every job of the session): a job beyond them is named as cut, with where to find it.
    worst = sorted(rep["ledger"]["per_job"], key=lambda r: (r["ettr_pct"] or 0.0, r["job_id"]))
    shown = {str(r["job_id"]) for r in worst[:MAX_LEDGER_JOBS]}
    for job_id in jobs:
        if job_id in shown:
            assert re.search(rf"<td>{job_id}</td>", dom.stdout), job_id
        else:
            assert f"The {MAX_LEDGER_JOBS} jobs with the lowest ETTR of {len(worst)}" in body
    shot = tmp_path / "shot.png"
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,3000", html.as_uri()],
                    tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    _, _, pixels = _png_pixels(shot.read_bytes())
    assert len(set(pixels)) > 50, "screenshot looks blank"
