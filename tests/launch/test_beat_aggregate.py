"""The node agent aggregates its ranks' beats (issue 27): ranks beat to their node's agent,
the agent sends the supervisor ONE signed datagram a beat interval with each local rank's
last beat (`messages.Agg`), and the hang watchdog still names the first stuck rank and its
node.

- the format: a round trip; forged, tampered, oversized, malformed and wrong-rank datagrams
  refused by the parser;
- the supervisor's step (its real UDP socket and read loop): an aggregate's ranks become the
  watchdog's records; a replay, an older seq, a node not of the step, more ranks than a
  node has, progress older than the step: refused whole;
- the agent's `Aggregator` on real sockets with real rank processes
  (`bluevela.runtime.progress`): their beats aggregated with ages brought up to the send, a
  rank whose process ended forgotten, checkpoint datagrams still straight to the supervisor;
  a beat from another user of the node (runuser nobody, without the secret) or a replayed
  beat does not pass;
- the real supervisor, its real agent and a worker that stops: the worker beats to the
  agent's loopback port, and the hang is named.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.launch.agent import Aggregator
from bluevela.launch.events_log import EventLog
from bluevela.launch.step import Endpoints, Signals, Step, StepConfig, StepState
from bluevela.launch.watchdog import find_hang
from bluevela.protocol.keys import agg_key, beat_key, mac
from bluevela.protocol.messages import (
    AGG_MAX_BYTES,
    AGG_MAX_RANKS,
    Agg,
    AggRank,
    Beat,
    format_agg,
    format_beat,
    parse_agg,
    parse_beat,
    parse_ckpt,
)
from tests.conftest import REPO
from tests.supervisor_standins import WORKER, Job

SECRET = bytes(range(32))
KEY = agg_key(SECRET)


def _ranks(n: int, first: int = 0, age: float = 0.5) -> tuple[AggRank, ...]:
    return tuple(AggRank(first + i, 1000 + i, 40 + i, age, i % 3 == 1, "train.py:12:<module>",
                         i % 3 == 2) for i in range(n))


def _signed(body: bytes, key: bytes = KEY) -> bytes:
    return body + b" " + mac(key, body)


# -- the format --------------------------------------------------------------------------------

def test_an_aggregate_round_trips() -> None:
    agg = Agg("sn00042", 4242, 7, _ranks(8))
    data = format_agg(agg, KEY)
    assert data.startswith(b"bvag1 sn00042 4242 7 8 0 1000 40 500 0 train.py:12:<module> ")
    assert parse_agg(data, KEY) == agg
    full = Agg("sn00042", 4242, 8, tuple(AggRank(r, 4_000_000, 1 << 61, 1e6, True, "w" * 500)
                                         for r in range(AGG_MAX_RANKS)))
    data = format_agg(full, KEY)  # the widest a real agent sends: within the cap
    assert len(data) <= AGG_MAX_BYTES
    back = parse_agg(data, KEY)
    assert back is not None and len(back.ranks) == AGG_MAX_RANKS
    with pytest.raises(ValueError):
        format_agg(Agg("n", 1, 1, _ranks(AGG_MAX_RANKS + 1)), KEY)


def test_forged_tampered_and_malformed_aggregates_are_refused() -> None:
    good = format_agg(Agg("n1", 10, 1, _ranks(2)), KEY)
    assert parse_agg(good, KEY) is not None
    assert parse_agg(good, agg_key(b"y" * 32)) is None  # another step's key
    assert parse_agg(good, beat_key(SECRET)) is None  # a rank's key: not the agents'
    tampered = good.replace(b" 40 ", b" 41 ", 1)
    assert tampered != good and parse_agg(tampered, KEY) is None
    assert parse_agg(good[:-1], KEY) is None
    assert parse_agg(good.rpartition(b" ")[0] + b" " + b"0" * 32, KEY) is None
    rank = b"0 1000 40 500 0 w"
    for body in (
        b"bvag1 n1 10 1 3 " + rank + b" 1 1000 40 500 0 w",  # count says 3, holds 2
        b"bvag1 n1 10 1 0",  # no rank
        b"bvag1 n1 10 1 1 " + rank + b" extra",
        b"bvag1 n1 10 1 2 " + rank + b" " + rank,  # one rank twice
        b"bvag1 n1 10 1 1 5000 1000 40 500 0 w",  # a rank beyond the step (max_rank 16)
        b"bvag1 n1 10 1 1 -1 1000 40 500 0 w",
        b"bvag1 n1 10 1 1 0 0 40 500 0 w",  # pid 0
        b"bvag1 n1 10 1 1 0 1000 40 500 4 w",  # no state 4 (3: finished at the request)
        b"bvag1 n1 10 1 1 0 1000 40 -5 0 w",  # a negative age
        b"bvag1 n1 10 1 1 0 1000 " + b"9" * 400 + b" 500 0 w",  # a 400-digit step
        b"bvag1 n1 10 1 1 0 1000 40 500 0 \x1b[2J",  # a terminal escape as `where`
        b"bvag1 n\xff1 10 1 1 " + rank,  # not ASCII
        b"bvag1 n/1 10 1 1 " + rank,  # a node name with a slash
        b"bvag1 n1 10 1 1  " + rank,  # two spaces: an empty word
        b"bvag1 n1 10 1 33 " + b" ".join([b"%d 1000 40 500 0 w" % r for r in range(33)]),
        b"bvhb2 0 n1 1 1 1 5 0 x",  # a rank's beat is not an aggregate
    ):
        assert parse_agg(_signed(body), KEY, max_rank=16) is None, body
    assert parse_agg(_signed(b"bvag1 n1 10 1 1 " + rank), KEY, max_rank=16) is not None
    # Oversized: refused before the MAC is computed, signed or not.
    big = b"bvag1 n1 10 1 1 0 1000 40 500 0 " + b"w" * AGG_MAX_BYTES
    assert parse_agg(_signed(big), KEY) is None


# -- the supervisor's step: its socket, its read loop ------------------------------------------

@pytest.fixture
def step() -> Iterator[tuple[Step, socket.socket]]:
    signals = Signals()
    ends = Endpoints(["n1"], "localhost", signals)  # one node: loopback
    st = StepState(nodes=["n1", "n2"], started=time.monotonic() - 60, agg_key=KEY,
                   beat_key=beat_key(SECRET), max_ranks=16)
    s = Step(st, None, ends, signals, EventLog(None, "h"), "h", StepConfig())  # type: ignore[arg-type]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        yield s, udp
    finally:
        udp.close()
        ends.close()
        signals.close()


def _deliver(s: Step, udp: socket.socket, *datagrams: bytes) -> None:
    for data in datagrams:
        udp.sendto(data, s.ends.udp.getsockname())
    time.sleep(0.05)
    s._read_beats(time.monotonic())


def test_the_supervisor_takes_an_aggregate_once(step: tuple[Step, socket.socket]) -> None:
    s, udp = step
    st = s.st
    first = format_agg(Agg("n1", 500, 5, _ranks(8)), KEY)
    _deliver(s, udp, first)
    assert sorted(st.beats) == list(range(8)) and st.refused_aggs == 0
    assert {b.node for b in st.beats.values()} == {"n1"}
    assert st.beats[1].in_collective and st.beats[2].finished and st.beats[0].step == 40
    st.beats.clear()
    refused = [
        first,  # a replay
        format_agg(Agg("n1", 500, 4, _ranks(8)), KEY),  # an older seq of the same agent
        format_agg(Agg("n9", 500, 9, _ranks(1)), KEY),  # a node not of this step
        format_agg(Agg("n1", 500, 10, _ranks(9)), KEY),  # more ranks than a node has (16/2)
        format_agg(Agg("n1", 500, 11, _ranks(1, age=3600)), KEY),  # progress before the step
        format_agg(Agg("n1", 500, 12, _ranks(1, first=16)), KEY),  # a rank beyond the step
        format_agg(Agg("n1", 500, 13, _ranks(1)), agg_key(b"z" * 32)),  # forged
    ]
    _deliver(s, udp, *refused)
    assert st.beats == {} and st.refused_aggs == len(refused)
    # A newer one from the same agent, and the other node's agent (its own seq): taken.
    _deliver(s, udp, format_agg(Agg("n1", 500, 14, _ranks(2)), KEY),
             format_agg(Agg("n2", 77, 1, _ranks(2, first=8)), KEY))
    assert sorted(st.beats) == [0, 1, 8, 9] and st.beats[8].node == "n2"


def test_the_watchdog_names_the_first_stuck_rank_from_aggregates(
        step: tuple[Step, socket.socket]) -> None:
    s, udp = step
    stuck = AggRank(11, 2011, 99, 30.0, False, "train.py:88:forward")
    waiting = tuple(AggRank(r, 2000 + r, 100, 30.5, True, "distributed_c10d.py:1:all_reduce")
                    for r in (8, 9, 10))
    _deliver(s, udp, format_agg(Agg("n2", 77, 1, (*waiting, stuck)), KEY),
             format_agg(Agg("n1", 76, 1, _ranks(2, age=0.2)), KEY))
    # The watchdog's first look: the oldest progress of any watched rank (here one waiting
    # in the collective for the stuck one, which find_hang then names).
    assert min(s.st.progress.values()) == s.st.beats[8].last_progress
    hang = find_hang(s.st.beats, time.monotonic(), 20.0)
    assert hang is not None and (hang.rank, hang.beat.node) == (11, "n2"), hang
    assert hang.describe().startswith("hang: rank 11 on n2 stopped first (no progress for 30 s,"
                                      " last step 99, at train.py:88:forward, not in a collective)")
    assert find_hang(s.st.beats, time.monotonic(), 40.0) is None


# -- the agent's aggregator --------------------------------------------------------------------

RANK = """
import os, sys, time
from bluevela import runtime
rank = int(os.environ["RANK"])
for step in range(1, 1000):
    runtime.progress(step if rank == 0 else 7)
    if step == 3:
        runtime.checkpoint_saved(3)
    if os.path.exists(os.environ["STOP"] + str(rank)):
        sys.exit(0)
    time.sleep(0.05)
