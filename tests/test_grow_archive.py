"""A grown node's checks belong to the job it joins (issue 28 §2).

A node grown into a running job (bluevela/launch/grow.py) runs its prolog under the short-lived
helper job's id (`bv-grow-JOB`). The supervisor records the grow in the job's goodput events
(`grow`: the helper's id and the node; bluevela/launch/events_log.py), and `bv archive show JOB`
gives the helper's prolog of that node to the job, marked `grown_via_job`, when the helper's
user is the job's (bluevela/archive/query.py: `grown_prologs`). The real grow on the dev
cluster: tests/test_grow_cluster.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.archive.ingest import ingest
from bluevela.archive.query import show_job
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import write_report
from bluevela.launch import events as E
from bluevela.launch import events_log
from bluevela.launch.outcome import StepEnd
from tests.test_goodput_events import sticky_dir

T = 1_800_000_000.0
JOB, HELPER = 41, 42


def _events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            grows: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """A real EventLog: a launch, a lost node, the grows, the relaunch; the folded record."""
    d = sticky_dir(tmp_path / "events")
    monkeypatch.setenv("BV_EVENTS_DIR", str(d))
    env = {"SLURM_JOB_ID": str(JOB), "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(d)}
    log = events_log.EventLog.open(env, "node1", query=False)
    now = time.monotonic()
    log.launch(1, 1, ["node1", "node2"], 0, now)
    log.step_ended(StepEnd.LOST, "node2 lost", {}, now, now, now)
    for helper, nodes in grows:
        log.grown(helper, nodes)
    log.launch(2, 2, ["node1", "node3"], 0, now)
    log.step_ended(StepEnd.OK, "exit 0", {}, None, None, now)
    log.close()
    (path,) = d.glob(f"bv-goodput.{JOB}.r0.u{os.getuid()}.*.jsonl")
    return E.read_events_file(path.read_bytes())


def test_the_supervisor_records_the_grow_and_the_record_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _events(tmp_path, monkeypatch, [(str(HELPER), ["node3"]),
                                          ("0", ["node4"]), ("43", ["../x"]), ("x", ["n"])])
    (grow,) = rec["grows"]  # what is not a job id or a node name is never written
    assert grow["helper"] == HELPER and grow["nodes"] == ["node3"] and grow["t"] > T / 2
    assert E.validate(json.loads(json.dumps(rec))) == rec  # survives the archive's JSON
    # A copy (the second node's) cut before the grow, merged in either order: once.
    copy = {**rec, "grows": []}
    assert E.merge_records(copy, rec)["grows"] == rec["grows"]
    assert E.merge_records(rec, copy)["grows"] == rec["grows"]
    assert E.merge_records(rec, rec) == rec


@pytest.mark.parametrize("bad", [
    {"t": T, "helper": 0, "nodes": ["node3"]},
    {"t": T, "helper": "42", "nodes": ["node3"]},
    {"t": T, "helper": 42, "nodes": ["node3;rm"]},
    {"t": T, "helper": 42, "nodes": "node3"},
    {"t": 5.0, "helper": 42, "nodes": ["node3"]},
    "grow"])
def test_a_forged_grow_is_refused(bad: object) -> None:
    rec = {"v": 1, "host": "node1", "job": JOB, "restart": 0, "opened": T, "slurm": {},
           "requeue": None, "launches": [], "grows": [bad]}
    with pytest.raises(E.EventsError):
        E.validate(rec)


def test_the_grows_are_bounded() -> None:
    lines: list[dict[str, Any]] = [{"e": "job", "t": T, "host": "node1", "job": JOB,
                                    "restart": 0}]
    lines += [{"e": "grow", "t": T, "helper": 100 + i, "nodes": ["node3"]}
              for i in range(E.MAX_GROWS + 1)]
    with pytest.raises(E.EventsError, match="grows"):
        E.fold(lines)
    assert len(E.fold(lines[:-1])["grows"]) == E.MAX_GROWS


def _spool_job(spool: Path, grows: list[dict[str, Any]] | None) -> None:
    """Job 41 on node[1-3]: node3 grown in, so its prolog is not under 41."""
    nodes = ["node1", "node2", "node3"]
    for node in nodes:
        if node != "node3":
            write_report(spool, sample_report(JOB, node, "prolog", nodelist=nodes, time=T))
        epi = sample_report(JOB, node, "epilog", nodelist=nodes, time=T + 80)
        if node == "node1" and grows is not None:
            epi["goodput_events"] = {"v": 1, "host": "node1", "job": JOB, "restart": 0,
                                     "opened": T, "slurm": {}, "requeue": None,
                                     "launches": [], "grows": grows}
        write_report(spool, epi)


def _spool_helper(spool: Path, job: int = HELPER, user: str = "alice") -> None:
    for phase, t in (("prolog", T + 30), ("epilog", T + 31)):
        write_report(spool, sample_report(job, "node3", phase, nodelist=["node3"], time=t,
                                          user=user, status_code=1 if phase == "prolog" else 0))


def _ingest(spool: Path, archive: Path) -> None:
    ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=T + 4000)


def _node3(archive: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    job = show_job(archive, JOB)
    (n3,) = [n for n in job["nodes"] if n["node"] == "node3"]
    return job, n3


@pytest.mark.parametrize("helper_first", [True, False], ids=["helper-first", "job-first"])
def test_the_archive_gives_the_helpers_prolog_to_the_job(tmp_path: Path,
                                                         helper_first: bool) -> None:
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    grows = [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}]
    first, second = (_spool_helper, _spool_job) if helper_first else (_spool_job, _spool_helper)
    first(spool, *([grows] if first is _spool_job else []))
    _ingest(spool, archive)
    second(spool, *([grows] if second is _spool_job else []))
    _ingest(spool, archive)
    _ingest(spool, archive)  # idempotent
    job, n3 = _node3(archive)
    assert n3["prolog"] is not None and n3["prolog"]["grown_via_job"] == HELPER
    assert n3["prolog"]["phase"] == "prolog" and n3["prolog"]["health"]["status"] == "WARNING"
    assert n3["epilog"]["health"]["status"] == "OK"
    assert job["missing_prolog_nodes"] == []
    # The other nodes keep their own prologs, unmarked.
    assert all("grown_via_job" not in n["prolog"] for n in job["nodes"] if n["node"] != "node3")


def test_a_helper_of_another_user_lends_no_checks(tmp_path: Path) -> None:
    """Job 41's record names job 42, but 42 (named bv-grow-41 or not) is bob's: 41 keeps a
    node with no prolog. And a record that names no grow takes none."""
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    _spool_job(spool, [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}])
    _spool_helper(spool, user="bob")
    _ingest(spool, archive)
    job, n3 = _node3(archive)
    assert n3["prolog"] is None and job["missing_prolog_nodes"] == ["node3"]

    spool2, archive2 = tmp_path / "spool2", tmp_path / "archive2"
    spool2.mkdir()
    archive2.mkdir()
    _spool_job(spool2, None)
    _spool_helper(spool2)
    _ingest(spool2, archive2)
    _, n3 = _node3(archive2)
    assert n3["prolog"] is None


def test_bv_archive_show_marks_the_grown_prolog(tmp_path: Path) -> None:
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    _spool_job(spool, [{"t": T + 30, "helper": HELPER, "nodes": ["node3"]}])
    _spool_helper(spool)
    _ingest(spool, archive)
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive), "BV_SPOOL_DIR": str(spool),
           "BV_CACHE_DIR": "off"}
    out = subprocess.run([sys.executable, "-m", "bluevela", "archive", "show", str(JOB)],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
    (row,) = [ln for ln in out.stdout.splitlines() if ln.startswith("node3")]
    assert row.split("\t")[1].startswith("WARNING ") and "(grown via job 42)" in row, row
    js = subprocess.run([sys.executable, "-m", "bluevela", "archive", "show", str(JOB),
                         "--json"], capture_output=True, text=True, timeout=60, env=env,
                        check=False)
    (n3,) = [n for n in json.loads(js.stdout)["nodes"] if n["node"] == "node3"]
    assert n3["prolog"]["grown_via_job"] == HELPER
