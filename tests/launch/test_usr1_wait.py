"""The wait for a worker's SIGUSR1 handler follows the job's time left (issue 25; docs/byos.md,
"How the checkpoint signal reaches a framework"; bluevela/launch/usr1_wait.py).

Pure: the wait's formula, "near the time limit", the checkpoint request's ``left_s`` field
(strict), squeue's durations. Real processes: `JobControl.time_left` against a stand-in
``squeue`` on PATH, and the REAL supervisor and agent on stand-ins (tests/supervisor_standins.py)
told by Slurm's stand-in that 50 s are left: one squeue, a 5 s wait, the end line says so."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from bluevela.launch.usr1_wait import (
    STOP_MARGIN_S,
    USR1_UNCAUGHT_S,
    USR1_WAIT_CAP_S,
    LimitClock,
    explicit_wait,
    handler_wait,
    request_left,
    time_limit_near,
    usr1_request,
)
from bluevela.protocol.channel import Channel
from bluevela.slurm.jobctl import JobControl, parse_time_left, slurm_duration
from tests.conftest import standin_command
from tests.supervisor_standins import Job


def test_the_margin_is_torchruns_grace_and_bvs_requeue() -> None:
    assert STOP_MARGIN_S == 45 and USR1_WAIT_CAP_S == 120 and USR1_UNCAUGHT_S == 30


@pytest.mark.parametrize(("explicit", "left", "wait"), [
    (None, None, 30),  # no time limit near (an operator's bv requeue): as before
    (None, 10_000, 120),  # capped
    (None, 180, 120),  # --signal-before 120, Slurm 60 s early
    (None, 165, 120),
    (None, 120, 75),  # --signal-before 120 on time
    (None, 105, 60),
    (None, 75, 30),  # the old 30 s, exactly what the time left allows
    (None, 60, 15),  # --signal-before 60 on time: the time left forces less than 30 s
    (None, 46, 1),
    (None, 45, 0),  # nothing left for a wait: the stop at once
    (None, 10, 0),
    (None, 0, 0),
    (60, 50, 60),  # the job's BV_USR1_WAIT_S wins, even over the time left
    (5, 10_000, 5),
    (0, None, 0),
    (600, None, 600),
])
def test_handler_wait(explicit: float | None, left: float | None, wait: float) -> None:
    assert handler_wait(explicit, left) == wait


@pytest.mark.parametrize(("text", "value"), [
    ("60", 60.0), ("0", 0.0), ("600", 600.0), ("2.5", 2.5), ("601", None), ("-1", None),
    ("nan", None), ("inf", None), ("abc", None), ("", None), (None, None), ("1" * 30, None),
])
def test_explicit_wait(text: str | None, value: float | None) -> None:
    assert explicit_wait(text) == value


@pytest.mark.parametrize(("left", "limit", "near"), [
    (180, 7200, True),  # --signal-before 120, 60 s early
    (300, None, True),
    (301, None, False),  # limit unknown: the ledger's 300 s window
    (3500, 3600, False),  # bv requeue at the start of a 1 h job
    (600, 86400, True),  # 10% of a day: within 2.4 h of the end
    (8640, 86400, True),
    (8641, 86400, False),
    (0, 120, True),
])
def test_time_limit_near_is_the_ledgers_test(left: float, limit: float | None,
                                             near: bool) -> None:
    assert time_limit_near(left, limit) is near


@pytest.mark.parametrize(("time_left", "msg"), [
    (None, {"t": "usr1"}),  # Slurm said nothing: as before
    ((165.9, 7200.0), {"t": "usr1", "left_s": 165}),  # rounded down: never late
    ((3500.0, 3600.0), {"t": "usr1"}),  # an operator's bv requeue far from the limit
    ((0.4, 120.0), {"t": "usr1", "left_s": 0}),
])
def test_the_request_carries_the_time_left_only_near_the_limit(
        time_left: tuple[float, float | None] | None, msg: dict[str, object]) -> None:
    assert usr1_request(time_left) == msg


@pytest.mark.parametrize(("field", "left"), [
    (90, 90), (0, 0), (10 * 366 * 86400, 10 * 366 * 86400),
    (-1, None), (10 * 366 * 86400 + 1, None), (10**30, None), (True, None), (90.0, None),
    ("90", None), (None, None), ([90], None),
])
def test_the_requests_field_is_strict(field: object, left: int | None) -> None:
    assert request_left({"t": "usr1", "left_s": field}) == left
    assert request_left({"t": "usr1"}) is None


def test_the_field_crosses_the_signed_channel() -> None:
    """The request as the supervisor sends it reads back on the agent's side of a real
    channel (an old agent reads only `t`; a new agent without the field waits 30 s)."""
    a, b = socket.socketpair()
    try:
        key, nonce = os.urandom(32), os.urandom(16)
        sup, agent = Channel(a, key, nonce, b"s"), Channel(b, key, nonce, b"a")
        sup.send(usr1_request((100.0, 600.0)))
        got = agent.feed(b.recv(4096))
    finally:
        a.close()
        b.close()
    assert got == [{"t": "usr1", "left_s": 100}]
    assert handler_wait(None, request_left(got[0])) == 55


@pytest.mark.parametrize(("text", "seconds"), [
    ("0:00", 0), ("1:59", 119), ("59:58", 3598), ("1:59:58", 7198), ("2-00:00:00", 172800),
    ("1-23:59:59", 172799), ("UNLIMITED", None), ("INVALID", None), ("NOT_SET", None),
    ("1:60", None), ("60:00:00", None), ("1:5", None), ("-1:00", None), ("1:00 ", None),
    ("123456-00:00:00", None), ("", None),
])
def test_slurm_duration(text: str, seconds: int | None) -> None:
    assert slurm_duration(text) == seconds


@pytest.mark.parametrize(("stdout", "got"), [
    ("1:59|2:00\n", (119.0, 120.0)),
    ("2:00:00|1-00:00:00\n", (7200.0, 86400.0)),
    ("1:59|UNLIMITED\n", (119.0, None)),
    ("UNLIMITED|UNLIMITED\n", None),
    ("INVALID|2:00\n", None),
    ("", None),
    ("1:59|2:00\n1:59|2:00\n", None),  # two jobs: not ours to pick
    ("1:59\n", None),
    ("1:59|2:00|3:00\n", None),
    ("1:59|" + "9" * 200 + "\n", None),
])
def test_parse_time_left(stdout: str, got: tuple[float, float | None] | None) -> None:
    assert parse_time_left(stdout) == got


SQUEUE = """#!/bin/sh
echo "$@" >> "$BV_TEST_LOG"
case "$BV_TEST_MODE" in
  ok) echo "2:30|5:00" ;;
  unknown) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
  hang) exec sleep 30 ;;
