"""Checkpoint signal, requeue and resume through `bv submit`, on the REAL dev cluster.

One time-limit job (`-t 2`, Slurm's smallest useful limit, `--signal-before 60`) whose work
needs more than one attempt, and one operator `scontrol requeue`. Both run the example with
`--ckpt-dir` and are followed with `bv submit --wait`; both rely on the in-job supervisor
(bluevela/launch/supervisor.py) to forward the signal to every torchrun worker and requeue.
The time-limit test costs ~2-4 minutes of wall time (one job), and checks that job's goodput
ledger and fleet report too (tests/goodput_checks.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bluevela.launch.attempts import split_attempts
from bluevela.slurm.cli_client import CliSlurmClient, fold_history
from tests.conftest import REPO, DevCluster
from tests.goodput_checks import Job, check_fleet, check_time_limit_ledger, goodput_events

pytestmark = [pytest.mark.cluster]
EXAMPLE = str(REPO / "examples" / "train_ddp.py")
CKPT_EVERY = 5
STEP_S = 0.5


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step=(\d+) attempt=\d+$", text, re.M)]


def _resumed(text: str) -> set[int]:
    return {int(s) for s in re.findall(r"^rank=\d+ attempt=\d+ resumed_from_step=(\d+)$", text, re.M)}


def _check_resumes(out: str, *, total: int, reason: str) -> list[str]:
    """Every attempt resumes from the previous one's checkpoint, redoing at most one
    checkpoint interval; the request checkpoint names the signal. Returns the attempts' texts."""
    parts = split_attempts(out)
    assert len(parts) >= 2, out
    done_before = 0
    for i, part in enumerate(parts):
        resumed = _resumed(part.text)
        assert len(resumed) == 1, (i, part.text)  # every rank resumed from the same step
        start = resumed.pop()
        if i == 0:
            assert start == 0
        else:
            assert start <= done_before, (start, done_before)
            assert done_before - start <= CKPT_EVERY, (start, done_before)  # redone steps
        steps = _steps(part.text)
        assert steps and steps[0] == start + 1, (i, steps[:3], start)
        done_before = steps[-1]
        if i < len(parts) - 1:
            assert re.search(rf"^checkpoint step={done_before} reason={reason}$", part.text,
                             re.M), part.text
            assert "stopping for requeue" in part.text
    assert done_before == total
    assert re.search(r"^initial_loss=[0-9.]+ final_loss=[0-9.]+$", parts[-1].text, re.M)
    return [p.text for p in parts]


