"""What each Slurm release really prints, parsed by bv (issue 34): the recordings under
tests/data/slurm/<release>/ were made by tests/record_slurm.py on the dev cluster running that
release (slurm/devcluster up --slurm REL; jobs.json says which job is which, when and where).
The same facts are asserted for every release recorded; a release without a folder is not
tested here (docs/install.md, "Slurm releases", says which were)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bluevela.launch.grow import support_problem
from bluevela.slurm.cli_client import (
    CliSlurmClient,
    parse_config,
    parse_job_fields,
    parse_reservation_line,
    parse_sacct_line,
    parse_squeue_job,
)
from bluevela.slurm.states import JobState
from tests.conftest import DATA

RELEASES = sorted(p.parent.name for p in (DATA / "slurm").glob("*/jobs.json"))


def _load(release: str) -> tuple[Path, dict[str, Any]]:
    folder = DATA / "slurm" / release
    return folder, json.loads((folder / "jobs.json").read_text())


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_json(release: str) -> None:
    folder, rec = _load(release)
    ids, work = rec["jobs"], rec["workdir"]
    data = json.loads((folder / "squeue.json").read_text())
    jobs = {j.job_id: j for j in (parse_squeue_job(raw) for raw in data["jobs"])}
    done = jobs[ids["completed"]]
    assert (done.state, done.exit_code, done.signal) == (JobState.COMPLETED, 0, None)
    assert len(done.nodes) == 2 and done.name == rec["hostile_name"]
    assert done.stdout == f"{work}/bv-{ids['completed']}.out"
    assert done.start_time and done.end_time and done.end_time >= done.start_time
    failed = jobs[ids["failed3"]]
    assert (failed.state, failed.exit_code, failed.signal) == (JobState.FAILED, 3, None)
    assert failed.reason == "NonZeroExitCode"
    killed = jobs[ids["cancelled"]]
    assert killed.state is JobState.CANCELLED and killed.exit_code in (None, 0)
    assert killed.stdout == f"{work}/out-killed-{ids['cancelled']:03d}.txt"
    requeued = jobs[ids["requeued"]]
    assert requeued.state is JobState.PENDING and requeued.restarts == 1 and requeued.requeue
    assert requeued.exit_code is None and requeued.signal is None
    held = jobs[ids["held"]]
    assert held.state is JobState.PENDING and held.nodes == () and held.start_time is None
    running = jobs[ids["running"]]
    assert running.state is JobState.RUNNING and running.nodes == (rec["running_node"],)
    assert running.exit_code is None and running.signal is None and running.start_time
    assert running.end_time is None or running.end_time > running.start_time  # time limit


COMPLETING = sorted(p.parent.name for p in (DATA / "slurm").glob("*/completing.json"))


@pytest.mark.parametrize("release", COMPLETING)
def test_a_completing_job_keeps_its_allocation(release: str) -> None:
    """A job that ended while one node's epilog has not: Slurm's `nodes` then names that node
    alone (24.11+ says the job is COMPLETED with a COMPLETING flag, 22.05 says COMPLETING).
    bv names the whole allocation: `bv submit --wait --json` once gave a 2-node job's nodes as
    ["node2"] on 24.11 (a CI run of test_ddp_two_nodes_two_procs)."""
    folder = DATA / "slurm" / release
    rec = json.loads((folder / "completing.json").read_text())
    raw = json.loads((folder / "squeue-completing.json").read_text())["jobs"][0]
    assert raw["nodes"] == ",".join(rec["completing"])  # the recording is what it says
    job = parse_squeue_job(raw)
    assert job.job_id == rec["job"]
    assert job.nodes == tuple(rec["allocated"])
    if isinstance(raw["job_state"], list):  # 24.11+: the outcome is known, the epilogs run on
        assert job.state is JobState.COMPLETED and job.exit_code == 0
    else:
        assert job.state is JobState.COMPLETING
    # Without job_resources (an older or trimmed reply): Slurm's own list, never nothing.
    bare = {k: v for k, v in raw.items() if k != "job_resources"}
    assert parse_squeue_job(bare).nodes == tuple(rec["completing"])


@pytest.mark.parametrize("release", RELEASES)
def test_sacct_records(release: str) -> None:
    """The jobcomp/filetxt record (`sacct -c`) of the jobs that ended."""
    folder, rec = _load(release)
    ids = rec["jobs"]
    got = [parse_sacct_line(line) for line in
           (folder / "sacct-c.txt").read_text().splitlines() if line.strip()]
    last = {info.job_id: info for info in got}
    # The job named with a space: Slurm's own reader of the jobcomp file (22.05 to 24.11 alike)
    # splits `Name=x'y $(id) JobState=...` at the space and prints no State: bv says UNKNOWN
    # (never terminal, never a wrong state) for such a job once slurmctld has forgotten it.
    hostile = last[ids["completed"]]
    assert hostile.state is JobState.UNKNOWN and hostile.exit_code is None
    assert hostile.nodes and hostile.end_time
    assert last[ids["failed3"]].state is JobState.FAILED and last[ids["failed3"]].exit_code == 3
    assert last[ids["cancelled"]].state is JobState.CANCELLED
    # The requeue wrote a record of the attempt that ended (bv folds it into the history).
    assert ids["requeued"] in last


@pytest.mark.parametrize("release", RELEASES)
def test_config_and_grow_fields(release: str) -> None:
    folder, rec = _load(release)
    config = parse_config((folder / "show-config.txt").read_text())
    assert config["SLURM_VERSION"].startswith(release + ".")
    # The dev cluster sets permit_job_expansion and PrologFlags=Alloc: 22.05 grows a job; on
    # the later releases the grown node never runs the job's steps (bv requeues instead).
    problem = support_problem(config)
    if release == "22.05":
        assert problem is None
    else:
        assert problem is not None and "PrologFlags=Alloc" in problem, problem
    job = str(rec["jobs"]["running"])
    fields = parse_job_fields((folder / "squeue-fields.txt").read_text(), job)
    assert fields["JobState"] == "RUNNING" and fields["NodeList"] == rec["running_node"]
    assert fields["NumNodes"] == "1" and fields["Partition"] == "debug"


@pytest.mark.parametrize("release", RELEASES)
def test_reservation_and_drained_node(release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, rec = _load(release)
    lines = (folder / "show-reservation-o.txt").read_text().splitlines()
    [resv] = [r for r in map(parse_reservation_line, lines) if r is not None]
    assert resv.name == "bv-drain-rec" and resv.nodes == (rec["drained_node"],)
    assert "MAINT" in resv.flags and resv.start_time is not None
    text = (folder / "sinfo-nodes.txt").read_text()
    monkeypatch.setattr(CliSlurmClient, "_run", lambda self, argv, **kw: text)
    nodes = {n.name: n for n in CliSlurmClient(retry_s=0).nodes()}
    drained = nodes[rec["drained_node"]]
    assert drained.drained and drained.reason == "bv: recorded drain"
    assert drained.partitions == ("debug",)
    assert not nodes[rec["running_node"]].drained


@pytest.mark.parametrize("release", RELEASES)
def test_resumed_node_reads_without_its_old_reason(release: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`scontrol update State=RESUME` of a drained node: 22.05 clears its reason, 24.11 keeps
    it on the idle node (sinfo %E still prints it). bv reads a reason only where the node is
    drained, down or failing, so a resumed node shows none on every release."""
    folder, rec = _load(release)
    text = (folder / "sinfo-resumed.txt").read_text()
    monkeypatch.setattr(CliSlurmClient, "_run", lambda self, argv, **kw: text)
    node = {n.name: n for n in CliSlurmClient(retry_s=0).nodes()}[rec["drained_node"]]
    assert (node.state, node.reason, node.drained) == ("IDLE", "", False)