"""


def _rank(tmp: Path, agg: Aggregator, rank: int, ckpt: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BV_HEARTBEAT": agg.addr(), "BV_CHECKPOINT_ADDR": ckpt,
           "BV_JOB_SECRET": SECRET.hex(), "BV_HEARTBEAT_INTERVAL_S": "0.2", "RANK": str(rank),
           "SLURMD_NODENAME": "n1", "STOP": str(tmp / "stop."), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-P", "-c", RANK], env=env, cwd=tmp)


def _collect(agg: Aggregator, sup: socket.socket, seconds: float) -> tuple[list[Agg], list[bytes]]:
    """Run the agent's part for `seconds`: read beats, send aggregates every 0.2 s; what
    the stand-in supervisor received (aggregates, and anything else)."""
    aggs: list[Agg] = []
    other: list[bytes] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.monotonic()
        agg.read(now)
        if agg.ranks and now - agg.last_sent >= 0.2:
            agg.send(now)
        time.sleep(0.02)
        while True:
            try:
                data = sup.recv(65536)
            except BlockingIOError:
                break
            got = parse_agg(data, KEY)
            if got is not None:
                aggs.append(got)
            else:
                other.append(data)
    return aggs, other


def test_the_agent_aggregates_its_ranks_beats(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sup:
        sup.bind(("127.0.0.1", 0))
        sup.setblocking(False)
        addr = sup.getsockname()
        agg = Aggregator("n1", SECRET, addr)
        ckpt = f"127.0.0.1:{addr[1]}"
        ranks = [_rank(tmp_path, agg, r, ckpt) for r in (0, 1)]
        try:
            aggs, other = _collect(agg, sup, 3.0)
            # Every aggregate came from this agent, numbered up, with both ranks once running.
            assert aggs and all(a.node == "n1" and a.pid == os.getpid() for a in aggs)
            assert [a.seq for a in aggs] == sorted({a.seq for a in aggs})
            last = {r.rank: r for r in aggs[-1].ranks}
            assert sorted(last) == [0, 1], aggs[-1]
            assert {last[0].pid, last[1].pid} == {ranks[0].pid, ranks[1].pid}
            assert last[0].step > 10 and last[1].step == 7
            # Ages brought up to the send: rank 0 progresses every 50 ms, beats every 0.2 s,
            # the agent sends every 0.2 s; rank 1 stays at step 7 but calls progress too.
            assert last[0].age_s < 2.5 and not last[0].finished
            # The checkpoint datagrams went straight to the supervisor, one per rank.
            ck = [parse_ckpt(d, beat_key(SECRET)) for d in other]
            assert sorted(c.rank for c in ck if c is not None) == [0, 1], other
            assert all(c is not None for c in ck)
            assert agg.refused == 0
            # Rank 1 ends: its process is gone, so the agent forgets it (its record would
            # otherwise come back with a growing age, a false hang).
            (tmp_path / "stop.1").touch()
            ranks[1].wait(10)
            aggs, _ = _collect(agg, sup, 1.5)
            assert aggs and sorted(r.rank for r in aggs[-1].ranks) == [0]
            # A rank that ends through runtime.finished(): its last beat says so.
            (tmp_path / "stop.0").touch()
            ranks[0].wait(10)
            agg.read(time.monotonic())
            assert agg.ranks[0][0].finished
        finally:
            for p in ranks:
                p.kill()
                p.wait()
            agg.close()


def _outward_address() -> str | None:
    """This machine's address toward other hosts (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        addr = str(probe.getsockname()[0])
    return None if addr.startswith("127.") else addr


