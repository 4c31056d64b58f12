"""The spool's reading side: names, refusals, validation, quarantine, concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from bluevela.archive import query
from bluevela.archive.ingest import ingest
from bluevela.archive.reports import load_report, validate_report
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import (
    QUARANTINE_DIR,
    ReportError,
    SpoolEntry,
    parse_report_name,
    report_name,
    scan_spool,
    write_report,
)
from bluevela.errors import ArchiveError, UnsafeValueError

# Names a job's owner or a confused tool might smuggle in (see tests/conftest.py HOSTILE).
HOSTILE_NODES = ["../etc", "..", "a/b", "node1/../../x", ".hidden", "node 1", "n;rm -rf",
                 "$(touch x)", "`x`", "n\nnewline", "", "x" * 65, "nöde"]
HOSTILE_JOBS = ["../1", "1/../2", "-1", "0", "1e3", "12 ", " 12", "1;2", "", "1234567890123"]


def _entry(name: str) -> SpoolEntry:
    return SpoolEntry(name, *parse_report_name(name))


@pytest.mark.parametrize("node", HOSTILE_NODES)
def test_hostile_node_names_are_refused(dirs: tuple[Path, Path], node: str) -> None:
    spool, _ = dirs
    with pytest.raises(UnsafeValueError):
        write_report(spool, sample_report(7, node, "prolog"))
    assert list(spool.iterdir()) == []


@pytest.mark.parametrize("job", HOSTILE_JOBS)
def test_hostile_job_ids_are_refused(dirs: tuple[Path, Path], job: str) -> None:
    spool, _ = dirs
    with pytest.raises(UnsafeValueError):
        report_name(job, "node1", "epilog")


def test_report_names_parse_back() -> None:
    assert parse_report_name(report_name(42, "gpu-001.rack2", "epilog")) == \
        (42, "gpu-001.rack2", "epilog", 0)
    for bad in ["42.node1.json", "x.node1.prolog.json", "42.node1.prolog.json.tmp",
                "42...prolog.json", "42.a b.prolog.json", "42.node1.Prolog.json"]:
        with pytest.raises(UnsafeValueError):
            parse_report_name(bad)


def test_symlinks_fifos_dirs_and_odd_names_are_quarantined_never_read(
        dirs: tuple[Path, Path], tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["n1"]
    good = write_report(spool, sample_report(5, "n1", "epilog", nodelist=nodes, time=time.time()))
    # A symlink to a perfectly valid report elsewhere: still refused, the target untouched.
    target = tmp_path / "elsewhere.json"
    target.write_bytes(good.read_bytes().replace(b'"job_id": 5', b'"job_id": 6')
                       .replace(b'"n1"', b'"n2"'))
    os.symlink(target, spool / "6.n2.epilog.json")
    os.mkfifo(spool / "7.n3.epilog.json")  # opening it would hang ingest
    (spool / "8.n4.prolog.json").mkdir()
    (spool / "notes.txt").write_text("operator scribbles")
    (spool / "9.n\u00f6de.prolog.json").write_text("{}")
    scan = scan_spool(spool)
    assert [e.name for e in scan.entries] == [good.name]
    refused = dict(scan.refused)
    assert "symlink" in refused["6.n2.epilog.json"]
    assert "regular" in refused["7.n3.epilog.json"]
    assert "regular" in refused["8.n4.prolog.json"]
    assert "notes.txt" in refused and "9.n\u00f6de.prolog.json" in refused

    res = ingest(spool, archive)
    assert res.reports_ingested == 1 and len(res.quarantined) == 5
    q = spool / QUARANTINE_DIR
    assert (q / "6.n2.epilog.json").is_symlink()
    assert target.exists()
    for name in refused:
        assert (q / f"{name}.reason").read_text().strip()
    assert [r["node"] for r in query.records(archive)] == ["n1"]


@pytest.mark.parametrize(("content", "reason"), [
    (b'{"schema": 1, "kind": "node_report", "job_id": 3, "no', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"schema": 2, "kind": "node_report"}', "schema-1"),
])
def test_malformed_reports_go_to_quarantine_with_the_reason(
        dirs: tuple[Path, Path], content: bytes, reason: str) -> None:
    spool, archive = dirs
    (spool / "3.n1.epilog.json").write_bytes(content)
    write_report(spool, sample_report(4, "n1", "epilog", nodelist=["n1"], time=time.time()))
    res = ingest(spool, archive)
    assert res.reports_ingested == 1
    assert [n for n, _ in res.quarantined] == ["3.n1.epilog.json"]
    assert reason in (spool / QUARANTINE_DIR / "3.n1.epilog.json.reason").read_text()
    assert (spool / QUARANTINE_DIR / "3.n1.epilog.json").read_bytes() == content


def _report(**over: object) -> dict[str, object]:
    r: dict[str, object] = {"schema": 1, "kind": "node_report",
                            **sample_report(3, "n1", "epilog", nodelist=["n1", "n2"])}
    r.update(over)
    return r


@pytest.mark.parametrize(("over", "reason"), [
    ({"node": "n2"}, "does not match the file name"),
    ({"job_id": 4}, "does not match the file name"),
    ({"job_id": "../3"}, "does not match the file name"),
    ({"phase": "prolog"}, "does not match the file name"),
    ({"time": "yesterday"}, "time must be a number"),
    ({"time": None}, "time"),
    ({"exit_code": -3}, "out of range"),
    ({"exit_code": True}, "must be an integer"),
    ({"nodelist": ["n1", "../n2"]}, "unsafe node name"),
    ({"nodelist": "n[1-"}, "hostlist"),
    ({"user": "x" * 65}, "longer than 64"),
    ({"user": "a\0b"}, "NUL"),
    ({"health": []}, "health must be an object"),
    ({"health": {"status": "FINE", "checks": []}}, "not OK/WARNING"),
    ({"health": {"status_code": 9, "checks": []}}, "out of range"),
    ({"health": {"status_code": 0, "checks": [{"status_code": 0}]}}, "name"),
    ({"telemetry": {"a" * 70: 1.0}}, "key is longer than 64"),
    ({"telemetry": [1, 2]}, "must be an object"),
])
def test_validation_refuses_what_does_not_fit(over: dict[str, object], reason: str) -> None:
    with pytest.raises(ReportError, match=reason.replace("(", r"\(")):
        validate_report(_report(**over), _entry("3.n1.epilog.json"))


def test_validation_normalizes_and_keeps_unknown_values() -> None:
    r = validate_report(_report(nodelist="n[1-2]", job_id="3", num_nodes="2", future_key={"x": 1},
                                telemetry={"gpu_energy_j": 5, "ok_bool": True, "note": "text"}),
                        _entry("3.n1.epilog.json"))
    assert r["nodelist"] == ("n1", "n2") and r["job_id"] == 3 and r["num_nodes"] == 2
    assert r["telemetry"] == {"gpu_energy_j": 5.0, "ok_bool": 1.0}
    assert r["_nonnumeric"] == {"telemetry": {"note": "text"}}
    assert r["future_key"] == {"x": 1}


def test_unknown_and_nonnumeric_values_survive_the_archive(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    rep = sample_report(11, "n1", "epilog", nodelist=["n1"], time=time.time())
    rep["start_time"] = 1.7e9 - 60
    rep["health"]["checks"][0]["metrics"]["driver"] = "550.54"
    rep["health"]["checks"][0]["vendor_detail"] = {"pci": "0000:17:00.0"}
    rep["health"]["started_at"] = 123.5
    rep["telemetry"]["note"] = "nvml missing"
    write_report(spool, rep)
    ingest(spool, archive)
    got = query.show_job(archive, 11)["nodes"][0]["epilog"]
    assert got["start_time"] == 1.7e9 - 60
    assert got["health"]["started_at"] == 123.5
    gpu = got["health"]["checks"][0]
    assert gpu["metrics"]["driver"] == "550.54" and gpu["vendor_detail"] == {"pci": "0000:17:00.0"}
    assert gpu["metrics"]["temp_max_c"] == rep["health"]["checks"][0]["metrics"]["temp_max_c"]
    assert got["telemetry"]["note"] == "nvml missing"
    assert got["telemetry"]["gpu_energy_j"] == rep["telemetry"]["gpu_energy_j"]


def test_load_report_does_not_follow_a_symlink_swapped_in(dirs: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    spool, _ = dirs
    path = write_report(spool, sample_report(5, "n1", "epilog"))
    entry = scan_spool(spool).entries[0]
    path.unlink()
    (tmp_path / "secret").write_text(json.dumps({"a": 1}))
    os.symlink(tmp_path / "secret", path)  # swapped between scan and read
    with pytest.raises(ReportError):
        load_report(spool, entry)


def test_spool_that_is_missing_a_file_or_a_symlink_is_one_clear_error(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    archive.mkdir()
    with pytest.raises(ArchiveError, match="does not exist"):
        ingest(tmp_path / "nope", archive)
    (tmp_path / "file").write_text("")
    with pytest.raises(ArchiveError, match="not a directory"):
        ingest(tmp_path / "file", archive)
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with pytest.raises(ArchiveError, match="symlink"):
        ingest(tmp_path / "link", archive)


def test_stale_temp_files_are_removed_fresh_ones_left(dirs: tuple[Path, Path]) -> None:
    spool, _ = dirs
    stale = spool / ".5.n1.epilog.json.123.tmp"
    fresh = spool / ".5.n2.epilog.json.124.tmp"
    stale.write_text("{")
    fresh.write_text("{")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert scan_spool(spool).entries == []
    assert not stale.exists() and fresh.exists()


def _writer(spool: str, worker: int, jobs: int, nodes: int) -> None:
    """One epilog-like writer process: a prolog and an epilog report per (job, node)."""
    for j in range(jobs):
        job_id = 1000 + j
        nodelist = [f"node{n:03d}" for n in range(nodes)]
        for n in range(worker, nodes, 64):
            for phase in ("prolog", "epilog"):
                write_report(Path(spool), sample_report(job_id, nodelist[n], phase,
                                                        nodelist=nodelist, time=time.time()))


def test_64_concurrent_writers_then_ingest_stores_each_report_once(
        dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    jobs, nodes = 4, 128
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(spool), w, jobs, nodes)) for w in range(64)]
    for p in procs:
        p.start()
    # Ingest concurrently with the writers too: whatever is complete goes in, the rest waits.
    ingest(spool, archive)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    ingest(spool, archive)
    recs = query.records(archive)
    keys = [(r["job_id"], r["node"], r["phase"]) for r in recs]
    assert len(keys) == len(set(keys)) == jobs * nodes * 2
    assert not [p for p in spool.iterdir() if p.is_file()]
    assert query.verify(archive).ok
    for j in range(jobs):
        job = query.show_job(archive, 1000 + j)
        assert job["completion"] == "all_reported" and job["missing_nodes"] == []
        assert len(job["nodes"]) == nodes
