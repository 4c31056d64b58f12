"""Parsing what Slurm prints, on recorded output (22.05) and the 24.11 dialect."""

from __future__ import annotations

import json

import pytest

from bluevela.slurm.cli_client import parse_sacct_line, parse_squeue_job
from bluevela.slurm.states import JobState
from tests.conftest import DATA


def _jobs(name: str) -> dict[int, object]:
    data = json.loads((DATA / "slurm" / name).read_text())
    return {j.job_id: j for j in (parse_squeue_job(raw) for raw in data["jobs"])}


def test_squeue_2205_recorded() -> None:
    jobs = _jobs("squeue-22.05.8.json")
    done, failed = jobs[2], jobs[3]
    assert done.state is JobState.COMPLETED and done.exit_code == 0
    assert done.nodes == ("node1", "node2")
    assert done.name == "x'y $(id)"
    assert done.stdout == "/tmp/bvt/bv-2.out"  # %j expanded
    assert failed.state is JobState.FAILED and failed.exit_code == 3  # raw 768
    assert jobs[1].state is JobState.CANCELLED and jobs[1].restarts == 1


def test_squeue_2411_dialect() -> None:
    jobs = _jobs("squeue-24.11-dialect.json")
    assert jobs[41].state is JobState.FAILED and jobs[41].exit_code == 3
    assert jobs[41].nodes == ("node2", "node3") and jobs[41].restarts == 1
    assert jobs[41].start_time == 1764100000
    assert jobs[42].state is JobState.CANCELLED and jobs[42].signal == 9
    assert jobs[42].stdout == "/home/alice/out-killed-042.txt"
    pending = jobs[43]
    assert pending.state is JobState.PENDING and pending.exit_code is None and pending.nodes == ()
    assert pending.start_time is None


def test_sacct_line() -> None:
    info = parse_sacct_line("17|FAILED|3:0|node[1-3]|debug|root|2026-01-01T00:00:00|2026-01-01T00:01:00")
    assert info.job_id == 17 and info.exit_code == 3 and info.signal is None
    assert info.nodes == ("node1", "node2", "node3")
    sig = parse_sacct_line("18|CANCELLED by 0|0:15|node1|debug|root|x|y")
    assert sig.state is JobState.CANCELLED and sig.signal == 15


@pytest.mark.parametrize(("name", "state", "terminal"), [
    ("COMPLETED", JobState.COMPLETED, True), ("CANCELLED by 1000", JobState.CANCELLED, True),
    ("CD", JobState.COMPLETED, True), ("PENDING", JobState.PENDING, False),
    ("REQUEUED", JobState.REQUEUED, False), ("TIMEOUT", JobState.TIMEOUT, True),
    ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY, True), ("bogus", JobState.UNKNOWN, False),
])
def test_state_table(name: str, state: JobState, terminal: bool) -> None:
    assert JobState.from_slurm(name) is state
    assert state.is_terminal() is terminal
