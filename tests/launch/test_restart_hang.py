"""An in-place restart of the workers (torchrun --max-restarts) is not a hang (issue 33).

The real supervisor and node agent on stand-ins (tests/supervisor_standins.py), with a
torchrun stand-in that restarts its worker once it fails, as torchrun does: the first worker
beats, then dies without a `finished` beat (torchrun's SIGTERM, an OOM); the second takes
longer than --hang-timeout to load its checkpoint before its first beat. Before issue 33 the
supervisor kept the dead worker's last beat and declared "hang: rank 0 on n1 stopped first"
during the load; now the agent says the rank's process went away (`gone`) and the watchdog
waits for the new process's first beat, as it does at a step's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.supervisor_standins import Job, _script

HANG_S = 2.0
LOAD_S = 5.0  # the restarted worker's checkpoint load: well over the hang timeout

RESTARTING_TORCHRUN = """
import os, subprocess, sys
out = os.environ["BV_TEST_DIR"]
env = {**os.environ, "LOCAL_RANK": "0", "RANK": os.environ.get("SLURM_PROCID", "0")}
for restart in range(2):  # --max-restarts=1
    env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    rc = subprocess.Popen([sys.executable, "-P", "-c", WORKER], env=env).wait()
    if rc == 0:
        break
sys.exit(rc)
"""

WORKER = f"""
import os, time
from bluevela.runtime import progress
out = os.environ["BV_TEST_DIR"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for step in range(8):
        progress(step)
        time.sleep(0.25)
    open(os.path.join(out, "crashed"), "w").close()
    os._exit(1)  # a worker failure: no finished beat
time.sleep({LOAD_S})  # the restarted worker loads its checkpoint: no beat meanwhile
for step in range(8, 16):
    progress(step)
    time.sleep(0.25)
open(os.path.join(out, "trained"), "w").close()
"""


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    job = Job(tmp_path, ("n1",), options=[f"--hang-timeout={HANG_S:g}"])
    _script(job.bin / "torchrun", f"WORKER = {WORKER!r}\n" + RESTARTING_TORCHRUN)
    try:
        yield job
    finally:
        if job.running():
            job.kill()


def test_a_slow_restart_of_the_workers_is_not_read_as_a_hang(job: Job) -> None:
    job.start()
    rc = job.wait(60)
    out, err = job.stdout(), job.stderr()
    assert "hang:" not in out + err, out + err
    assert rc == 0, out + err
    assert (job.dir / "crashed").exists() and (job.dir / "trained").exists()
    assert "rank(s) 0 on n1 restarted" in err, err


def test_the_agent_names_a_rank_whose_process_went_away_unfinished() -> None:
    """Only a rank that ended before its training did (a restart) is reported; a finished one
    is the training's end, kept for the late-signal rule (tests/launch/test_late_signal.py)."""
    import subprocess
    import sys

    from bluevela.launch.agent import Aggregator
    from bluevela.protocol.keys import beat_key
    from bluevela.protocol.messages import Beat, format_beat

    secret = b"s" * 32
    dead = [subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]
    agg = Aggregator("n1", secret, ("127.0.0.1", 9))
    try:
        assert agg.take(format_beat(Beat(0, "n1", 5, int(dead[0]), seq=1), beat_key(secret)), 0)
        assert agg.take(format_beat(Beat(1, "n1", 9, int(dead[1]), seq=1, finished=True),
                                    beat_key(secret)), 0)
        agg.datagrams(1.0)
        assert agg.restarted == {(0, int(dead[0]))} and agg.ranks == {}
    finally:
        agg.close()


def test_the_watchdog_forgets_only_the_nodes_own_unfinished_ranks() -> None:
    from bluevela.launch.events_log import EventLog
    from bluevela.launch.step import Endpoints, Signals, Step, StepConfig, StepState
    from bluevela.launch.watchdog import RankBeat

    signals = Signals()
    ends = Endpoints(["n1"], "localhost", signals)
    try:
        st = StepState(nodes=["n1", "n2"], started=0.0, max_ranks=4)
        step = Step(st, None, ends, signals, EventLog(None, "h"), "h", StepConfig())  # type: ignore[arg-type]
        for rank, node, finished in ((0, "n1", False), (1, "n1", True), (2, "n2", False)):
            st.record(rank, RankBeat(node, 7, 1.0, finished=finished))
        step._forget("n1", [[0, 100], [1, 101], [2, 102], "x", [3, -1]])
        assert sorted(st.beats) == [1, 2] and sorted(st.progress) == [1, 2]
        assert st.gone == {(0, 100)}
    finally:
        ends.close()
        signals.close()