esac
"""


@pytest.fixture
def squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return standin_command(tmp_path, monkeypatch, "squeue", SQUEUE)


def test_time_left_is_one_squeue(squeue: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "ok")
    assert JobControl("77", {}).time_left() == (150.0, 300.0)
    assert squeue.read_text().splitlines() == ["-h -j 77 -o %L|%l"]


def test_time_left_falls_back_on_slurm_job_end_time(squeue: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "unknown")
    got = JobControl("77", {"SLURM_JOB_END_TIME": str(int(time.time()) + 200)}).time_left()
    assert got is not None and 190 <= got[0] <= 201 and got[1] is None, got
    assert JobControl("77", {"SLURM_JOB_END_TIME": "soon"}).time_left() is None
    assert JobControl("77", {}).time_left() is None
    assert len(squeue.read_text().splitlines()) == 3  # one try each, no retry


def test_a_hung_squeue_is_cut_at_the_timeout(squeue: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "hang")
    started = time.monotonic()
    assert JobControl("77", {}, timeout_s=1).time_left() is None
    assert time.monotonic() - started < 20  # cut at 1 s, not squeue's 30 s sleep


def test_the_clock_asks_slurm_once() -> None:
    asked: list[int] = []

    def learn() -> tuple[float, float | None]:
        asked.append(1)
        return 100.0, 600.0

    clock = LimitClock(learn)
    first = clock.left()
    time.sleep(0.05)
    second = clock.left()
    assert len(asked) == 1
    assert first is not None and second is not None
    assert 99 <= first[0] <= 100 and second[0] < first[0] and second[1] == 600.0
    assert LimitClock(lambda: None).left() is None


# The REAL supervisor and agent: a worker that never installs a SIGUSR1 handler.
NO_HANDLER_WORKER = """
import os, time
out, node = os.environ["BV_TEST_DIR"], os.environ.get("SLURMD_NODENAME", "?")
open(os.path.join(out, "ready." + node), "w").close()
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.1)
"""




def test_the_supervisor_passes_the_time_left_and_the_wait_follows(
        tmp_path: Path, jobs: list[Job]) -> None:
    """Slurm's time-limit SIGUSR1 with 50 s left (the stand-in squeue says so): the supervisor
    asks squeue once, its request carries the time left, the agent holds the signal 5 s
    (50 - 45), not 30, then torchrun gets SIGTERM; the end line says the wait."""
    job = Job(tmp_path, ("n1",), extra_env={"BV_TEST_WORKER": NO_HANDLER_WORKER,
                                            "BV_TEST_SQUEUE": "0:50|2:00"})
    jobs.append(job)
    job.start().wait_ready()
    asked = time.monotonic()
    os.kill(job.pid, signal.SIGUSR1)
    ended = job.wait_end(25)  # the old 30 s wait cannot make it
    took = time.monotonic() - asked
    waited = re.search(r"1 worker\(s\) had no handler for it after (\d+) s", ended[0])
    assert waited is not None, ended[0]
    # 50 s left less the 45 s margin; a second less when squeue's answer took a while.
    assert 3 <= int(waited.group(1)) <= 5, ended[0]
    assert took >= int(waited.group(1)), took
    assert "requeued by bv" in ended[0], ended[0]
    calls = (tmp_path / "squeue.log").read_text().splitlines()
    assert calls.count("-h -j 77 -o %L|%l") == 1, calls
    deadline = time.monotonic() + 20
    while job.scontrol() != ["requeue 77"]:
        assert time.monotonic() < deadline, job.scontrol()
        time.sleep(0.1)
    os.kill(job.pid, signal.SIGTERM)  # Slurm ends the requeued allocation
    assert job.wait(30) == 0
