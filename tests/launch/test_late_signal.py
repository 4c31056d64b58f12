"""A checkpoint signal that comes after the training ended is no reason to requeue.

Found on the dev cluster (Lightning at Slurm's real time limit): the time-limit SIGUSR1 came
while the last step ran; Lightning reached max_steps, every rank exited 0, and bv requeued the
finished job. The next attempt resumed from the checkpoint before (116 steps back) and trained
them again. Each rank now tells bv how its training ended (beat state 3: it acted on the
request and stopped; 2: it simply ended), and a step whose ranks all simply ended is the job's
end. Here: the REAL supervisor and agents (tests/supervisor_standins.py), workers that use
bluevela.runtime as a script or an integration does.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bluevela.protocol.messages import Beat, format_beat, parse_beat
from bluevela.runtime import checkpoint
from tests.supervisor_standins import Job

# A rank: trains until the file `done`; `BV_TEST_ACT` says whether its loop polls bv's request
# (and so acts on it) or only trains (the request then comes after its last step). It tells bv
# its training is over, then waits for bv's SIGUSR1 (seen without acting on it) and exits 0.
WORKER = """
import os, sys, time
out, node = os.environ["BV_TEST_DIR"], os.environ.get("SLURMD_NODENAME", "?")
os.environ["RANK"] = str(int(node[1:]) - 1)  # one rank per node: n1 is rank 0, n2 rank 1
from bluevela import runtime
from bluevela.runtime import checkpoint
runtime.install_signal_handler()
runtime.progress(0)
open(os.path.join(out, "ready." + node), "w").close()
step, act = 0, os.environ.get("BV_TEST_ACT") == "1"
while not os.path.exists(os.path.join(out, "done")):
    if act and runtime.checkpoint_requested():
        break  # (a real loop saves here)
    time.sleep(0.1)
    step += 1
    runtime.progress(step)
runtime.finished()
open(os.path.join(out, "finished." + node), "w").close()
deadline = time.monotonic() + 60
while not checkpoint._requested.is_set() and time.monotonic() < deadline:
    time.sleep(0.05)
open(os.path.join(out, "usr1." + node), "w").close()
time.sleep(0.5)
"""




def test_a_signal_after_the_training_ended_ends_the_job(tmp_path: Path,
                                                        jobs: list[Job]) -> None:
    nodes = ("n1", "n2")
    job = Job(tmp_path, nodes, extra_env={"BV_TEST_WORKER": WORKER})
    jobs.append(job)
    job.start().wait_ready()
    (tmp_path / "done").touch()  # the last step
    for n in nodes:
        job.wait_for(f"finished.{n}")
    time.sleep(1.5)  # a beat of each rank's end has gone out
    os.kill(job.pid, signal.SIGUSR1)  # Slurm's time-limit signal, too late to act on
    line = job.wait_end(45)[0]
    assert "exit 0 (the training ended before the checkpoint signal" in line, line
    assert job.wait(30) == 0, job.stdout() + job.stderr()
    for n in nodes:
        assert (tmp_path / f"usr1.{n}").exists()  # the signal did reach every rank
    assert not any(c.startswith("requeue") for c in job.scontrol()), job.scontrol()


def test_a_rank_that_acted_on_the_signal_is_requeued(tmp_path: Path,
                                                     jobs: list[Job]) -> None:
    """The same, but one rank's loop saw the request and stopped for it (as a rank stops on
    its peers' agreement): the job is requeued, as before."""
    nodes = ("n1", "n2")
    job = Job(tmp_path, nodes, extra_env={"BV_TEST_WORKER": WORKER, "BV_TEST_ACT": "1"})
    jobs.append(job)
    job.start().wait_ready()
    os.kill(job.pid, signal.SIGUSR1)
    line = job.wait_end(45)[0]
    assert "checkpoint signal SIGUSR1 from Slurm, workers exited 0, requeued by bv" in line, line
    deadline = time.monotonic() + 20
    while job.scontrol() != ["requeue 77"]:
        assert time.monotonic() < deadline, job.scontrol()
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGTERM)  # Slurm ends the requeued allocation
    job.wait(30)


def test_the_rank_side_says_whether_it_acted() -> None:
    checkpoint.clear_checkpoint_request()
    assert not checkpoint.acted_on_request()
    checkpoint.request_checkpoint()  # the signal's flag, not yet seen by the loop
    assert not checkpoint.acted_on_request()
    assert checkpoint.checkpoint_requested() and checkpoint.acted_on_request()
    checkpoint.clear_checkpoint_request()  # a loop that saves and trains on
    assert not checkpoint.acted_on_request()
    checkpoint.stopping_for_checkpoint()  # an integration's agreed stop
    assert checkpoint.acted_on_request()
    checkpoint.clear_checkpoint_request()


@pytest.mark.parametrize(("finished", "at_request", "word"),
                         [(False, False, "0"), (True, False, "2"), (True, True, "3")])
def test_the_beat_carries_how_the_training_ended(finished: bool, at_request: bool,
                                                 word: str) -> None:
    key = b"k" * 32
    beat = Beat(rank=3, node="n1", step=7, pid=42, seq=1, finished=finished,
                at_request=at_request)
    data = format_beat(beat, key)
    assert data.split(b" ")[7] == word.encode()
    got = parse_beat(data, key)
    assert got is not None and (got.finished, got.at_request) == (finished,
                                                                  finished and at_request)


def test_a_handler_of_the_scripts_own_leaves_it_unknown() -> None:
    """Only when bv's handler has SIGUSR1 can a rank say a request did not end its training;
    a script's own handler (or none) may have stopped for it: state 3, and bv requeues."""
    before = signal.getsignal(signal.SIGUSR1)
    try:
        checkpoint.clear_checkpoint_request()
        signal.signal(signal.SIGUSR1, lambda *_: None)
        assert not checkpoint.ended_unasked()
        signal.signal(signal.SIGUSR1, checkpoint._handler)
        assert checkpoint.ended_unasked()
        checkpoint.stopping_for_checkpoint()
        assert not checkpoint.ended_unasked()
    finally:
        signal.signal(signal.SIGUSR1, before)
        checkpoint.clear_checkpoint_request()
