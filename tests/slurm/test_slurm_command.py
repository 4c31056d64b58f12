"""The job side's one seam to Slurm (bluevela/slurm/command.py, issue 38), with stand-in
Slurm commands on PATH written here (real subprocesses, no mock of subprocess): one that
fails N times then answers, one that hangs past the bound, one that prints garbage. The
grow's commands (launch/grow.py) and the goodput events' squeue (launch/events_log.py) go
through it: before, the grow tried each command once and a byte that is not UTF-8 raised
out of the grow and out of the supervisor's event log."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bluevela.launch import events_log, grow
from bluevela.slurm.command import run_slurm
from bluevela.slurm.jobctl import JobControl
from tests.conftest import DATA, standin_command

CONFIG = DATA / "slurm" / "show-config-22.05.txt"  # the dev cluster's: it can grow jobs
UNREACHABLE = "scontrol: error: Unable to contact slurm controller (connect failure)"

# Fails the first $BV_TEST_FAIL calls as a restarting slurmctld does, then answers.
FLAKY = f"""#!/bin/sh
echo "$@" >> "$BV_TEST_LOG"
n=$(wc -l < "$BV_TEST_LOG")
if [ "$n" -le "$BV_TEST_FAIL" ]; then echo "{UNREACHABLE}" >&2; exit 1; fi
cat "$BV_TEST_ANSWER"
"""
HANG = """#!/bin/sh
echo "$@" >> "$BV_TEST_LOG"
echo "salloc: Pending job allocation 4242" >&2
exec sleep 30
"""
# Not UTF-8, control characters, no newline at the end; exit as told.
GARBAGE = """#!/bin/sh
echo "$@" >> "$BV_TEST_LOG"
printf '\\377\\376\\033[2J|\\000|x' >&2
printf '\\377\\376|\\001|\\377'
exit "$BV_TEST_EXIT"
"""


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def _flaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, fail: int,
           answer: Path) -> Path:
    monkeypatch.setenv("BV_TEST_FAIL", str(fail))
    monkeypatch.setenv("BV_TEST_ANSWER", str(answer))
    return standin_command(tmp_path, monkeypatch, name, FLAKY)


def test_a_restarting_slurmctld_is_retried_until_it_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _flaky(tmp_path, monkeypatch, "scontrol", 2, CONFIG)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return False

    call = run_slurm(["scontrol", "show", "config"], timeout_s=5, retry_for_s=30, wait=wait)
    assert call.ok and call.tries == 3 and call.status == 0 and call.why == "", call
    assert "permit_job_expansion" in call.stdout and waits == [0.5, 1.0]
    assert _calls(log) == ["show config"] * 3


def test_the_grow_retries_slurm_as_the_requeue_does(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the grow's `scontrol show config` was tried once, and slurmctld restarting
    failed the grow at once ("scontrol show config: ... Unable to contact slurm
    controller"). Now it is retried and the grow goes on (here to squeue, which knows no job
    5)."""
    log = _flaky(tmp_path, monkeypatch, "scontrol", 2, CONFIG)
    standin_command(tmp_path, monkeypatch, "squeue", "#!/bin/sh\nexit 0\n")
    res = grow.grow("5", ["node1"], ["node2"], 15)
    assert not res.ok and res.why == "squeue -j 5: no such job" and res.left == [], res
    assert _calls(log) == ["show config"] * 3


def test_a_command_that_makes_a_job_is_tried_once(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A salloc whose answer was lost may have made a helper job: a retry would make a
    second one."""
    log = _flaky(tmp_path, monkeypatch, "salloc", 5, CONFIG)
    call = grow.run_cli(["salloc", "--no-shell", "--nodes=1"], 20)
    assert not call.ok and call.tries == 1 and call.status == 1 and call.answered is False
    assert call.why == f"exit 1: {UNREACHABLE}" and _calls(log) == ["--no-shell --nodes=1"]


def test_a_hung_command_is_cut_at_its_bound(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    log = standin_command(tmp_path, monkeypatch, "scontrol", HANG)
    t0 = time.monotonic()
    call = run_slurm(["scontrol", "ping"], timeout_s=1, retry_for_s=2.5)
    assert time.monotonic() - t0 < 6
    assert not call.ok and call.timed_out and call.status is None and not call.answered
    assert call.tries == 2 and call.why == "timed out after 1 s", call
    assert _calls(log) == ["ping", "ping"]
    # The grow's bound is all tries of a command; a timed-out salloc keeps what it printed
    # (the helper job it made, which the grow then cancels).
    standin_command(tmp_path, monkeypatch, "salloc", HANG)
    t0 = time.monotonic()
    call = grow.run_cli(["salloc", "--no-shell"], 1.5)
    assert time.monotonic() - t0 < 6 and call.timed_out and call.tries == 1, call
    assert grow.granted_job(call.stderr + call.stdout) == "4242", call.stderr


def test_a_refusal_is_typed_and_printable(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_EXIT", "1")
    standin_command(tmp_path, monkeypatch, "scontrol", GARBAGE)
    call = run_slurm(["scontrol", "update", "JobId=7", "NodeList=n1"], timeout_s=5,
                     retry_for_s=30, wait=lambda s: True)  # the job ends before a retry
    assert call.terminated and call.tries == 1 and not call.ok
    assert call.status == 1 and call.argv == ("scontrol", "update", "JobId=7", "NodeList=n1")
    assert call.command == "scontrol update" and call.why.startswith("exit 1: ")
    assert call.why.isascii() and call.why.isprintable(), call.why


def test_garbage_from_slurm_is_data_not_a_crash(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a byte that is not UTF-8 raised UnicodeDecodeError out of the grow (its
    commands were decoded strictly) and out of the event log's `slurm_times`, at the
    supervisor's start."""
    monkeypatch.setenv("BV_TEST_EXIT", "0")
    for name in ("scontrol", "squeue", "scancel"):
        log = standin_command(tmp_path, monkeypatch, name, GARBAGE)
    assert events_log.slurm_times("5", timeout=5) == {"submit": None, "start": None,
                                                     "time_limit_s": None}
    assert JobControl("5", {}).time_left() is None
    res = grow.grow("5", ["node1"], ["node2"], 5)
    assert not res.ok and "cannot grow jobs" in res.why and res.left == [], res
    assert res.why.isascii() and res.why.isprintable()
    monkeypatch.setenv("BV_TEST_EXIT", "1")
    note = grow.readiness(30.0, run=lambda argv, timeout, cwd: run_slurm(argv, timeout_s=5))
    assert note is not None and "is unknown (scontrol show config: exit 1: " in note
    assert note.isascii() and note.isprintable(), note
    assert "show config" in _calls(log)
