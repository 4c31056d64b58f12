"""The in-job supervisor without Slurm: banner/end-line format and history, node choice,
torchrun argv per step, the hang culprit, the UDP heartbeat over a real socket, and the node
agent's signal plumbing with real processes (SIGUSR1 reaches the workers, never the torchrun
stand-in, and only once a worker has a handler)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bluevela.launch.agent import endpoint_env
from bluevela.launch.attempts import BANNER as BANNER_RE
from bluevela.launch.attempts import END as END_RE
from bluevela.launch.attempts import History, banner, end_line, previous_cause, read_history
from bluevela.launch.policy import choose_nodes
from bluevela.launch.proctree import catches
from bluevela.launch.supervisor import (
    max_restarts,
    new_rdzv_id,
    ranks_bound,
    rdzv_env,
    torchrun_step_argv,
)
from bluevela.launch.watchdog import RankBeat, find_hang
from bluevela.protocol.channel import Channel, challenge_line
from bluevela.protocol.keys import SECRET_ENV, beat_key, derive, mac, new_secret
from bluevela.protocol.messages import Beat, format_beat, parse_beat
from tests.conftest import REPO

# What `bv logs --attempt N` / `bv status` split on (the contract in /work/notes, H5's side).
LOGS_SPLIT = re.compile(r"^==== bv attempt (\d+) job ")


def test_banner_and_end_line_format() -> None:
    line = banner(3, "42", ["node1", "node3"], "node2 lost\n(connection closed)")
    assert line == ("==== bv attempt 3 job 42 nodes node[1,3] previous: node2 lost "
                    "(connection closed) ====")
    assert LOGS_SPLIT.match(line) and BANNER_RE.match(line)
    end = end_line(3, "exit 0")
    assert end == "==== bv attempt 3 ended: exit 0 ====" and END_RE.match(end)
    assert not LOGS_SPLIT.match(end)  # an end line never starts an attempt


def test_history_counts_banners_and_keeps_last_cause() -> None:
    out = [b"noise\n", (banner(1, "7", ["n1"], "none") + "\n").encode(), b"step=1\n",
           (end_line(1, "n2 lost; relaunching") + "\n").encode(),
           (banner(2, "7", ["n1"], "n2 lost; relaunching") + "\n").encode(), b"==== bv attempt x\n"]
    hist = read_history(out)
    assert hist == History(attempts=2, last_end=None)
    assert "without a bv end line" in previous_cause(hist)
    hist = read_history([*out, (end_line(2, "hang: rank 1") + "\n").encode()])
    assert previous_cause(hist) == "hang: rank 1"
    assert previous_cause(History()) == "none"


def test_choose_nodes_spare_then_shrink_then_none() -> None:
    alloc = ["n1", "n2", "n3", "n4"]
    assert choose_nodes(alloc, [], 3, 3) == ["n1", "n2", "n3"]
    assert choose_nodes(alloc, ["n2"], 3, 3) == ["n1", "n3", "n4"]  # the spare steps in
    assert choose_nodes(alloc, ["n2", "n4"], 3, 3) is None  # fixed size: nothing to run on
    assert choose_nodes(alloc, ["n2", "n4"], 3, 2) == ["n1", "n3"]  # data parallel shrinks


def test_torchrun_argv_per_step() -> None:
    base = ["torchrun", "--nproc-per-node=2", "--max-restarts=0", "train.py", "--x"]
    # The id and the endpoint name the store: the environment only (argv is world-readable).
    # torch's static rendezvous: the supervisor knows the world, no join loop (issue 37)
    assert torchrun_step_argv(base, ["n3", "n4"]) == [
        "torchrun", "--nnodes=2", "--rdzv-backend=static", "--nproc-per-node=2",
        "--max-restarts=0", "train.py", "--x"]
    # In-place restarts need c10d's new round (static restarts one node's workers alone).
    for restarts in (["--max-restarts=2"], ["--max_restarts", "1"], ["--max-restarts=0",
                                                                     "--max-restarts=3"]):
        argv = torchrun_step_argv(["torchrun", *restarts, "train.py"], ["n1"])
        assert argv[:3] == ["torchrun", "--nnodes=1", "--rdzv-backend=c10d"], argv
    assert max_restarts(["torchrun", "--max-restarts=3", "--max-restarts=0"]) == 0
    assert max_restarts(["torchrun", "--max-restarts"]) == 0 == max_restarts(["torchrun"])
    rdzv_id = new_rdzv_id()
    assert re.fullmatch(r"[0-9a-f]{32}", rdzv_id) and new_rdzv_id() != rdzv_id  # 128 bits
    assert rdzv_env(rdzv_id, "n3") == {"PET_RDZV_ID": rdzv_id, "BV_RDZV_NODE": "n3"}
    assert endpoint_env("n3", 41234) == {"PET_RDZV_ENDPOINT": "n3:41234"}
    assert ranks_bound(base, 2) == 4 and ranks_bound(["torchrun", "--nproc-per-node", "gpu"], 2) == 2048


def test_hang_names_the_rank_outside_a_collective() -> None:
    # Rank 1 hangs in user code at step 6; ranks 0 and 2 then block in the next all_reduce,
    # slightly later: the one NOT in a collective stopped first, whatever the timestamps.
    beats = {0: RankBeat("n1", 6, 100.0, True, "distributed_c10d.py:1:all_reduce"),
             1: RankBeat("n2", 6, 100.2, False, "train.py:55:main"),
             2: RankBeat("n3", 6, 99.9, True, "distributed_c10d.py:1:all_reduce")}
    assert find_hang(beats, 105.0, 8.0) is None
    hang = find_hang(beats, 108.5, 8.0)
    assert hang is not None and hang.rank == 1
    assert "rank 1 on n2 stopped first" in hang.describe() and "2 other rank" in hang.describe()
    assert find_hang({}, 1e6, 8.0) is None  # armed by the first beat, not by start-up
    assert find_hang(beats, 1e6, 0.0) is None  # off


KEY = beat_key(b"k" * 32)


def test_beat_roundtrip_and_garbage() -> None:
    beat = Beat(3, "node 7;x", 12, 99, 1.5, True, "a b.py:3:f", seq=4)
    back = parse_beat(format_beat(beat, KEY), KEY)
    assert back == Beat(3, "node7x", 12, 99, 1.5, True, "ab.py:3:f", seq=4)
    assert parse_beat(format_beat(beat, beat_key(b"x" * 32)), KEY) is None  # another job's key
    for junk in (b"", b"bvhb1 x", b"\xff\xfe", b"bvhb1 1 n 2 3 4 1", b"GET / HTTP/1.1",
                 b"bvhb1 7 gpu042 5 1 999999000 0 x", b"x" * 4096):
        assert parse_beat(junk, KEY) is None


def _signed(body: bytes) -> bytes:
    return body + b" " + mac(KEY, body)


@pytest.mark.parametrize("body", [
    b"bvhb2 0 n1 1 1 1 " + b"9" * 400 + b" 0 x",  # OverflowError in the old parse
    b"bvhb2 0 n1 1 1 1 -5000 0 x",  # a negative age: progress in the future
    b"bvhb2 -1 n1 1 1 1 5 0 x", b"bvhb2 9999999 n1 1 1 1 5 0 x",  # ranks out of range
    b"bvhb2 0 n1 1 0 1 5 0 x", b"bvhb2 0 n1 1 1 1 5 0",  # pid 0; a word missing
])
def test_signed_beats_out_of_range_are_dropped(body: bytes) -> None:
    """Even a correctly signed beat is range-checked: parse_beat never raises."""
    assert parse_beat(_signed(body), KEY) is None
    assert parse_beat(_signed(b"bvhb2 0 n1 1 1 1 5 0 x"), KEY) is not None  # the control


def test_progress_sends_beats_over_udp(tmp_path: Path) -> None:
    """A real process calls progress(); a real UDP socket receives beats every second, with
    the step, and the main thread's position while it sleeps outside any collective."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(10)
    code = textwrap.dedent("""
        import time
        from bluevela.runtime import progress
        for step in range(1, 4):
            progress(step)
        time.sleep(2.5)
    """)
    secret = new_secret()
    key = beat_key(bytes.fromhex(secret))
    env = {**os.environ, "BV_HEARTBEAT": f"127.0.0.1:{udp.getsockname()[1]}", "RANK": "5",
           SECRET_ENV: secret}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO)
    try:
        beats = [parse_beat(udp.recv(1024), key) for _ in range(3)]
    finally:
        proc.wait(timeout=30)
        udp.close()
    assert all(b is not None for b in beats)
    last = beats[-1]
    assert last is not None and last.rank == 5 and last.step == 3 and last.age_s >= 0.9
    assert [b.seq for b in beats if b is not None] == [1, 2, 3]
    assert not last.in_collective and last.where.startswith("<string>:")


