"""Bring your own script, on the REAL dev cluster: plain Lightning, HF Trainer and Accelerate
scripts (examples/byos/) through `bv submit --wait` with a hot spare.

One job per framework, scenarios combined: 2 training nodes + 1 spare (the allocation is 3
nodes, the training world 2). Attempt 1 is interrupted by bv's checkpoint signal: for Lightning
at Slurm's REAL time limit (`-t 2 --signal-before 60`: Slurm itself sends the `--signal=B:USR1`
that bv submit sets, 30-60 s into the allocation), for HF and Accelerate through `bv requeue`
(`scancel --batch --signal=USR1`, the very same path, at a moment the test picks instead of
waiting for Slurm's limit); the ranks agree, save in the framework's own format and exit 0; bv
requeues; attempt 2 starts at the step attempt 1 stopped at (0 steps lost). In attempt 2 a
training node crashes (`devcluster crash`): the step is relaunched on the spare in the same
allocation (attempt 3), which resumes from the framework's checkpoint and finishes (Lightning:
or meets the next time limit, and the attempt after it starts where that one stopped). Every
rank of every attempt prints the Slurm names it sees: they describe the training step (2 nodes,
its node list, its task count, its own rank), not the 3-node allocation. No attempt but the
crashed one logs a traceback, torchrun's own included (its end-of-step race on the rendezvous
store is closed by bluevela/launch/rdzv_guard.py).
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
# framework -> (module to find, script, its directory option, processes per node)
FRAMEWORKS = {
    "lightning": ("lightning", "lightning_ddp.py", "--root", 1),
    "hf": ("transformers", "hf_trainer.py", "--out", 1),
    "accelerate": ("accelerate", "accelerate_loop.py", "--dir", 1),
}
STEPS = 30
STEP_S = 0.3
# Lightning at Slurm's time limit: more steps than the 60 s before the latest signal can train,
# so that Slurm's signal, not the end of training, ends attempt 1.
LIMIT = ("-t", "2", "--signal-before", "60", "--env", "BV_USR1_WAIT_S=60")
LIMIT_STEPS = 120
SIGNAL_SEEN = "bv supervisor: SIGUSR1 received"
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
    def __init__(self, path_of: Path, proc: subprocess.Popen[str]) -> None:
        self.dir, self.proc = path_of, proc
        self.job: str | None = None

    def text(self) -> str:
        files = list(self.dir.glob("bv-*.out"))
        return files[0].read_text(errors="replace") if files else ""

    def until(self, what: str, test: object, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            if callable(test) and test(self.text()):
                return time.monotonic()
            assert self.proc.poll() is None, f"bv submit --wait ended before {what}: {self.text()}"
            assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s:\n{self.text()}"
            time.sleep(0.2)


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


def _ends(text: str) -> list[str]:
    return re.findall(r"^==== bv attempt \d+ ended: (.*) ====$", text, re.M)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_job_checkpoints_at_the_signal_and_resumes_on_the_spare(
        devcluster: DevCluster, tmp_path: Path, framework: str) -> None:
    module, script, dir_opt, procs = FRAMEWORKS[framework]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]')")
    time_limit = framework == "lightning"
    steps = LIMIT_STEPS if time_limit else STEPS
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "--json",
         *(LIMIT if time_limit else ()), "-N", "2", "--spare-nodes", "1",
         "--procs-per-node", str(procs), str(EXAMPLES / script), dir_opt,
         str(tmp_path / "state"), "--steps", str(steps), "--step-s", str(STEP_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=devcluster.environ())
    watch = Watch(tmp_path, proc)
    started = time.monotonic()
    crash, stdout, stderr = _drive(devcluster, watch, time_limit)
    text = watch.text()
    sys.stderr.write(f"{framework}: job {time.monotonic() - started:.0f} s, relaunch on the "
                     f"spare {crash.relaunched_at - crash.at:.1f} s after the crash\n")
    assert proc.returncode == 0, (stderr, text)
    info = json.loads(stdout)
    parts = [p.text for p in split_attempts(text)]
    banners = BANNER.findall(text)
    assert len(parts) == len(banners) >= 3, text
    # Every attempt but the last ended at bv's signal (Lightning: Slurm's own, at the time
    # limit) with exit 0 on every rank, and the next one started where it stopped: 0 steps
    # lost; or it lost the crashed node and the next one ran on the spare. That is the crashed
    # attempt, and at most one more: when Slurm's signal requeues the job within seconds of
    # the crash, slurmctld may not yet know the node is dead and gives it to the job again,
    # and bv finds it lost at once.
    ends = [(_ends(p) or [""])[0] for p in parts]
    signalled = [n for n in range(len(parts) - 1) if ends[n] == SIGNAL_END]
    relaunched = [n for n in range(len(parts) - 1) if n not in signalled]
    detail = (info, crash, list(enumerate(ends, start=1)), text[-20000:])
    assert crash.attempt - 1 in relaunched and len(relaunched) <= 2, detail
    for n in relaunched:
        assert f"{crash.node} lost" in ends[n] and "(spare " in ends[n], detail
    assert info["state"] == "COMPLETED" and info["restarts"] == len(signalled) >= 1, detail
    if not time_limit:
        assert len(parts) == 3 and crash.attempt == 2, _ends(text)
    # An attempt that found the dead node at its start never started its ranks: the one after
    # it (on the spare) resumes instead.
    unstarted = [n for n in range(len(parts)) if not _starts(parts[n])]
    assert set(unstarted) <= set(relaunched) - {crash.attempt - 1}, (unstarted, detail)
    for n in signalled:
        stopped = _steps(parts[n])[-1] if _steps(parts[n]) else int(
            next(iter(_starts(parts[n]).values()))["start_step"])
        nxt = min(m for m in range(n + 1, len(parts)) if m not in unstarted)
        assert {s["start_step"] for s in _starts(parts[nxt]).values()} == {str(stopped)}, (
            nxt + 1, stopped, _starts(parts[nxt]))
    # The relaunch on the spare: same allocation, within 10 s of the crash (node timeout),
    # from the framework's own checkpoint (at most the last signal's), then to the end.
    after = banners[crash.attempt][3]
    assert f"{crash.node} lost" in after and "(spare " in after, after
    assert crash.relaunched_at - crash.at <= 12, crash.relaunched_at - crash.at
    resumed = {s["start_step"] for s in _starts(parts[crash.attempt]).values()}
    assert len(resumed) == 1
    assert int(resumed.pop()) <= _steps(parts[crash.attempt - 1])[-1]
    assert _steps(parts[-1])[-1] == steps and f"done step={steps}" in parts[-1]
    # No traceback in any attempt but one that lost the node, torchrun's end-of-step race
    # included.
    for n, part in enumerate(parts):
        assert n in relaunched or not tracebacks(part), (n + 1, tracebacks(part))
    _check_world(framework, procs, [p for n, p in enumerate(parts) if n not in unstarted],
                 [b for n, b in enumerate(banners) if n not in unstarted])


@dataclasses.dataclass
class Crash:
    attempt: int = 0  # the attempt whose node crashed (1-based)
    node: str = ""
    at: float = 0.0
    relaunched_at: float = 0.0


def _crash_when_training(devcluster: DevCluster, watch: Watch, first: int) -> Crash:
    """Crash the second node of the first attempt from `first` on that has trained a step
    and whose allocation has not had its checkpoint signal yet (Slurm's time-limit signal
    comes at a moment of its own: the crash must not meet it)."""
    n = first
    while True:
        watch.until(f"a step of attempt {n}", lambda t, n=n: len(_steps(_attempt(t, n))) >= 1
                    or len(BANNER.findall(t)) > n, 300)
        text = watch.text()
        if len(BANNER.findall(text)) == n and SIGNAL_SEEN not in _attempt(text, n):
            break
        n += 1
    node = hostlist.expand_hostlist(BANNER.findall(text)[n - 1][2])[1]
    devcluster.run([sys.executable, str(DEVCLUSTER), "crash", node])
    crash = Crash(n, node, time.monotonic())
    crash.relaunched_at = watch.until(
        f"attempt {n + 1}", lambda t: len(BANNER.findall(t)) > n, 120)
    return crash


def _drive(devcluster: DevCluster, watch: Watch, time_limit: bool
           ) -> tuple[Crash, str, str]:
    """Attempt 1 to its signal (bv requeue) unless Slurm's time limit does it, a crash, the
    job to its end: the crash, bv submit's stdout and stderr."""
    crash = Crash()
    try:
        if not time_limit:
            watch.until("step 3 of attempt 1",
                        lambda t: max(_steps(_attempt(t, 1)), default=0) >= 3, 300)
            banner = BANNER.search(watch.text())
            assert banner is not None
            job = banner.group(2)
            assert f"job {job}: checkpoint requested" in devcluster.bv("requeue", job).stdout
        crash = _crash_when_training(devcluster, watch, 1 if time_limit else 2)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crash.node], check=False)
        devcluster.resume_all()  # a later time limit requeues onto all 3 nodes again
        stdout, stderr = watch.proc.communicate(timeout=600)
    finally:
        if watch.proc.poll() is None:
            watch.proc.kill()
        if crash.node:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crash.node], check=False)
    return crash, stdout, stderr


def _check_world(framework: str, procs: int, parts: list[str],
                 banners: list[tuple[str, ...]]) -> None:
    """The training world: 2 nodes (not the 3 of the allocation), their list, every rank's own."""
    world = 2 * procs
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
                assert seen["SLURM_LOCALID"] == str(rank % procs)