@pytest.mark.timeout(900)
def test_time_limit_signal_checkpoint_requeue_finish(
    devcluster: DevCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-t 2 --signal-before 60, 65 s of steps: SIGUSR1 reaches the workers on both nodes,
    they checkpoint, bv requeues, the next attempt resumes; --wait exits 0 at the end. Then
    the job's goodput ledger: each requeue's cause is the time limit, little work redone."""
    ckpt = tmp_path / "ckpt"
    # 0.5 s each: 65 s of work, more than one attempt can do whatever the timing: the signal
    # comes at the latest 60 s before the 2-minute limit (Slurm may send it up to ~60 s
    # earlier still), so an attempt has at most 60 s minus its start-up. 100 steps (50 s)
    # sometimes finished in one attempt on a quiet machine.
    total = 130
    with goodput_events(devcluster) as events:
        run = Job(devcluster, tmp_path, events, "--json", "-t", "2", "--signal-before", "60",
                  "-N", "2", "--procs-per-node", "1", EXAMPLE, "--steps", str(total),
                  "--ckpt-dir", str(ckpt), "--ckpt-every", str(CKPT_EVERY),
                  "--step-s", str(STEP_S))
        try:
            run.first_attempt()
            stdout, stderr = run.finish(900)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
        proc = subprocess.CompletedProcess(run.proc.args, run.proc.returncode, stdout, stderr)
        _check_time_limit_job(devcluster, tmp_path, monkeypatch, proc, total)
        # The goodput ledger of the same job (tests/goodput_checks.py), and the fleet
        # report over it, its page rendered by headless Chromium.
        check_time_limit_ledger(devcluster, run, step_s=STEP_S)
        check_fleet(devcluster, tmp_path, {run.job_id(): "time limit"})


def _check_time_limit_job(devcluster: DevCluster, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch,
                          proc: subprocess.CompletedProcess[str], total: int) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    info = json.loads(proc.stdout)
    job = info["job_id"]
    out = (tmp_path / f"bv-{job}.out").read_text()
    assert proc.returncode == 0, (proc.stderr, out)
    assert info["state"] == "COMPLETED" and info["wait_exit_status"] == 0
    assert info["restarts"] >= 1, info
    texts = _check_resumes(out, total=total, reason="SIGUSR1")
    # Each attempt's end names the signal; Slurm recorded the requeued attempts.
    assert "checkpoint signal SIGUSR1 from Slurm" in texts[0]
    assert [a["state"] for a in info["attempts"]][-1] == "COMPLETED"
    assert all(a["state"] == "REQUEUED" for a in info["attempts"][:-1]), info["attempts"]
    # --wait printed every attempt.
    for n in range(1, info["restarts"] + 2):
        assert f"job {job}: attempt {n}" in proc.stderr, proc.stderr

    # bv logs --attempt N is exactly that attempt's slice.
    for n, text in enumerate(texts, start=1):
        got = devcluster.bv("logs", str(job), "--attempt", str(n)).stdout
        assert got == text
    bad = devcluster.bv("logs", str(job), "--attempt", str(len(texts) + 1), check=False)
    assert bad.returncode == 1 and "no attempt" in bad.stderr and "Traceback" not in bad.stderr

    # bv status: restart count, each restart's cause, the LAST attempt's state.
    st = json.loads(devcluster.bv("status", str(job), "--json").stdout)
    assert st["state"] == "COMPLETED" and st["restarts"] == info["restarts"]
    assert "SIGUSR1" in st["attempts"][0]["cause"], st["attempts"]
    table = devcluster.bv("status", str(job)).stdout
    rows = [ln.split("\t") for ln in table.splitlines()]  # not a terminal: tab-separated
    assert rows[0][:4] == ["JOBID", "STATE", "EXIT", "RESTARTS"]
    assert rows[1][:4] == [str(job), "COMPLETED", "0", str(info["restarts"])]
    attempts = [r for r in rows if len(r) == 5 and r[0] == str(job)]
    assert [r[2] for r in attempts] == ["REQUEUED"] * info["restarts"] + ["COMPLETED"], rows
    assert "SIGUSR1" in attempts[0][4]
    # Once the job has left slurmctld only the completion records remain: the last one wins.
    for key, value in devcluster.env.items():
        monkeypatch.setenv(key, value)
    records = CliSlurmClient(retry_s=0)._sacct([job])
    assert len(records) == info["restarts"] + 1, records
    gone = fold_history(records)
    assert gone is not None and gone.state_name == "COMPLETED"
    assert gone.restarts == info["restarts"]


def _wait_for(path: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and re.search(pattern, path.read_text(), re.M)):
        assert time.monotonic() < deadline, f"no {pattern!r} in {path}"
        time.sleep(0.5)


def test_operator_requeues_checkpoint_first(devcluster: DevCluster, tmp_path: Path) -> None:
    """An operator requeues a training job twice: `bv requeue` (SIGUSR1 to the supervisor,
    the time-limit path), then plain `scontrol requeue` (Slurm's SIGTERM to every process,
    SIGKILL after KillWait). Both times every worker checkpoints before the attempt ends, the
    next attempt resumes from it, and `bv submit --wait` follows to the end and exits 0."""
    ckpt = tmp_path / "ckpt"
    total = 60
    wait = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "--json", "-N", "2",
         "--procs-per-node", "1", EXAMPLE, "--steps", str(total), "--ckpt-dir", str(ckpt),
         "--ckpt-every", str(CKPT_EVERY), "--step-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=devcluster.environ())
    try:
        assert wait.stderr is not None
        first = wait.stderr.readline()
        m = re.search(r"job (\d+):", first)  # --json: the first progress line names it
        assert m, first
        job = int(m.group(1))
        out_file = tmp_path / f"bv-{job}.out"
        _wait_for(out_file, r"^step=8 attempt=1$")
        got = devcluster.bv("requeue", str(job))
        assert f"job {job}: checkpoint requested" in got.stdout
        _wait_for(out_file, r"^step=\d+ attempt=2$")
        resumed2 = max(_resumed(split_attempts(out_file.read_text())[1].text))
        _wait_for(out_file, rf"^step={resumed2 + 4} attempt=2$")
        devcluster.run(["scontrol", "requeue", str(job)])
        stdout, stderr = wait.communicate(timeout=400)
    finally:
        if wait.poll() is None:
            wait.kill()
    out = out_file.read_text()
    assert wait.returncode == 0, (first + stderr, out)
    info = json.loads(stdout)
    assert info["state"] == "COMPLETED" and info["restarts"] == 2
    texts = _check_resumes(out, total=total, reason="(SIGTERM|SIGUSR1)")
    assert len(texts) == 3
    assert re.search(r"^checkpoint step=\d+ reason=SIGUSR1$", texts[0], re.M)
    assert "checkpoint signal SIGUSR1 from Slurm, workers exited 0, requeued by bv" in texts[0]
    # Slurm's SIGTERM and the supervisor's forwarded SIGUSR1 race to the workers: either asks.
    assert re.search(r"^checkpoint step=\d+ reason=(SIGTERM|SIGUSR1)$", texts[1], re.M)
    assert "ended: SIGTERM from Slurm" in texts[1]
    # The checkpoints were taken on request, after the requeue, not just the periodic ones.
    assert max(_resumed(texts[1])) >= 8 and max(_resumed(texts[2])) >= resumed2 + 4
    # A job that is not running cannot be asked: one line, no traceback.
    bad = devcluster.bv("requeue", str(job), check=False)
    assert bad.returncode == 1 and "not RUNNING" in bad.stderr and "Traceback" not in bad.stderr


def test_real_sbatch_takes_the_new_options(devcluster: DevCluster, tmp_path: Path) -> None:
    """The rendered header as real sbatch/slurmctld read it (held, never runs)."""
    proc = devcluster.bv(
        "submit", "--json", "--hold", "-t", "5", "--signal-before", "60", "-c", "1",
        "--mem", "100M", "--exclusive", "-x", "node3", "-d", "singleton",
        "--sbatch-arg=--nice=7", "--sbatch-arg=--begin=now+3600",
        "--sbatch-arg=--mail-type=END", "--sbatch-arg=--mail-user=it's a b@x", EXAMPLE,
        cwd=tmp_path)
    job = json.loads(proc.stdout)["job_id"]
    try:
        show = devcluster.run(["scontrol", "show", "job", "-o", str(job)]).stdout
    finally:
        devcluster.run(["scancel", str(job)], check=False)
    fields = dict(w.split("=", 1) for w in show.split() if "=" in w)
    assert fields["TimeLimit"] == "00:05:00" and fields["Requeue"] == "1"
    assert fields["Nice"] == "7" and fields["ExcNodeList"] == "node3"
    assert fields["Dependency"].startswith("singleton") and fields["MinMemoryNode"] == "100M"
    assert fields["OverSubscribe"] == "NO"  # --exclusive
    assert "MailUser=it's a b@x" in show