def test_the_aggregates_leave_for_another_host() -> None:
    """The ranks' port is on loopback, the supervisor on another node: a socket bound to
    127.0.0.1 cannot send there (EINVAL; the first dev-cluster run lost every other node's
    beats so), so the aggregates leave by a socket of their own. Checked with a
    documentation address (TEST-NET-2: routed out, answered by no one) and with this
    machine's own outward address (received)."""
    addr = _outward_address()
    if addr is None:
        pytest.skip("no route but loopback")
    beat = format_beat(Beat(0, "n1", 5, os.getpid(), 0.1, seq=1), beat_key(SECRET))
    agg = Aggregator("n1", SECRET, ("198.51.100.1", 9))
    try:
        assert agg.take(beat, time.monotonic())
        assert agg.send(time.monotonic()) == 1
        assert agg.send_error == ""
    finally:
        agg.close()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sup:
        sup.bind((addr, 0))
        sup.settimeout(5)
        agg = Aggregator("n1", SECRET, sup.getsockname())
        try:
            assert agg.take(beat, time.monotonic())
            assert agg.send(time.monotonic()) == 1
            got = parse_agg(sup.recv(65536), KEY)
            assert got is not None and [r.rank for r in got.ranks] == [0]
        finally:
            agg.close()


# Another user of the node (setuid in the child once its modules are loaded: the test's
# interpreter is not readable by nobody), without the step's secret.
FORGER = """
import os, socket, sys
from bluevela.protocol.keys import beat_key
from bluevela.protocol.messages import Beat, format_beat
os.setgroups([]); os.setgid(65534); os.setuid(65534)
assert os.getuid() == 65534
port = int(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for key in (beat_key(b"guess" * 6 + b"xx"), b""):
    s.sendto(format_beat(Beat(0, "n1", 5, 4242, 999.0, seq=10**6), key), ("127.0.0.1", port))
s.sendto(b"bvhb2 0 n1 5 4242 1 999000 0 x", ("127.0.0.1", port))
"""


