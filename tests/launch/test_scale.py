"""The REAL supervisor at 256 nodes x 8 ranks (issue 27): the scale harness
(benchmarks/scale_harness.py) plays 256 node agents on the signed channel, each sending one
signed aggregate of its 8 ranks' beats per beat interval (as `launch/agent.py` does), with
the step's own keys. Four launches of one supervisor: a start
storm and steady state, a save of all ranks, one agent's connection closed; a start storm,
one agent silent; a rank whose progress stops; every agent done.

On cd8e436 the first start storm cost 192 of the 256 agents ("more than 64 connections
without a hello"): the step never started; and with the supervisor's soft limit of open files
under the node count, agents past it were never accepted ("Too many open files").
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from scale_harness import RANKS_PER_NODE, run_scale  # noqa: E402

from bluevela.launch.agent import Aggregator  # noqa: E402
from bluevela.launch.supervisor import beat_interval, ping_interval  # noqa: E402
from bluevela.protocol.keys import agg_key, beat_key  # noqa: E402
from bluevela.protocol.messages import (  # noqa: E402
    Agg,
    AggRank,
    Beat,
    format_agg,
    format_beat,
    parse_agg,
    parse_beat,
)
from bluevela.runtime.heartbeat import interval  # noqa: E402

N = 256
NODE_TIMEOUT = 3.0
HANG_TIMEOUT = 4.0


def test_256_nodes_x_8_ranks(tmp_path: Path) -> None:
    # The supervisor starts with a soft limit of 128 open files (Slurm hands a job the
    # submit shell's limits; 1,024 is common, and a 1,024-node job needs more): it raises it.
    res = run_scale(tmp_path, N, node_timeout=NODE_TIMEOUT, hang_timeout=HANG_TIMEOUT,
                    steady_s=3.0, nofile=N // 2)
    f, out = res.figures, res.stdout
    why = f"{f}\n{out}\n{res.stderr[-3000:]}"
    assert res.rc == 0, why
    # No agent dropped: every storm released all 256 agents, none retried or closed on.
    for step in ("step1", "step2", "step3"):
        assert f[f"{step}.dropped"] == 0 and f[f"{step}.connect_retries"] == 0, why
        assert f[f"{step}.release_after_last_connect_s"] <= 2.0, why
    assert all(len(s.dropped) == 0 for s in res.steps), why
    # No false hang and no false loss: nothing was aborted before each failure was made.
    for step in ("step1", "step2", "step3"):
        assert f[f"{step}.aborts_before_failure"] == 0, why
    assert f["steady.beats_received_pct"] == 100.0, why
    # Each failure decided for what it was, within its timeout, naming the right node/rank.
    closed, silent = res.victims
    ends = re.findall(r"^==== bv attempt (\d) ended: (.*) ====$", out, re.M)
    assert [a for a, _ in ends] == ["1", "2", "3", "4"], why
    assert ends[0][1].startswith(f"{closed} lost (its agent's connection closed"), why
    assert ends[1][1].startswith(f"{silent} lost (silent for"), why
    rank, node = res.hung
    assert ends[2][1].startswith(f"hang: rank {rank} on {node} stopped first"), why
    assert ends[3][1] == "exit 0", why
    assert f["lost_closed.decision_s"] <= 1.0, why
    assert NODE_TIMEOUT - 0.5 <= f["lost_silent.decision_s"] <= NODE_TIMEOUT + 1, why
    assert HANG_TIMEOUT - 0.5 <= f["hang.decision_s"] <= HANG_TIMEOUT + 1, why
    # The save: every rank's checkpoint datagram folded into the one `ckpt` line, and the
    # epilog read the four launches back.
    assert f["save.ranks_recorded"] == N * RANKS_PER_NODE, why
    assert f["epilog.launches"] == 4, why


def test_the_harness_aggregates_are_the_agents_own_bytes() -> None:
    """The harness sends what each node's agent sends (`messages.format_agg`, one per node
    per interval): the bytes are exactly what `launch/agent.py`'s Aggregator sends for its
    ranks' beats."""
    secret = bytes(range(32))
    agg = Aggregator("sn00010", secret, ("127.0.0.1", 9))
    try:
        now = 1000.0
        pid = os.getpid()  # a live process: the agent forgets ranks whose process is gone
        for rank in range(8):
            beat = Beat(72 + rank, "sn00010", 1234, pid, 0.1234, False,
                        "train.py:120:train_step", seq=9)
            assert agg.take(format_beat(beat, beat_key(secret)), now - 0.5)
        mine = agg.datagrams(now)
        theirs = format_agg(Agg("sn00010", pid, 1, tuple(
            AggRank(72 + r, pid, 1234, 0.1234 + 0.5, False, "train.py:120:train_step")
            for r in range(8))), agg_key(secret))
        assert mine == [theirs]
        assert parse_agg(theirs, agg_key(secret)) is not None
    finally:
        agg.close()


def test_the_beat_and_ping_intervals_follow_the_timeouts() -> None:
    """A big job with a long hang timeout needs a fraction of the datagrams: an eighth of the
    timeout between beats, 0.25 to 10 s (no watchdog: every second, as before). Below 8 s
    the beats come faster than once a second since the agents aggregate them (a rank's
    record is a beat interval at the rank plus one at the agent old at most)."""
    assert [beat_interval(t) for t in (0, 1, 4, 8, 15, 60, 600)] == [1, 0.25, 0.5, 1, 1.875,
                                                                      7.5, 10]
    assert interval({"BV_HEARTBEAT_INTERVAL_S": "7.5"}) == 7.5
    # Pings: a fifth of the node timeout, 1 to 5 s (the default 10 s: every 2 s).
    assert [ping_interval(t) for t in (1, 3, 10, 25, 100)] == [1, 1, 2, 5, 5]
    for junk in ("", "0", "0.1", "61", "nan", "inf", "-1", "1e9", "x", "1" * 40):
        assert interval({"BV_HEARTBEAT_INTERVAL_S": junk}) == 1.0, junk


def _beats_in(tmp_path: Path, every: str, seconds: float) -> int:
    """Signed beats a real rank (`bluevela.runtime.progress`) sends in `seconds`."""
    secret = secrets.token_hex(32)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        udp.settimeout(0.1)
        env = {**os.environ, "BV_HEARTBEAT": f"127.0.0.1:{udp.getsockname()[1]}",
               "BV_JOB_SECRET": secret, "BV_HEARTBEAT_INTERVAL_S": every, "RANK": "3",
               "PYTHONPATH": str(REPO)}
        rank = subprocess.Popen([sys.executable, "-P", "-c", "import time\n"
                                 "from bluevela.runtime import progress\n"
                                 f"progress(1)\ntime.sleep({seconds})\n"], env=env, cwd=tmp_path)
        got = 0
        try:
            while rank.poll() is None:
                try:
                    data = udp.recv(2048)
                except TimeoutError:
                    continue
                beat = parse_beat(data, beat_key(bytes.fromhex(secret)))
                got += beat is not None and beat.rank == 3
        finally:
            rank.kill()
            rank.wait()
    return got


def test_a_rank_beats_at_the_interval_the_supervisor_sets(tmp_path: Path) -> None:
    """cd8e436: one beat a second whatever the job said (3 in 2.6 s here)."""
    assert _beats_in(tmp_path, "0.25", 2.6) >= 6
    assert _beats_in(tmp_path, "junk", 2.6) <= 4  # every second (3, or 4 on a slow exit)
