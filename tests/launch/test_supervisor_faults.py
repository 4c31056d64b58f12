"""Issue 23 §4 and §6: the in-job supervisor when Slurm, the network or the job's command
misbehave.

- A hung or refusing slurmctld (a real stand-in ``scontrol`` that hangs or says it cannot
  contact the controller): every Slurm call is bounded and retried; when all fail the job ends
  with one line naming what failed, never a traceback (9058adc: ``TimeoutExpired``, one try).
- A missing torchrun: the step's failure (exit 127), one end line, no relaunch or requeue
  (9058adc: the agent died, the node counted as lost, a relaunch then a requeue).
- A peer that reads slowly: the signed channel keeps whole lines across partial writes
  (9058adc: ``sendall`` wrote part of a line, swallowed ``BlockingIOError``, and the peer's next
  MAC check failed: the agent then kills training).

The REAL supervisor and agents on stand-ins (tests/supervisor_standins.py), real sockets.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from bluevela.errors import LaunchError
from bluevela.launch.request import SubmitRequest
from bluevela.protocol import channel
from bluevela.protocol.channel import Channel, ChannelError
from bluevela.protocol.keys import derive, new_secret
from tests.supervisor_standins import Job


def checkpoint_then_requeue(jobs: list[Job], tmp: Path, scontrol: str) -> Job:
    """A 1-node job told to checkpoint (Slurm's SIGUSR1): its step ends and the supervisor
    requeues it, with `scontrol` behaving as `scontrol` says."""
    job = Job(tmp, ("n1",), options=["--slurm-timeout=1", "--slurm-retry-for=5"],
              extra_env={"BV_TEST_SCONTROL": scontrol})
    jobs.append(job)
    job.start().wait_ready()
    os.kill(job.pid, signal.SIGUSR1)
    job.wait_for("usr1.n1", timeout=15)
    return job


def test_a_hung_scontrol_ends_the_job_with_one_line(tmp_path: Path, jobs: list[Job]) -> None:
    """scontrol never answers: each try is cut at --slurm-timeout, retried within
    --slurm-retry-for, then the job ends (exit 1) with one line naming the call."""
    job = checkpoint_then_requeue(jobs, tmp_path, "hang")
    started = time.monotonic()
    rc = job.wait(40)
    took = time.monotonic() - started
    out, err = job.stdout(), job.stderr()
    assert rc == 1, f"rc {rc}: {out}{err}"
    assert "Traceback" not in err and "TimeoutExpired" not in err, err
    tries = job.scontrol()
    assert len(tries) >= 2 and set(tries) == {"requeue 77"}, tries  # retried, nothing else
    assert took < 15, f"{took:.1f} s"
    last = job.end_lines()[-1]
    assert "scontrol requeue 77 failed" in last and "timed out after 1 s" in last, last
    assert "not requeued" in last, last
    failed = [line for line in err.splitlines() if "failed" in line]
    assert len(failed) == 1 and "scontrol requeue 77 failed" in failed[0], err


def test_a_refusing_slurmctld_is_retried_until_it_answers(tmp_path: Path,
                                                          jobs: list[Job]) -> None:
    """slurmctld down for two calls (a restart), then up: the third try requeues the job."""
    job = checkpoint_then_requeue(jobs, tmp_path, "refuse:2")
    deadline = time.monotonic() + 20
    while len(job.scontrol()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert job.running(), job.stdout() + job.stderr()  # waits for Slurm's SIGTERM
    assert job.scontrol() == ["requeue 77"] * 3, job.scontrol()
    os.kill(job.pid, signal.SIGTERM)  # Slurm ends the requeued allocation
    assert job.wait(30) == 0
    assert "Unable to contact slurm controller" in job.stderr()
    assert "Traceback" not in job.stderr()
    assert "failed" not in job.end_lines()[-1], job.end_lines()


def test_a_refusing_slurmctld_ends_the_job_with_one_line(tmp_path: Path,
                                                         jobs: list[Job]) -> None:
    job = checkpoint_then_requeue(jobs, tmp_path, "refuse")
    assert job.wait(40) == 1, job.stdout() + job.stderr()
    assert len(job.scontrol()) >= 3, job.scontrol()
    last = job.end_lines()[-1]
    assert "scontrol requeue 77 failed" in last and "Unable to contact slurm controller" in last
    assert "Traceback" not in job.stderr()


def test_a_missing_torchrun_is_the_steps_failure(tmp_path: Path, jobs: list[Job]) -> None:
    """Two training nodes and a spare; the torchrun command does not exist. 9058adc: every
    agent died, the nodes counted as lost, a relaunch on the spare, then a requeue. Now:
    exit 127 at once, one end line that says why, no relaunch, no Slurm call."""
    job = Job(tmp_path, ("n1", "n2", "n3"))
    job.argv = [*job.argv[:job.argv.index("--")], "--nodes=2", "--spare-nodes=1", "--",
                str(tmp_path / "no-such-torchrun"), "--nproc-per-node=1", "train.py"]
    jobs.append(job)
    job.start()
    rc = job.wait(30)
    out, err = job.stdout(), job.stderr()
    assert rc == 127, f"rc {rc}: {out}{err}"
    # one banner, one end line, and the attempt's typed record (what came next: the exit)
    assert out.count("==== bv attempt") == 3, out
    assert '==== bv attempt 1 record: {"next":"exit",' in out, out
    (last,) = job.end_lines()
    assert "exit 127" in last and "no-such-torchrun" in last, last
    assert "No such file or directory" in last and "no relaunch" in last, last
    assert job.scontrol() == [], job.scontrol()
    assert "Traceback" not in err, err


# -- the signed channel over a slow reader ----------------------------------------------------

def slow_pair(rcvbuf: int = 4096) -> tuple[socket.socket, socket.socket]:
    """(sender, receiver) over real TCP on loopback: the sender non-blocking with a small send
    buffer, the receiver with a small receive buffer, as a busy peer's socket fills up."""
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen(1)
    receiver = socket.socket()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    receiver.connect(listen.getsockname())
    sender, _ = listen.accept()
    listen.close()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.setblocking(False)
    return sender, receiver


def test_a_slow_reader_gets_every_line_whole(tmp_path: Path) -> None:
    """60 signed lines of 3 KB to a peer that reads 1 KB at a time, then a ping every 0.1 s
    (as the agent's): some sends cannot be written in full. Every line arrives whole and
    verifies, in order. (9058adc: the burst lost all but a few lines and left half of one in
    the stream; the next ping failed the peer's MAC check.)"""
    del tmp_path
    key, nonce = derive(bytes.fromhex(new_secret()), b"line"), os.urandom(16)
    sender, receiver = slow_pair()
    out = Channel(sender, key, nonce, b"s")
    inp = Channel(receiver, key, nonce, b"a")
    got: list[dict[str, object]] = []
    errors: list[str] = []

    def read_slowly() -> None:
        try:
            while sum("i" in m for m in got) < 60:
                data = receiver.recv(1024)
                if not data:
                    return
                got.extend(inp.feed(data))
                time.sleep(0.001)
        except (ChannelError, OSError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    backed_up = 0
    for i in range(60):
        out.send({"t": "ping", "i": i, "pad": "x" * 3000})
        backed_up += bool(getattr(out, "out", b""))  # bytes the socket did not take yet
    deadline = time.monotonic() + 20
    last_ping = time.monotonic()
    while reader.is_alive() and time.monotonic() < deadline:
        getattr(out, "flush", lambda: None)()  # what the supervisor's and agent's ticks do
        if time.monotonic() - last_ping > 0.1:
            out.send({"t": "ping"})
            last_ping = time.monotonic()
        time.sleep(0.005)
    reader.join(1)
    sender.close()
    receiver.close()
    assert errors == [], errors
    assert [m["i"] for m in got if "i" in m] == list(range(60))
    assert backed_up > 0, "the reader was never slower than the writer: no partial write"
    assert getattr(out, "broken", None) is None


def test_a_peer_that_never_reads_breaks_the_channel_explicitly() -> None:
    """Bounded: past MAX_OUT pending the channel says it is broken (its owner drops the
    connection) rather than buffer without end or send half a line."""
    key, nonce = derive(bytes.fromhex(new_secret()), b"line"), os.urandom(16)
    sender, receiver = slow_pair()
    chan = Channel(sender, key, nonce, b"s")
    try:
        for i in range(400):
            chan.send({"t": "ping", "i": i, "pad": "x" * 3000})
        assert chan.broken is not None and "read nothing" in chan.broken
        assert len(chan.out) <= channel.MAX_OUT + 4096
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("flag", ["--rdzv-id=77", "--rdzv_endpoint=n1:29500", "--standalone",
                                  "--nnodes=2"])
def test_a_torchrun_command_may_not_set_the_rendezvous(flag: str) -> None:
    """A rendezvous flag in site.yaml's torchrun command would override the per-step one bv
    hands over in the environment (and name the store on a world-readable command line)."""
    with pytest.raises(LaunchError, match="must not set"):
        SubmitRequest(script="train.py", torchrun=("torchrun", flag))
    SubmitRequest(script="train.py", args=(flag,))  # the script's own arguments are its own


def test_a_refusal_that_may_never_clear_is_retried_briefly() -> None:
    """22.05 without accounting refuses a second `update NodeList=` of a job "for good" with a
    message that reads as temporary: its tries stop after SLOW_SLURM_RETRY_S, not the call's
    whole budget (9058adc had no retries; the first retry loop waited out all 300 s)."""
    from bluevela.slurm.command import SLOW_SLURM_RETRY_S, retry_deadline

    why = ("exit 1: Job update not available right now, the DB index is being set, "
           "try again in a bit for job 42.")
    assert retry_deadline(why, 100.0, 400.0) == 100.0 + SLOW_SLURM_RETRY_S
    assert retry_deadline(why, 100.0, 110.0) == 110.0  # never past the call's own budget
    assert retry_deadline("timed out after 20 s", 100.0, 400.0) == 400.0
