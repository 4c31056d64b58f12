"""The in-job supervisor without Slurm: banner/end-line format and history, node choice,
torchrun argv per step, the hang culprit, the UDP heartbeat over a real socket, and the node
agent's signal plumbing with real processes (SIGUSR1 reaches the workers, never the torchrun
stand-in, and only once a worker has a handler)."""

from __future__ import annotations

import json
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

from bluevela.launch.supervisor import (
    BANNER_RE,
    END_RE,
    History,
    RankBeat,
    banner,
    catches,
    choose_nodes,
    end_line,
    find_hang,
    previous_cause,
    read_history,
    torchrun_step_argv,
)
from bluevela.runtime.heartbeat import Beat, format_beat, parse_beat
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
    assert torchrun_step_argv(base, ["n3", "n4"], 29501, "9-2") == [
        "torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=n3:29501",
        "--rdzv-id=9-2", "--nproc-per-node=2", "--max-restarts=0", "train.py", "--x"]


def test_hang_names_the_rank_outside_a_collective() -> None:
    # Rank 1 hangs in user code at step 6; ranks 0 and 2 then block in the next all_reduce,
    # slightly later: the one NOT in a collective stopped first, whatever the timestamps.
    beats = {0: RankBeat("n1", 6, 100.0, True, "distributed_c10d.py:1:all_reduce"),
             1: RankBeat("n2", 6, 100.2, False, "train.py:55:main"),
             2: RankBeat("n3", 6, 99.9, True, "distributed_c10d.py:1:all_reduce")}
    assert find_hang(beats, 0.0, 105.0, 8.0) is None
    hang = find_hang(beats, 0.0, 108.5, 8.0)
    assert hang is not None and hang.rank == 1
    assert "rank 1 on n2 stopped first" in hang.describe() and "2 other rank" in hang.describe()
    assert find_hang({}, 0.0, 1e6, 8.0) is None  # armed by the first beat, not by start-up
    assert find_hang(beats, 0.0, 1e6, 0.0) is None  # off


def test_beat_roundtrip_and_garbage() -> None:
    beat = Beat(3, "node 7;x", 12, 99, 1.5, True, "a b.py:3:f")
    back = parse_beat(format_beat(beat))
    assert back == Beat(3, "node7x", 12, 99, 1.5, True, "ab.py:3:f")
    for junk in (b"", b"bvhb1 x", b"\xff\xfe", b"bvhb1 1 n 2 3 4 1", b"GET / HTTP/1.1"):
        assert parse_beat(junk) is None


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
    env = {**os.environ, "BV_HEARTBEAT": f"127.0.0.1:{udp.getsockname()[1]}", "RANK": "5"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO)
    try:
        beats = [parse_beat(udp.recv(1024)) for _ in range(3)]
    finally:
        proc.wait(timeout=30)
        udp.close()
    assert all(b is not None for b in beats)
    last = beats[-1]
    assert last is not None and last.rank == 5 and last.step == 3 and last.age_s >= 0.9
    assert not last.in_collective and last.where.startswith("<string>:")


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
out = sys.argv[1]
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


def test_agent_signals_workers_not_torchrun(tmp_path: Path) -> None:
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen(1)
    listen.settimeout(20)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env.update(BV_SUPERVISOR=f"127.0.0.1:{listen.getsockname()[1]}", SLURMD_NODENAME="nodeX")
    agent = subprocess.Popen(
        [sys.executable, "-m", "bluevela.launch.supervisor", "agent", "--", sys.executable,
         "-c", FAKE_TORCHRUN, str(tmp_path)], env=env, cwd=REPO)
    try:
        conn, _ = listen.accept()
        reader = conn.makefile("rb")
        hello = json.loads(reader.readline())
        assert hello["t"] == "hello" and hello["node"] == "nodeX"
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready.0").exists():
            assert time.monotonic() < deadline, "worker 0 never started"
            time.sleep(0.05)
        conn.sendall(b'{"t": "usr1"}\n')  # worker 1 has no handler yet: it must not die
        msgs = []
        while True:
            line = reader.readline()
            assert line, "agent closed without an exit message"
            msg = json.loads(line)
            if msg["t"] == "exit":
                break
            msgs.append(msg)
        assert msg["rc"] == 0, msg
        assert (tmp_path / "usr1.0").exists() and (tmp_path / "usr1.1").exists()
        # The stand-in got no SIGUSR1 (it would have died of it): it saw both workers exit 0.
        assert (tmp_path / "torchrun.exit").read_text() == "[0, 0]"
        assert any(m["t"] == "ping" for m in msgs)
    finally:
        agent.wait(timeout=20)
        listen.close()
    assert agent.returncode == 0


def test_agent_kills_its_training_when_the_supervisor_goes(tmp_path: Path) -> None:
    listen = socket.socket()
    listen.bind(("127.0.0.1", 0))
    listen.listen(1)
    listen.settimeout(20)
    env = {**os.environ, "BV_SUPERVISOR": f"127.0.0.1:{listen.getsockname()[1]}"}
    env.pop("LOCAL_RANK", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "bluevela.launch.supervisor", "agent", "--", sys.executable,
         "-c", FAKE_TORCHRUN, str(tmp_path)], env=env, cwd=REPO)
    conn, _ = listen.accept()
    deadline = time.monotonic() + 20
    while not (tmp_path / "ready.0").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True,
                                           text=True, check=False).stdout.split()]
    conn.close()
    listen.close()
    assert agent.wait(timeout=20) == 1
    time.sleep(0.2)
    alive = [p for p in pids if p != agent.pid and Path(f"/proc/{p}").exists()
             and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]
    assert not alive, f"training processes left behind: {alive}"


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