def test_a_beat_from_another_user_or_a_replay_does_not_pass(tmp_path: Path) -> None:
    """Any user of the node can send to the agent's loopback port; without the step's secret
    nothing they send counts, and a real beat sent twice counts once."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sup:
        sup.bind(("127.0.0.1", 0))
        agg = Aggregator("n1", SECRET, sup.getsockname())
        try:
            port = agg.sock.getsockname()[1]
            done = subprocess.run([sys.executable, "-P", "-c", FORGER, str(port)],
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            time.sleep(0.1)
            assert agg.read(time.monotonic()) == 0 and agg.refused == 3 and agg.ranks == {}
            beat = format_beat(Beat(0, "n1", 5, os.getpid(), 0.1, seq=3), beat_key(SECRET))
            assert parse_beat(beat, beat_key(SECRET)) is not None
            assert agg.take(beat, time.monotonic())
            assert not agg.take(beat, time.monotonic())  # the same beat again: a replay
            older = format_beat(Beat(0, "n1", 4, os.getpid(), 0.1, seq=2), beat_key(SECRET))
            assert not agg.take(older, time.monotonic())
            assert agg.ranks[0][0].step == 5
        finally:
            agg.close()


# -- the real supervisor, its real agent, a worker that stops ----------------------------------

def test_a_hung_worker_beats_to_its_agent_and_is_named(tmp_path: Path) -> None:
    """c086bc4: the worker's BV_HEARTBEAT was the supervisor's own port (8 N datagrams into
    one socket); now it is its agent's loopback port, checkpoints still go to the
    supervisor, and the watchdog names the stalled rank and its node from the aggregates."""
    record = ("import os\n"
              "out, node = os.environ['BV_TEST_DIR'], os.environ.get('SLURMD_NODENAME', '?')\n"
              "with open(os.path.join(out, 'hb.' + node), 'w') as fh:\n"
              "    fh.write(os.environ.get('BV_HEARTBEAT', '') + ' '\n"
              "             + os.environ.get('BV_CHECKPOINT_ADDR', ''))\n")
    job = Job(tmp_path, nodes=("n1",), mode="stall", options=["--hang-timeout=2"],
              extra_env={"BV_TEST_WORKER": record + WORKER}).start()
    try:
        job.wait_ready()
        hb, ckpt = (tmp_path / "hb.n1").read_text().split()
        udp = job.addrs()[1]
        assert hb.startswith("127.0.0.1:") and int(hb.rpartition(":")[2]) != udp[1], hb
        assert ckpt.endswith(f":{udp[1]}"), ckpt
        hang = re.compile(r"ended: hang: rank 0 on n1 stopped first")
        deadline = time.monotonic() + 30
        while not hang.search(job.stdout()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hang.search(job.stdout()), job.stdout() + job.stderr()
    finally:
        job.kill()


def test_secrets_differ_per_key_use() -> None:
    """The agents' key is its own: a rank's beat key cannot sign an aggregate."""
    secret = secrets.token_bytes(32)
    assert agg_key(secret) != beat_key(secret)


def test_a_ranks_end_is_sent_at_once_even_when_its_process_is_gone() -> None:
    """How a rank's training ended (finished(): state 2, or 3 at bv's checkpoint request) must
    reach the supervisor, which decides on it whether a late checkpoint signal requeues the
    job: the agent sends it at its next turn, not an interval later, and once more after the
    rank's process has exited (a dead rank is otherwise forgotten at once)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    agg = Aggregator("n1", SECRET, ("127.0.0.1", 9))
    try:
        for seq, (finished, at_request) in enumerate(((False, False), (True, False)), start=1):
            beat = Beat(rank=0, node="n1", step=5, pid=dead.pid, seq=seq, finished=finished,
                        at_request=at_request)
            assert agg.take(format_beat(beat, beat_key(SECRET)), time.monotonic())
        assert agg.news == {0}  # the end is news: the agent's loop sends at once
        (data,) = agg.datagrams(time.monotonic())
        sent = parse_agg(data, KEY)
        assert sent is not None and [(r.rank, r.finished, r.at_request) for r in sent.ranks] == [
            (0, True, False)]
        assert agg.datagrams(time.monotonic()) == [] and not agg.ranks  # then forgotten
        # State 3 (it stopped at the request) travels the same way.
        beat = Beat(rank=1, node="n1", step=5, pid=dead.pid, seq=1, finished=True,
                    at_request=True)
        assert agg.take(format_beat(beat, beat_key(SECRET)), time.monotonic())
        (data,) = agg.datagrams(time.monotonic())
        sent = parse_agg(data, KEY)
        assert sent is not None and [(r.rank, r.at_request) for r in sent.ranks] == [(1, True)]
    finally:
        agg.close()