def test_a_finished_rank_tearing_down_is_not_a_hang() -> None:
    """The recovery cluster test's hang case failed under load (and on cd8e436): after the
    last step the ranks tore down the process group and the interpreter for longer than the
    6 s hang timeout, and the watchdog aborted a finished job. A rank that says its training is
    over is not watched; the others still are."""
    done = {0: RankBeat("n1", 10, 100.0, False, "train.py:130:main", finished=True),
            1: RankBeat("n2", 10, 100.1, True, "distributed_c10d.py:1:barrier", finished=True)}
    assert find_hang(done, 1e6, 6.0) is None
    one_left = {**done, 2: RankBeat("n3", 9, 99.0, False, "train.py:55:main")}
    hang = find_hang(one_left, 110.0, 6.0)
    assert hang is not None and hang.rank == 2  # never a finished rank named


def test_finished_travels_in_the_beat_and_the_exit_says_it(tmp_path: Path) -> None:
    """`runtime.finished()` (and, for a script that never calls it, the interpreter's exit)
    sends a beat that says the rank is finished; the beats before it do not."""
    beat = Beat(3, "n1", 12, 99, 1.5, False, "t.py:3:f", seq=4, finished=True)
    assert parse_beat(format_beat(beat, KEY), KEY) == beat
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(10)
    secret = new_secret()
    key = beat_key(bytes.fromhex(secret))
    env = {**os.environ, "BV_HEARTBEAT": f"127.0.0.1:{udp.getsockname()[1]}", "RANK": "1",
           SECRET_ENV: secret}
    for code, steps in (("from bluevela import runtime\nruntime.progress(7)\n"
                         "runtime.finished()\nimport time; time.sleep(1.5)\n", 7),
                        ("from bluevela.runtime import progress\nprogress(3)\n", 3)):
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=30,
                              check=True)
        assert proc.returncode == 0
        got = []
        while not got or not got[-1].finished:
            b = parse_beat(udp.recv(1024), key)
            assert b is not None
            got.append(b)
        assert not got[0].finished and got[-1].finished and got[-1].step == steps
        assert sum(b.finished for b in got) >= 1
        udp.settimeout(0.5)
        try:  # nothing left over for the next script (a finished rank's later beats)
            while True:
                udp.recv(1024)
        except TimeoutError:
            pass
        udp.settimeout(10)
    udp.close()


