"""The ledger after a grow and a requeue (issue 33 section 4), with the real hooks, spool and
ingest.

Job 41 lost node2 in attempt 0; the supervisor grew node3 in through the helper job 42
(bluevela/launch/grow.py), node3 became the keeper of the events' copy, and Slurm then
requeued the job. node3 ran no prolog of job 41: its epilog reads which attempt it served
from Slurm's record (bluevela/slurm/job_record.py), since SLURM_JOB_RESTART_COUNT there is
already the next attempt's. Before, that epilog was filed under restart 1: the keeper's copy
(named for restart 0) was never collected, and node3's real epilog of attempt 1 was then
dropped at ingest as a "duplicate" of it. A report whose key is archived from another hook
run is now quarantined as a conflict, never dropped as a duplicate.

Slurm's answers here are what 22.05 printed on the dev cluster while the epilogs of a
requeued and of an ended job ran (the table in job_record.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bluevela.archive import query
from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import QUARANTINE_DIR, write_report
from bluevela.goodput.outcome import StepEnd
from bluevela.launch import events_copy, events_log
from bluevela.slurm import job_record
from tests.goodput.test_goodput_events import sticky_dir
from tests.hooks.test_hooks_run import make_node, run_hook

JOB, HELPER = 41, 42
SUBMIT = "2026-11-29T08:01:31"  # local time, as squeue prints it


def _fake_squeue(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A `squeue` on the hooks' PATH (BV_SLURM_BIN) that prints `answer` and logs its argv."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    answer, calls = tmp_path / "squeue.answer", tmp_path / "squeue.calls"
    answer.write_text("")
    script = bin_dir / "squeue"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\ncat {answer}\n')
    script.chmod(0o755)
    return bin_dir, answer, calls


def _answer(state: str, restarts: int, end: str) -> str:
    return f"{JOB}|{state}|{restarts}|{SUBMIT}|2026-11-29T08:01:40|{end}|\n"


def _supervisor_and_keeper(batch_events: Path, keeper_events: Path) -> None:
    """node1's supervisor (a real EventLog) of attempt 0: node2 lost, node3 grown in via job
    42, relaunched on node1 and node3, then the requeue; node3's agent keeps the copy (a real
    CopyWriter fed the lines the sender cuts). node1's own file is not used below: the copy
    alone must reach the archive."""
    env = {"SLURM_JOB_ID": str(JOB), "SLURM_RESTART_COUNT": "0",
           "BV_EVENTS_DIR": str(batch_events)}
    log = events_log.EventLog.open(env, "node1", query=False)
    now = time.monotonic()
    log.launch(1, 1, ["node1", "node2"], 0, now)
    log.step_ended(StepEnd.LOST, "node2 lost", {}, now, now, now)
    log.grown(str(HELPER), ["node3"])
    log.launch(2, 2, ["node1", "node3"], 0, now)
    log.step_ended(StepEnd.SIGNAL, "checkpoint signal", {}, now, now, now)
    log.requeue()
    log.close()
    (path,) = batch_events.glob(f"bv-goodput.{JOB}.r0.*.jsonl")
    keeper = events_copy.CopyWriter({"BV_EVENTS_DIR": str(keeper_events)}, "node3")
    for n, line in enumerate(path.read_bytes().splitlines(keepends=True)):
        for msg in events_copy.copy_messages(n, line):
            keeper.feed(msg)
    assert [p.name for p in keeper_events.glob("*.copy.jsonl")] == [keeper.name]
    assert f".{JOB}.r0." in keeper.name


def test_a_grown_node_after_a_requeue_files_its_epilog_under_the_attempt_it_served(
        tmp_path: Path) -> None:
    batch_events = sticky_dir(tmp_path / "events-node1")
    keeper_events = sticky_dir(tmp_path / "events-node3")
    _supervisor_and_keeper(batch_events, keeper_events)
    bin_dir, answer, calls = _fake_squeue(tmp_path)
    hook_env, base = make_node(tmp_path, BV_EVENTS_DIR=str(keeper_events),
                               BV_SLURM_BIN=str(bin_dir))
    spool = base / "spool"
    node3 = {"SLURMD_NODENAME": "node3", "SLURM_JOB_USER": "root",
             "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_PARTITION": "gpu"}
    helper = {**node3, "SLURM_JOB_ID": str(HELPER), "SLURM_NODELIST": "node3",
              "SLURM_JOB_NUM_NODES": "1"}
    job = {**node3, "SLURM_JOB_ID": str(JOB), "SLURM_NODELIST": "node[1,3]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_EXIT_CODE2": "0:0"}
    # The grow: the helper's prolog and epilog on node3 (the hand-over).
    assert run_hook("prolog", hook_env, helper).returncode == 0
    assert run_hook("epilog", hook_env, {**helper, "SLURM_JOB_EXIT_CODE2": "0:0"}).returncode == 0
    # Slurm requeues job 41: attempt 0's epilog on node3 runs with the next attempt's count,
    # while Slurm shows the job COMPLETING with no end (requeued).
    answer.write_text(_answer("COMPLETING", 1, "NONE"))
    p = run_hook("epilog", hook_env, {**job, "SLURM_JOB_RESTART_COUNT": "1"})
    assert p.returncode == 0, p.stderr
    assert f"-j {JOB} -O JobID:|,State:|" in calls.read_text()
    assert not (spool / f"{JOB}.node3.epilog.r1.json").exists(), \
        "attempt 0's epilog of the grown node was filed under the next attempt"
    first = json.loads((spool / f"{JOB}.node3.epilog.json").read_text())
    assert first["restart"] == 0
    # The keeper's copy of attempt 0's events is collected (and removed once spooled).
    rec = first["goodput_events"]
    assert rec["host"] == "node1" and rec["copy_on"] == "node3" and rec["restart"] == 0
    assert rec["grows"][0]["helper"] == HELPER and rec["requeue"] is not None
    assert list(keeper_events.glob("*.copy.jsonl")) == []
    # Slurm's own record goes with it (the ledger's queue wait starts at its submit time).
    sj = first["slurm_job"]
    assert sj["requeued"] is True and sj["restarts"] == 1
    assert sj["submit"] == time.mktime(time.strptime(SUBMIT, "%Y-%m-%dT%H:%M:%S"))

    # Attempt 1 runs on node3 as on any node: its prolog, then its epilog (the job ended).
    answer.write_text(_answer("COMPLETING", 1, "2026-11-29T08:09:00"))
    attempt1 = {**job, "SLURM_JOB_RESTART_COUNT": "1"}
    assert run_hook("prolog", hook_env, attempt1).returncode == 0
    assert run_hook("epilog", hook_env, attempt1).returncode == 0
    second = json.loads((spool / f"{JOB}.node3.epilog.r1.json").read_text())
    assert second["restart"] == 1 and "goodput_events" not in second

    # Ingested after each attempt (node1's reports beside node3's): both of node3's epilogs
    # are archived, each under its attempt; nothing is a duplicate or a conflict.
    archive = tmp_path / "archive"
    archive.mkdir()
    t = first["time"]
    for k, tk in ((0, t - 100), (1, second["time"] - 50)):
        for phase in ("prolog", "epilog"):
            r = sample_report(JOB, "node1", phase, nodelist="node[1,3]",
                              time=tk + (50 if phase == "epilog" else 0), user="root")
            r["restart"] = k
            write_report(spool, r)
        if k == 0:
            first_ingest = ingest(spool, archive, timeout_s=0.0, now=t + 10)
            assert first_ingest.conflicts == [] and first_ingest.duplicates == 0
    res = ingest(spool, archive, timeout_s=0.0, now=second["time"] + 10)
    assert res.duplicates == 0 and res.conflicts == [], res
    keys = {(r["node"], r["phase"], r["restart"]) for r in query.iter_reports(archive)
            if r["job_id"] == JOB}
    assert {("node3", "epilog", 0), ("node3", "epilog", 1), ("node3", "prolog", 1)} <= keys
    shown = query.show_job(archive, JOB)
    epilogs = [n["epilog"] for n in shown["nodes"] if n["node"] == "node3"]
    assert epilogs and epilogs[0]["restart"] == 1


def test_a_report_of_an_archived_key_from_another_run_is_a_conflict_not_a_duplicate(
        tmp_path: Path) -> None:
    """The same report again (the same hook run: a kill between the manifest and the move)
    stays a duplicate; another run's report under an archived key (the grown node's case
    before the fix) is quarantined with both times and counted, never dropped silently."""
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    t = 1_800_000_000.0
    reports = [sample_report(JOB, n, ph, nodelist=["node1", "node3"], time=t + i)
               for i, (n, ph) in enumerate((("node1", "prolog"), ("node3", "prolog"),
                                            ("node1", "epilog"), ("node3", "epilog")))]
    for r in reports:
        write_report(spool, r)
    assert ingest(spool, archive, timeout_s=0.0, now=t + 10).reports_ingested == 4
    write_report(spool, reports[3])  # the same run's report again: a duplicate
    res = ingest(spool, archive, timeout_s=0.0, now=t + 20)
    assert res.duplicates == 1 and res.conflicts == [] and res.quarantined == []
    later = sample_report(JOB, "node3", "epilog", nodelist=["node1", "node3"], time=t + 900,
                          exit_code=3)
    write_report(spool, later)  # another run's report under the same key
    res = ingest(spool, archive, timeout_s=0.0, now=t + 1000)
    assert res.duplicates == 0 and res.reports_ingested == 0
    ((name, why),) = res.conflicts
    assert name == f"{JOB}.node3.epilog.json" and "1800000003.000" in why \
        and "1800000900.000" in why
    assert res.quarantined == [(name, why)]
    assert (spool / QUARANTINE_DIR / name).exists() and not (spool / name).exists()
    assert res.to_dict()["conflicts"] == [{"name": name, "reason": why}]
    assert query.verify(archive).ok


@pytest.mark.parametrize(("line", "requeued", "attempt"), [
    (f"{JOB}|COMPLETING|1|{SUBMIT}|2026-11-29T08:01:35|NONE|", True, 0),
    (f"{JOB}|PENDING|2|{SUBMIT}|2026-11-29T08:01:56|NONE|", True, 1),
    (f"{JOB}|COMPLETING|1|{SUBMIT}|2026-11-29T08:01:35|2026-11-29T08:02:00|", False, 1),
    (f"{JOB}|RUNNING|0|{SUBMIT}|2026-11-29T08:01:35|NONE|", False, 0),
    (f"{JOB}|COMPLETING|0|{SUBMIT}|2026-11-29T08:01:35|NONE|", False, 0),
])
def test_slurms_record_says_which_attempt_ended(line: str, requeued: bool,
                                                attempt: int) -> None:
    rec = job_record.parse(f"{line}\n", JOB)
    assert rec is not None and rec.requeued is requeued
    assert rec.ended_attempt(most=1) == attempt
    assert rec.submit == time.mktime(time.strptime(SUBMIT, "%Y-%m-%dT%H:%M:%S"))


@pytest.mark.parametrize("text", [
    "", "42|COMPLETING|1|x|y|NONE|\n", f"{JOB}|COMPLETING|1|x|y|NONE\n",
    f"{JOB}|COMPLETING|one|x|y|NONE|\n", f"{JOB}|completing; rm|1|x|y|NONE|\n",
    f"{JOB}|COMPLETING|99999999|x|y|NONE|\n", f"{JOB}|A|1|x|y|NONE|extra|\n"])
def test_a_record_that_is_not_squeues_is_none(text: str) -> None:
    assert job_record.parse(text, JOB) is None


def test_the_events_node_reads_slurms_record_once_and_no_other_node_asks(
        tmp_path: Path) -> None:
    """The batch node's epilog (its prolog ran, the supervisor's events are there) keeps
    Slurm's record beside the events, from one squeue; a node without events (every other
    node of a 1,000-node job) asks slurmctld nothing."""
    events = sticky_dir(tmp_path / "events")
    env = {"SLURM_JOB_ID": str(JOB), "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events)}
    log = events_log.EventLog.open(env, "node1", query=False)
    now = time.monotonic()
    log.launch(1, 1, ["node1", "node2"], 0, now)
    log.step_ended(StepEnd.OK, "exit 0", {}, None, None, now)
    log.close()
    bin_dir, answer, calls = _fake_squeue(tmp_path)
    answer.write_text(_answer("COMPLETING", 0, "2026-11-29T08:09:00"))
    hook_env, base = make_node(tmp_path, BV_EVENTS_DIR=str(events), BV_SLURM_BIN=str(bin_dir))
    slurm = {"SLURM_JOB_ID": str(JOB), "SLURM_JOB_USER": "root",
             "SLURM_JOB_UID": str(os.getuid()), "SLURM_NODELIST": "node[1-2]",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_EXIT_CODE2": "0:0"}
    for node in ("node1", "node2"):
        for phase in ("prolog", "epilog"):
            p = run_hook(phase, hook_env, {**slurm, "SLURMD_NODENAME": node})
            assert p.returncode == 0, p.stderr
    assert len(calls.read_text().splitlines()) == 1  # node1's epilog only
    spool = base / "spool"
    batch = json.loads((spool / f"{JOB}.node1.epilog.json").read_text())
    assert batch["goodput_events"]["host"] == "node1" and batch["restart"] == 0
    assert batch["slurm_job"]["requeued"] is False and batch["slurm_job"]["submit"] == \
        time.mktime(time.strptime(SUBMIT, "%Y-%m-%dT%H:%M:%S"))
    assert "slurm_job" not in json.loads((spool / f"{JOB}.node2.epilog.json").read_text())
