"""Bring your own script, on the REAL dev cluster: plain Lightning, HF Trainer and Accelerate
scripts (examples/byos/) through `bv submit --wait` with a hot spare, at Slurm's REAL time limit.

One job per framework, scenarios combined: 2 training nodes + 1 spare (the allocation is 3
nodes, the training world 2), `-t 2 --signal-before 60`. Slurm itself sends the
`--signal=B:USR1@60` that bv submit sets. When: slurmctld checks time limits on a 30 s timer
and signals at its first check within warn + 30 s of the end, so 30-60 s into each 2-minute
allocation, with 60-90 s left (a bare `sbatch -t 2 --signal=B:USR1@60` on the dev cluster: 42,
49, 57 s). At each signal the ranks agree, save in the framework's own format and exit 0; bv
requeues; the next attempt starts at the step the last one stopped at (0 steps lost).

The first two attempts end at Slurm's time limit: the job trains more steps (STEPS) than two
2-minute allocations can hold. How many a job needs to finish after that is up to Slurm's
timer and the ranks' start-up (10-40 s on this machine), 1 to 6 more allocations of ~50 s; so
once two attempts ended at the limit the test lengthens the job's limit to LAST_LIMIT_MIN
(`scontrol update TimeLimit`, an operator's move) and the next allocation trains to the end.
The Accelerate and Lightning jobs then take one operator `bv requeue` (`scancel --batch
--signal=USR1`: the same SIGUSR1 path, at a moment the test picks, far from the limit) once
their ranks train (Lightning's, once its ranks trained 30 steps: past its script's own
`every_n_train_steps=25` save, so its `fit(ckpt_path="last")` must find bv's newer one); that
attempt is not counted among Slurm's, and it too must lose 0 steps. Then, in the next attempt
that trains (the last allocation: none comes after it on the revived node), a training node
crashes (`devcluster crash`): the step is relaunched on the spare in the same allocation within
10 s and resumes from the framework's checkpoint of the last signal (or the script's own later
one).

Every rank of every attempt prints the Slurm names it sees: they describe the training step
(2 nodes, its node list, its task count, its own rank), not the 3-node allocation. No attempt
but the crashed one logs a traceback, torchrun's own included (its end-of-step race on the
rendezvous store is closed by bluevela/launch/rdzv_guard.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import hostlist
import pytest

from bluevela.launch.attempts import split_attempts
from tests.conftest import REPO, DevCluster

pytestmark = [pytest.mark.cluster]
EXAMPLES = REPO / "examples" / "byos"
DEVCLUSTER = REPO / "slurm" / "devcluster"
BANNER = re.compile(r"^==== bv attempt (\d+) job (\S+) nodes (\S+) previous: (.*) ====$", re.M)
# Steps of 0.3 s: more than two 2-minute allocations can train (each at most ~53 s, ~165
# steps: Slurm's signal at most 60 s after the start, the ranks' start-up at least 7 s), so
# the job cannot end before its second time limit (the most seen in two: 247).
STEPS = 400
STEP_S = 0.3


@dataclasses.dataclass(frozen=True)
class Framework:
    module: str  # to find
    script: str
    dir_opt: str  # its directory option
    operator_requeue: bool = False  # one interruption through `bv requeue` besides Slurm's
    # The script's own periodic checkpoint (steps), which its resume also finds: after the
    # crash it resumes from the newer of that and the last signal's. The operator's requeue
    # then comes once the attempt trained past one of them (every + 5 steps), so the signal's
    # stop is at a step the script's own newest checkpoint is older than (issue 33).
    every: int = 0


FRAMEWORKS = {
    # Lightning's documented resume: ModelCheckpoint(save_last=True, every_n_train_steps=25)
    # and fit(ckpt_path="last") (issue 33: "last" was the callback's older last.ckpt).
    "lightning": Framework("lightning", "lightning_ddp.py", "--root", operator_requeue=True,
                           every=25),
    "hf": Framework("transformers", "hf_trainer.py", "--out"),
    "accelerate": Framework("accelerate", "accelerate_loop.py", "--dir",
                            operator_requeue=True),
}
PROCS = 1  # ranks per node
# Slurm's time limit: the signal 30-60 s into each allocation, 60-90 s before its end. The
# agents hold it for a rank still starting (Lightning's import alone takes 15-35 s here) for
# 60 s instead of the 15-45 s the time left would give (docs/byos.md).
LIMIT = ("-t", "2", "--signal-before", "60", "--env", "BV_USR1_WAIT_S=60")
# Once two attempts ended at the limit, the job's limit becomes 6 minutes (`scontrol update`,
# an operator's move): the steps left then take one more allocation, not 1-6 more of 2 minutes.
LAST_LIMIT_MIN = 6
SIGNAL_SEEN = "bv supervisor: SIGUSR1 received"
AT_LIMIT = re.compile(r"SIGUSR1 received: asking every worker to checkpoint \(the time limit "
                      r"in (\d+) s\)")
SIGNAL_END = "checkpoint signal SIGUSR1 from Slurm, workers exited 0, requeued by bv"


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step=(\d+)$", text, re.M)]


def _starts(text: str) -> dict[int, dict[str, str]]:
    """rank -> what it printed at the start of training (start_step, world_size, SLURM_*)."""
    out: dict[int, dict[str, str]] = {}
    for line in re.findall(r"^(rank=\d+ start_step=.*)$", text, re.M):
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        out[int(fields["rank"])] = fields
    return out


class Watch:
    """The job's output file, read as it grows; each line's first sight is timed."""

    def __init__(self, path_of: Path, proc: subprocess.Popen[bytes]) -> None:
        self.dir, self.proc = path_of, proc
        self.started = time.monotonic()
        self.seen: list[tuple[float, str]] = []  # (seconds since submit, line)
        self._text = ""

    def text(self) -> str:
        files = list(self.dir.glob("bv-*.out"))
        text = files[0].read_text(errors="replace") if files else ""
        if len(text) > len(self._text):
            now = time.monotonic() - self.started
            done = self._text.count("\n")
            self.seen += [(now, line) for line in text.split("\n")[done:-1]]
            self._text = text
        return text

    def until(self, what: str, test: object, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            if callable(test) and test(self.text()):
                return time.monotonic()
            assert self.proc.poll() is None, (f"bv submit --wait ended before {what}",
                                              self.timeline(), self.text())
            assert time.monotonic() < deadline, (f"no {what} in {timeout:.0f} s",
                                                 self.timeline(), self.text())
            time.sleep(0.2)

    def timeline(self) -> list[str]:
        """Per attempt, seconds since submit: its banner, first rank line, first step, signal,
        end line, and the steps it trained."""
        out: list[str] = []
        row: dict[str, object] = {}

        def close() -> None:
            if row:
                out.append(" ".join(f"{k}={v}" for k, v in row.items()))

        for at, line in self.seen:
            if (m := BANNER.match(line)) is not None:
                close()
                row = {"attempt": m.group(1), "banner": f"{at:.0f}"}
            elif line.startswith("rank=") and "rank" not in row:
                row["rank"] = f"{at:.0f}"
            elif (m := re.match(r"step=(\d+)$", line)) is not None:
                row.setdefault("step1", f"{at:.0f}")
                row.setdefault("from", m.group(1))
                row["to"] = m.group(1)
            elif SIGNAL_SEEN in line:
                row["signal"] = f"{at:.0f}" + ("".join(f"(left {m.group(1)})" for m in
                                                       [AT_LIMIT.search(line)] if m))
            elif line.startswith("==== bv attempt ") and " ended: " in line:
                row["end"] = f"{at:.0f}"
        close()
        return out


def _attempt(text: str, n: int) -> str:
    parts = split_attempts(text)
    return parts[n - 1].text if len(parts) >= n else ""


def tracebacks(text: str) -> list[str]:
    """What a clean attempt must not log: a traceback (a rank's, the script's, bv's, torchrun's
    own "Error waiting on exit barrier"), or torchrun finding its rendezvous store gone at the
    step's end (torch's C++ "recvValue failed" stack, "failed to shutdown the rendezvous")."""
    return [line for line in text.splitlines()
            if "Traceback" in line or "recvValue" in line or "failed to shutdown the rendezvous"
            in line or "Error waiting on exit barrier" in line]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_job_checkpoints_at_the_time_limit_and_resumes_on_the_spare(
        devcluster: DevCluster, tmp_path: Path, framework: str) -> None:
    fw = FRAMEWORKS[framework]
    if importlib.util.find_spec(fw.module) is None:
        pytest.skip(f"{fw.module} is not installed (pip install -e '.[frameworks]')")
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    out, err = tmp_path / "submit.out", tmp_path / "submit.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bluevela", "submit", "--wait", "--json", *LIMIT,
             "-N", "2", "--spare-nodes", "1", "--procs-per-node", str(PROCS),
             str(EXAMPLES / fw.script), fw.dir_opt, str(tmp_path / "state"),
             "--steps", str(STEPS), "--step-s", str(STEP_S)],
            stdout=stdout, stderr=stderr, cwd=tmp_path, env=devcluster.environ())
    watch = Watch(tmp_path, proc)
    crash, operator = _drive(devcluster, watch, fw)
    text = watch.text()
    timeline = watch.timeline()
    sys.stderr.write(f"{framework}: job {time.monotonic() - watch.started:.0f} s, relaunch on "
                     f"the spare {crash.relaunched_at - crash.at:.1f} s after the crash\n"
                     + "".join(f"  {row}\n" for row in timeline))
    assert proc.returncode == 0, (err.read_text(), text)
    info = json.loads(out.read_text())
    attempts = split_attempts(text)
    parts = [p.text for p in attempts]
    banners = BANNER.findall(text)
    # Every attempt but the last ended at bv's signal (Slurm's own at the time limit, or the
    # test's `bv requeue`) with exit 0 on every rank, and the next one started where it
    # stopped: 0 steps lost; but the crashed one, which lost its node, and the next one ran
    # on the spare.
    ends = [p.ended for p in attempts]
    signalled = [n for n in range(len(parts) - 1) if ends[n] == SIGNAL_END]
    at_limit = _at_limit(text, operator)
    detail = (info, crash, operator, list(enumerate(ends, start=1)), timeline, text[-20000:])
    assert len(parts) == len(banners) >= 4, detail
    assert set(range(len(parts) - 1)) - set(signalled) == {crash.attempt - 1}, detail
    lost = ends[crash.attempt - 1]
    assert f"{crash.node} lost" in lost and "(spare " in lost, detail
    assert info["state"] == "COMPLETED" and info["restarts"] == len(signalled), detail
    # More than one time limit: the first two attempts ended at Slurm's own signal, each
    # with 60-90 s left (the supervisor reads the time left at the signal), before the test
    # lengthened the limit.
    assert at_limit[:2] == [0, 1], detail
    for n in at_limit:
        left = AT_LIMIT.findall(parts[n])
        assert len(left) == 1 and 50 <= int(left[0]) <= 95, (n + 1, left, detail)
    assert len(operator) == fw.operator_requeue and set(operator) <= set(signalled), detail
    for n in signalled:
        stopped = _steps(parts[n])[-1] if _steps(parts[n]) else int(
            next(iter(_starts(parts[n]).values()))["start_step"])
        assert {s["start_step"] for s in _starts(parts[n + 1]).values()} == {str(stopped)}, (
            n + 2, stopped, _starts(parts[n + 1]), timeline)
    # The relaunch on the spare: same allocation, within 10 s of the crash (node timeout),
    # from the framework's own checkpoint (the last signal's: where the crashed attempt
    # started; or the script's own periodic one, if the crashed attempt got that far), then
    # to the end.
    after = banners[crash.attempt][3]
    assert f"{crash.node} lost" in after and "(spare " in after, after
    assert crash.relaunched_at - crash.at <= 12, crash.relaunched_at - crash.at
    resumed = {int(s["start_step"]) for s in _starts(parts[crash.attempt]).values()}
    crashed = {int(s["start_step"]) for s in _starts(parts[crash.attempt - 1]).values()}
    assert len(resumed) == 1 and len(crashed) == 1, (resumed, crashed, timeline)
    assert resumed <= _saved_by_then(crashed.pop(), _steps(parts[crash.attempt - 1]), fw.every), (
        resumed, timeline)
    assert _steps(parts[-1])[-1] == STEPS and f"done step={STEPS}" in parts[-1], detail
    # No traceback in any attempt but the one that lost the node, torchrun's end-of-step race
    # included.
    for n, part in enumerate(parts):
        assert n == crash.attempt - 1 or not tracebacks(part), (n + 1, tracebacks(part))
    _check_world(framework, parts, banners)


def _saved_by_then(start: int, trained: list[int], every: int) -> set[int]:
    """Where the attempt after a crash may resume: the crashed attempt's start (the last
    signal's checkpoint), or its own periodic save at the last multiple of `every` it trained
    past; or the next one, when the crash came between that save and the step's line."""
    if not every:
        return {start}
    top = max(trained, default=start)
    newest = max(start, top // every * every)
    return {newest} | ({top + 1} if (top + 1) % every == 0 else set())


@dataclasses.dataclass
class Crash:
    attempt: int = 0  # the attempt whose node crashed (1-based)
    node: str = ""
    at: float = 0.0
    relaunched_at: float = 0.0


def _training_before_signal(watch: Watch, first: int, steps: int = 1) -> int:
    """The first attempt from `first` on that has trained `steps` steps and has had no
    checkpoint signal."""
    n = first
    while True:
        watch.until(f"{steps} steps of attempt {n}",
                    lambda t, n=n: len(_steps(_attempt(t, n))) >= steps
                    or len(BANNER.findall(t)) > n, 300)
        text = watch.text()
        if len(BANNER.findall(text)) == n and SIGNAL_SEEN not in _attempt(text, n):
            return n
        n += 1


def _drive(devcluster: DevCluster, watch: Watch, fw: Framework) -> tuple[Crash, list[int]]:
    """Two of Slurm's time limits, the longer limit, the operator's requeue if the framework
    takes one, the crash, and the job to its end: the crash and the attempts the test
    requeued (0-based)."""
    crash, operator = Crash(), list[int]()
    try:
        watch.until("two attempts ended at Slurm's time limit",
                    lambda t: len(_at_limit(t, operator)) >= 2, 900)
        text = watch.text()
        job = BANNER.findall(text)[0][1]
        devcluster.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={LAST_LIMIT_MIN}"])
        # The operator's requeue, then the crash, each in the first attempt of a longer
        # allocation that trains: Slurm's next signal is minutes away. No allocation comes
        # after the crash (its node revived: slurmd restarted).
        first = _at_limit(text, operator)[1] + 2  # the attempt after the second limit's
        if fw.operator_requeue:
            n = _training_before_signal(watch, first, fw.every + 5 if fw.every else 1)
            assert f"job {job}: checkpoint requested" in devcluster.bv("requeue", job).stdout
            operator.append(n - 1)
            first = n + 1
        n = _training_before_signal(watch, first)
        node = hostlist.expand_hostlist(BANNER.findall(watch.text())[n - 1][2])[1]
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", node])
        crash = Crash(n, node, time.monotonic())
        crash.relaunched_at = watch.until(
            f"attempt {n + 1}", lambda t: len(BANNER.findall(t)) > n, 120)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crash.node], check=False)
        watch.until("the job's end", lambda _t: watch.proc.poll() is not None, 600)
    finally:
        if watch.proc.poll() is None:
            watch.proc.kill()
            watch.proc.wait()
        if crash.node:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crash.node], check=False)
    return crash, operator


