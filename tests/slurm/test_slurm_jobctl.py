"""The in-job supervisor's Slurm calls (bluevela/slurm/jobctl.py) against a real stand-in
`scontrol` on PATH (a script that records its argv and answers as told): bounded tries,
retries with backoff while slurmctld is unreachable, none for a permanent refusal, a stop
when the job is ending, and never an exception."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bluevela.slurm.command import retry_budget
from bluevela.slurm.jobctl import JobControl
from tests.conftest import standin_command

SCONTROL = """#!/bin/sh
echo "$@" >> "$BV_TEST_LOG"
n=$(wc -l < "$BV_TEST_LOG")
case "$BV_TEST_MODE" in
  ok) echo done; exit 0 ;;
  hang) exec sleep 30 ;;
  invalid) echo "scontrol: error: Invalid job id specified" >&2; exit 1 ;;
  refuse:*) if [ "$n" -le "${BV_TEST_MODE#refuse:}" ]; then
      echo "scontrol: error: Unable to contact slurm controller (connect failure)" >&2; exit 1
    fi; echo requeued; exit 0 ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return standin_command(tmp_path, monkeypatch, "scontrol", SCONTROL)


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_a_restarting_slurmctld_is_retried_with_backoff(
        scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "refuse:2")
    waits: list[float] = []
    ctl = JobControl("77", {}, timeout_s=5, retry_for_s=30,
                     wait=lambda s: waits.append(s) is not None)
    done = ctl.requeue()
    assert done.ok and done.tries == 3 and done.stdout == "requeued\n", done
    assert waits == [0.5, 1.0]
    assert calls(scontrol) == ["requeue 77"] * 3


def test_a_permanent_refusal_is_not_retried(scontrol: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "invalid")
    done = JobControl("77", {}, wait=lambda s: pytest.fail("no retry")).keep_only("n[1-2]")
    assert not done.ok and done.tries == 1 and "Invalid job id" in done.why, done
    assert calls(scontrol) == ["update JobId=77 NodeList=n[1-2]"]


def test_a_hung_slurmctld_is_cut_per_try_and_within_the_budget(
        scontrol: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "hang")
    started = time.monotonic()
    done = JobControl("77", {}, timeout_s=1, retry_for_s=2.2,
                      wait=lambda s: time.sleep(s) is not None).requeue()
    assert time.monotonic() - started < 6
    assert not done.ok and not done.terminated and done.tries == 2, done
    assert done.why == "timed out after 1 s" and "2 tries" in done.describe()


def test_the_jobs_end_stops_the_retries(scontrol: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_TEST_MODE", "refuse:9")
    done = JobControl("77", {}, wait=lambda s: True).requeue()
    assert done.terminated and not done.ok and done.tries == 1, done


def test_no_scontrol_is_one_answer_not_an_exception(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    done = JobControl("77", {}).requeue()
    assert not done.ok and done.tries == 1 and done.why.startswith("cannot run scontrol"), done


def test_the_budget_ends_before_the_time_limit() -> None:
    assert retry_budget({"SLURM_JOB_END_TIME": "1060"}, 300, 1000.0) == 50
    assert retry_budget({"SLURM_JOB_END_TIME": "1005"}, 300, 1000.0) == 1.0
    assert retry_budget({"SLURM_JOB_END_TIME": "soon"}, 300, 1000.0) == 300