def test_progress_outside_a_job_is_a_noop() -> None:
    code = "from bluevela.runtime import progress\nfor i in range(1000): progress(i)\nprint('ok')"
    env = {k: v for k, v in os.environ.items() if k != "BV_HEARTBEAT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout == "ok\n"


# A torchrun stand-in: no LOCAL_RANK itself, starts two workers that have it. Worker 1 sleeps
# before installing its SIGUSR1 handler (a worker still importing torch).
FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
out = sys.argv[-1]
open(os.path.join(out, "torchrun.argv"), "w").write("\\0".join(sys.argv))
open(os.path.join(out, "torchrun.endpoint"), "w").write(os.environ.get("PET_RDZV_ENDPOINT", ""))
worker = '''
import os, signal, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
time.sleep(delay)
def h(*_):
    open(os.path.join(out, "usr1." + os.environ["LOCAL_RANK"]), "w").write(str(time.time()))
    sys.exit(0)
signal.signal(signal.SIGUSR1, h)
open(os.path.join(out, "ready." + os.environ["LOCAL_RANK"]), "w").close()
while True:
    time.sleep(0.05)
'''
procs = [subprocess.Popen([sys.executable, "-c", worker, out, str(d)],
                          env={**os.environ, "LOCAL_RANK": str(i)})
         for i, d in enumerate((0.0, 2.0))]
codes = [p.wait() for p in procs]
open(os.path.join(out, "torchrun.exit"), "w").write(repr(codes))
sys.exit(max(codes))
"""


class AgentPeer:
    """The supervisor's end of one agent's channel (a real agent process, real sockets)."""

    def __init__(self, tmp_path: Path, node: str = "nodeX") -> None:
        secret = new_secret()
        self.listen = socket.socket()
        self.listen.bind(("127.0.0.1", 0))
        self.listen.listen(1)
        self.listen.settimeout(20)
        torchrun = tmp_path / "torchrun"
        torchrun.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
        torchrun.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
        env.update(BV_SUPERVISOR=f"127.0.0.1:{self.listen.getsockname()[1]}",
                   SLURMD_NODENAME=node, BV_RDZV_NODE=node, BV_RDZV_GUARD="optional",
                   **{SECRET_ENV: secret})
        self.agent = subprocess.Popen(
            [sys.executable, "-P", "-m", "bluevela.launch.agent",
             "--", str(torchrun), str(tmp_path)], env=env, cwd=REPO)
        self.sock, _ = self.listen.accept()
        self.sock.settimeout(20)
        nonce = os.urandom(16)
        self.sock.sendall(challenge_line(nonce))
        self.chan = Channel(self.sock, derive(bytes.fromhex(secret), b"line"), nonce, b"s")
        self.queue: list[dict[str, object]] = []

    def next(self) -> dict[str, object] | None:
        while not self.queue:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.queue += self.chan.feed(data)
        return self.queue.pop(0)

    def close(self) -> None:
        self.sock.close()
        self.listen.close()


def test_agent_signals_workers_not_torchrun(tmp_path: Path) -> None:
    peer = AgentPeer(tmp_path)
    try:
        hello = peer.next()
        assert hello is not None and hello["t"] == "hello" and hello["node"] == "nodeX"
        port = hello["port"]  # the rendezvous node's agent found a free port
        assert isinstance(port, int) and 1024 <= port <= 65535
        peer.chan.send({"t": "go", "port": port})
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready.0").exists():
            assert time.monotonic() < deadline, "worker 0 never started"
            time.sleep(0.05)
        peer.chan.send({"t": "usr1"})  # worker 1 has no handler yet: it must not die
        msgs = []
        while True:
            msg = peer.next()
            assert msg is not None, "agent closed without an exit message"
            if msg["t"] == "exit":
                break
            msgs.append(msg)
        assert msg["rc"] == 0, msg
        assert (tmp_path / "usr1.0").exists() and (tmp_path / "usr1.1").exists()
        # The stand-in got no SIGUSR1 (it would have died of it): it saw both workers exit 0.
        assert (tmp_path / "torchrun.exit").read_text() == "[0, 0]"
        # The endpoint reaches torchrun in its environment, not on its command line.
        assert (tmp_path / "torchrun.endpoint").read_text() == f"nodeX:{port}"
        assert str(port) not in (tmp_path / "torchrun.argv").read_text()
        assert any(m["t"] == "ping" for m in msgs)
    finally:
        peer.agent.wait(timeout=20)
        peer.close()
    assert peer.agent.returncode == 0


def test_agent_kills_its_training_when_the_supervisor_goes(tmp_path: Path) -> None:
    peer = AgentPeer(tmp_path)
    hello = peer.next()
    assert hello is not None
    peer.chan.send({"t": "go", "port": hello["port"]})
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready.0").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True,
                                           text=True, check=False).stdout.split()]
    training = [p for p in pids if p != peer.agent.pid]
    # The stand-in torchrun and its two workers: a test that found nothing proves nothing.
    assert len(training) >= 3, f"training processes not found: {pids}"
    peer.close()
    assert peer.agent.wait(timeout=20) == 1
    time.sleep(0.2)
    alive = [p for p in training if Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]
    assert not alive, f"training processes left behind: {alive}"


def test_agent_refuses_a_channel_without_the_secret(tmp_path: Path) -> None:
    """A listener that is not the job's supervisor (wrong key) gets a hello it can check
    nothing against, and its orders are refused: the agent starts no training."""
    peer = AgentPeer(tmp_path)
    try:
        assert peer.next() is not None
        forged = Channel(peer.sock, derive(b"z" * 32, b"line"), peer.chan.nonce, b"s")
        forged.send({"t": "go", "port": 40000})
        assert peer.agent.wait(timeout=20) == 1
        assert not (tmp_path / "torchrun.argv").exists()
    finally:
        peer.close()


def test_catches_reads_the_handler_mask() -> None:
    old = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        assert catches(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert not catches(os.getpid(), signal.SIGUSR2)


@pytest.mark.parametrize("argv", [[], ["--nodes=2"], ["--nodes=0", "--", "t"],
                                  ["--nodes=2", "--min-nodes=3", "--", "t"]])
def test_bad_supervisor_arguments_are_one_line(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "bluevela.launch.supervisor", *argv],
                          capture_output=True, text=True, timeout=30, cwd=REPO, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("bv supervisor: ")


def test_allocation_smaller_than_the_job_is_one_line_not_a_requeue_loop(tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1",
           "PATH": f"{tmp_path}:/usr/bin:/bin"}
    # An srun or scontrol here would be a bug: both fail loudly.
    for tool in ("srun", "scontrol"):
        (tmp_path / tool).write_text("#!/bin/sh\necho called >&2\nexit 99\n")
        (tmp_path / tool).chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "bluevela.launch.supervisor", "--nodes=2", "--",
                           "torchrun", "t.py"], env=env, capture_output=True, text=True,
                          timeout=30, cwd=REPO, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "bv supervisor: the allocation has 1 node(s) (n1), the job needs 2"]