def _at_limit(text: str, operator: list[int]) -> list[int]:
    """The attempts (0-based) that ended at a checkpoint signal the test did not send."""
    ends = [p.ended for p in split_attempts(text)]
    return [n for n, end in enumerate(ends) if end == SIGNAL_END and n not in operator]


def _check_world(framework: str, parts: list[str], banners: list[tuple[str, ...]]) -> None:
    """The training world: 2 nodes (not the 3 of the allocation), their list, every rank's own."""
    world = 2 * PROCS
    for part, banner in zip(parts, banners, strict=True):
        starts = _starts(part)
        assert sorted(starts) == list(range(world)), part
        nodes = banner[2]
        for rank, seen in starts.items():
            assert seen["world_size"] == str(world)
            assert seen["SLURM_JOB_NUM_NODES"] == "2" and seen["SLURM_PROCID"] == str(rank)
            if "SLURM_NTASKS" in seen:
                assert seen["SLURM_NTASKS"] == str(world)
            if "SLURM_JOB_NODELIST" in seen:
                assert seen["SLURM_JOB_NODELIST"] == nodes
            if framework == "lightning":
                assert seen["nodes"] == "2" and seen["SLURM_NNODES"] == "2"
                assert seen["SLURM_LOCALID"] == str(rank % PROCS)
