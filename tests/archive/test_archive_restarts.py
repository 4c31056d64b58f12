"""A requeued job keeps its id: every attempt's reports and time series reach the archive.

Before the `restart` field, attempt 1's `<job>.<node>.<phase>.json` replaced attempt 0's in the
spool, or was dropped at ingest as a duplicate of it ("the first report wins"), so the archive
lost every requeued attempt. Fixtures only here; the dev cluster test is in
tests/archive/test_archive_restarts_cluster.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest

from bluevela.archive import query
from bluevela.archive.ingest import ingest, store_reports
from bluevela.archive.sample import sample_report
from bluevela.archive.series_layout import read_series, series_path
from bluevela.archive.spool import (
    DONE_DIR,
    QUARANTINE_DIR,
    parse_report_name,
    parse_series_name,
    report_name,
    scan_spool,
    series_name,
    write_report,
)
from bluevela.archive.store import Archive
from bluevela.errors import UnsafeValueError
from bluevela.telemetry.format import Column, Header, SegmentWriter
from bluevela.telemetry.window import write_side_file

REPO = Path(__file__).resolve().parents[2]
T0 = 1_750_000_000.0
# An archive written before the `restart` column (commit fd30df9's archive code).
OLD_ARCHIVE = REPO / "tests" / "data" / "archive-pre-restart"


def _spool(spool: Path, job: int, nodes: list[str], restart: int, t: float, *,
           phases: tuple[str, ...] = ("prolog", "epilog"), exit_code: int = 0) -> None:
    for node in nodes:
        for phase in phases:
            r = sample_report(job, node, phase, nodelist=nodes,
                              time=t + (60 if phase == "epilog" else 0), exit_code=exit_code)
            if restart:
                r["restart"] = restart
            write_report(spool, r)


def _keys(archive: Path) -> Counter[tuple[int, str, str, int]]:
    return Counter((r["job_id"], r["node"], r["phase"], r["restart"])
                   for r in query.iter_reports(archive))


# -- spool names ----------------------------------------------------------------------------


def test_restart_names_are_accepted_exactly_and_agree_with_the_content(
        tmp_path: Path) -> None:
    assert report_name(7, "n1", "prolog") == "7.n1.prolog.json"  # first run: as before
    assert report_name(7, "n1", "epilog", 3) == "7.n1.epilog.r3.json"
    assert series_name(7, "n1") == "7.n1.series.bvts"
    assert series_name(7, "n1", 12) == "7.n1.r12.series.bvts"
    assert parse_report_name("7.gpu-1.rack2.epilog.r65535.json") == \
        (7, "gpu-1.rack2", "epilog", 65535)
    assert parse_series_name("7.n1.r2.series.bvts") == (7, "n1", 2)
    assert parse_series_name("7.n1.series.bvts") == (7, "n1", 0)
    for bad in ["7.n1.prolog.r0.json", "7.n1.prolog.r01.json", "7.n1.prolog.r65536.json",
                "7.n1.prolog.r123456.json", "7.n1.prolog.r-1.json", "7.n1.prolog.r.json",
                "7.n1.prolog.R1.json", "7.n1.prolog.r1.json.tmp", "7.n1.r1.prolog.json.r1"]:
        with pytest.raises(UnsafeValueError):
            parse_report_name(bad)
    for value in (-1, 65536, "x", 1.5, True):
        with pytest.raises(UnsafeValueError):
            report_name(7, "n1", "prolog", value)  # type: ignore[arg-type]
    with pytest.raises(UnsafeValueError):
        parse_series_name("7.n1.r99999.series.bvts")
    spool = tmp_path / "spool"
    r = sample_report(7, "n1", "prolog", time=T0)
    r["restart"] = 2
    assert write_report(spool, r).name == "7.n1.prolog.r2.json"
    assert json.loads((spool / "7.n1.prolog.r2.json").read_text())["restart"] == 2
    # A name that is not exactly one of these forms, and a report whose restart disagrees
    # with its name, are quarantined; the good one is archived.
    (spool / "7.n1.epilog.r01.json").write_text("{}")
    lie = sample_report(7, "n1", "epilog", time=T0 + 60)
    lie["restart"] = 1
    (spool / "7.n1.epilog.r2.json").write_text(json.dumps({"schema": 1, "kind": "node_report",
                                                           **lie}))
    archive = tmp_path / "archive"
    archive.mkdir()
    scan = scan_spool(spool)
    assert sorted(e.name for e in scan.entries) == ["7.n1.epilog.r2.json", "7.n1.prolog.r2.json"]
    assert scan.refused == [("7.n1.epilog.r01.json",
                             "not a report file name: '7.n1.epilog.r01.json'")]
    res = ingest(spool, archive, now=T0 + 10**7)
    assert sorted(n for n, _ in res.quarantined) == ["7.n1.epilog.r01.json", "7.n1.epilog.r2.json"]
    assert "restart 1 does not match the file name" in dict(res.quarantined)["7.n1.epilog.r2.json"]
    assert (spool / QUARANTINE_DIR / "7.n1.epilog.r2.json").exists()
    assert _keys(archive) == Counter({(7, "n1", "prolog", 2): 1})


# -- ingest ---------------------------------------------------------------------------------


def test_two_attempts_of_a_node_are_both_archived_and_reingest_is_idempotent(
        dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    nodes = ["n1", "n2"]
    _spool(spool, 30, nodes, 0, T0, exit_code=143)  # attempt 0 killed by the requeue
    _spool(spool, 30, nodes, 1, T0 + 600, phases=("prolog",))
    res = ingest(spool, archive, now=T0 + 700)
    # The latest attempt decides: attempt 1 runs, so the job waits (nothing lost, no revision).
    assert res.waiting_jobs == [30] and res.reports_ingested == 0
    _spool(spool, 30, nodes, 1, T0 + 600, phases=("epilog",))
    res = ingest(spool, archive, now=T0 + 700)
    assert res.jobs_archived == [30] and res.reports_ingested == 8 and res.duplicates == 0
    assert _keys(archive) == Counter({(30, n, p, k): 1 for n in nodes
                                      for p in ("prolog", "epilog") for k in (0, 1)})
    job = query.show_job(archive, 30)
    assert job["restarts"] == 1 and job["exit_code"] == 0  # the last attempt's exit
    assert [(a["restart"], a["nodes"], a["first_prolog_unix_s"], a["last_epilog_unix_s"],
             a["exit_code"]) for a in job["attempts"]] == [
        (0, "n[1-2]", T0, T0 + 60, 143), (1, "n[1-2]", T0 + 600, T0 + 660, 0)]
    n1 = job["nodes"][0]
    assert n1["prolog"]["restart"] == 1 and n1["epilog"]["time"] == T0 + 660
    assert [(e["restart"], e["epilog"]["exit_code"]) for e in n1["earlier"]] == [(0, 143)]
    assert query.list_jobs(archive)[0]["restarts"] == 1
    # Re-ingest of every report: all duplicates, nothing new.
    for name in os.listdir(spool / DONE_DIR):
        shutil.copy(spool / DONE_DIR / name, spool / name)
    res = ingest(spool, archive, now=T0 + 800)
    assert res.duplicates == 8 and res.reports_ingested == 0 and not res.jobs_archived
    assert sum(_keys(archive).values()) == 8
    assert query.verify(archive).ok


def test_attempt_after_the_first_was_archived_adds_a_revision_and_survives_compaction(
        dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    nodes = ["n1", "n2"]
    _spool(spool, 31, nodes, 0, T0, exit_code=15)
    assert ingest(spool, archive, now=T0 + 100).jobs_archived == [31]
    job = query.show_job(archive, 31)
    assert job["restarts"] == 0 and "attempts" not in job and job["exit_code"] == 15
    # Requeued: attempt 1's prologs arrive (archived at once, as late reports), then epilogs.
    _spool(spool, 31, nodes, 1, T0 + 900, phases=("prolog",))
    res = ingest(spool, archive, now=T0 + 1000)
    assert res.jobs_archived == [31] and res.reports_ingested == 2 and res.duplicates == 0
    assert query.show_job(archive, 31)["restarts"] == 1
    _spool(spool, 31, nodes, 1, T0 + 900, phases=("epilog",))
    assert ingest(spool, archive, now=T0 + 1100).reports_ingested == 2
    job = query.show_job(archive, 31)
    assert job["revision"] == 3 and job["restarts"] == 1 and job["exit_code"] == 0
    assert [(a["restart"], a["exit_code"]) for a in job["attempts"]] == [(0, 15), (1, 0)]
    with Archive(archive).writer() as w:  # merge segments: all attempts are kept
        assert w.compact(fanout=2) >= 1
        assert max(s.reports for s in w.manifest.segments) >= 4
    assert _keys(archive) == Counter({(31, n, p, k): 1 for n in nodes
                                      for p in ("prolog", "epilog") for k in (0, 1)})
    assert query.verify(archive).ok
    assert query.show_job(archive, 31)["restarts"] == 1


def test_segment_written_before_the_restart_column_reads_as_restart_0(
        dirs: tuple[Path, Path]) -> None:
    """tests/data/archive-pre-restart: an archive written by the archive code of commit
    fd30df9, the last without the `restart` column (job 32 on n1/n2, exit 9; how it was made:
    tests/data/README.md). Copied in as a node's archive would hold it."""
    spool, archive = dirs
    shutil.copytree(OLD_ARCHIVE, archive, dirs_exist_ok=True)
    seg = next((archive / "segments").glob("*.h5"))
    with h5py.File(seg, "r") as f:
        assert "restart" not in f["reports"].dtype.names  # really the old layout
        assert "restarts" not in f["jobs"].dtype.names
    assert query.verify(archive).ok
    job = query.show_job(archive, 32)
    assert job["restarts"] == 0 and "attempts" not in job and job["exit_code"] == 9
    assert _keys(archive) == Counter({(32, n, p, 0): 1 for n in ("n1", "n2")
                                      for p in ("prolog", "epilog")})
    # The same reports again are duplicates; attempt 1 goes in beside them; compaction merges
    # the old file with the new ones.
    _spool(spool, 32, ["n1", "n2"], 0, T0, exit_code=9)
    _spool(spool, 32, ["n1", "n2"], 1, T0 + 900)
    res = ingest(spool, archive, now=T0 + 1000, compact=False)
    assert res.duplicates == 4 and res.reports_ingested == 4
    with Archive(archive).writer() as w:
        w.compact(fanout=2)
    assert sum(_keys(archive).values()) == 8 and query.verify(archive).ok
    job = query.show_job(archive, 32)
    assert job["restarts"] == 1 and job["exit_code"] == 0 and len(job["attempts"]) == 2


def test_store_reports_keeps_attempts_apart(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    archive.mkdir()
    reps = []
    for k in (0, 1, 2):
        r = sample_report(33, "n1", "epilog", time=T0 + 1000 * k)
        r["restart"] = k
        reps.append(r)
    res = store_reports(archive, reps + reps[:1])  # one duplicate in the batch
    assert res.reports_ingested == 4  # the batch's duplicate is dropped when writing
    assert _keys(archive) == Counter({(33, "n1", "epilog", k): 1 for k in (0, 1, 2)})
    assert query.show_job(archive, 33)["restarts"] == 2


# -- series ---------------------------------------------------------------------------------


def _side(spool: Path, samples_root: Path, job: int, node: str, restart: int, start: float,
          n: int, value: float) -> None:
    samples = samples_root / f"{node}-r{restart}"
    samples.mkdir(parents=True)
    columns = (Column("gpu0.util_pct", "gpu0", "%"), Column("node.cpu_busy_pct", "node", "%"))
    w = SegmentWriter(samples / f"seg-{int(start)}.bvts", Header(node, 10.0, columns, start))
    for k in range(n):
        w.append(start + 10 * k, [value + k, 50.0])
    w.close()
    write_side_file(spool, samples, job, node, start + 10, start + 10 * (n - 1), 10.0, restart)


def test_series_of_two_attempts_share_one_grid_with_a_nan_gap(dirs: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["n1", "n2"]
    _spool(spool, 34, nodes, 0, T0)
    for node in nodes:
        _side(spool, tmp_path, 34, node, 0, T0, 4, 10.0)  # T0 .. T0+30
    assert ingest(spool, archive, now=T0 + 100).jobs_archived == [34]
    assert read_series(archive, 34).time.shape == (4,)  # type: ignore[union-attr]
    _spool(spool, 34, nodes, 1, T0 + 100)
    for node in nodes:
        _side(spool, tmp_path, 34, node, 1, T0 + 100, 3, 70.0)  # T0+100 .. T0+120
    assert (spool / "34.n1.r1.series.bvts").exists()
    res = ingest(spool, archive, now=T0 + 300)
    assert not res.quarantined and not list(spool.glob("*.bvts"))
    with h5py.File(series_path(archive, 34), "r") as f:  # h5py alone
        assert json.loads(f.attrs["attempts"]) == {"n1": [0, 1], "n2": [0, 1]}
        assert list(f["time"][()] - T0) == [10.0 * k for k in range(13)]
        util = f["gpu/util_pct"][()]
    assert util.shape == (2, 1, 13)
    assert list(util[0, 0, :4]) == [10, 11, 12, 13]
    assert np.isnan(util[0, 0, 4:10]).all()  # between the attempts
    assert list(util[1, 0, 10:]) == [70, 71, 72]
    # Re-ingest of a side file already in the file adds nothing.
    before = series_path(archive, 34).stat().st_mtime_ns
    shutil.copy(spool / DONE_DIR / "34.n2.r1.series.bvts", spool / "34.n2.r1.series.bvts")
    assert not ingest(spool, archive, now=T0 + 400).quarantined
    assert series_path(archive, 34).stat().st_mtime_ns == before
    assert not math.isnan(read_series(archive, 34).gpu["util_pct"][1, 0, 12])  # type: ignore[union-attr]


# -- efficiency -----------------------------------------------------------------------------


def test_efficiency_counts_restarts_from_the_archive(dirs: tuple[Path, Path]) -> None:
    """Attempt 0 ran samples 0-79, attempt 1 samples 110-199 (the series is NaN between), with
    a 300 s job-wide idle stretch inside attempt 1. The requeue's gap comes from the report
    times (400 s: last epilog of attempt 0 to first prolog of attempt 1), not from the series'
    NaN stretch, which is not counted again."""
    from bluevela.archive.series_layout import JobSeries, write_series
    from bluevela.report.efficiency import job_efficiency
    from bluevela.report.efficiency_text import summary_lines

    spool, archive = dirs
    job, ts = 4243, T0 + 10_000
    nodes = [f"g{i}" for i in range(4)]
    for node in nodes:
        for k, p, t in ((0, "prolog", ts), (0, "epilog", ts + 795), (1, "prolog", ts + 1195),
                        (1, "epilog", ts + 1995)):
            r = sample_report(job, node, p, nodelist=nodes, time=t)
            r["restart"] = k
            write_report(spool, r)
    assert ingest(spool, archive, now=ts + 3000).jobs_archived == [job]
    rng = np.random.default_rng(3)
    T = 200
    util = np.clip(rng.normal(95, 2, (4, 2, T)), 0, 100)
    util[:, :, 150:180] = 0  # inside attempt 1: every GPU idle for 300 s
    power = np.where(util > 10, 650.0, 80.0) + rng.normal(0, 5, (4, 2, T))
    cpu = np.full((4, T), 30.0)
    for a in (util, power):
        a[:, :, 80:110] = np.nan  # between the attempts: no samples
    cpu[:, 80:110] = np.nan
    write_series(series_path(archive, job), JobSeries(
        job_id=job, interval_s=10.0, time=ts + 10.0 * np.arange(T), nodes=nodes,
        gpu={"util_pct": util.astype(np.float32), "power_w": power.astype(np.float32)},
        node={"cpu_busy_pct": cpu.astype(np.float32)}))
    eff = job_efficiency(archive, job)
    rs = eff.restarts
    assert rs["requeues"] == 1
    assert rs["requeue_gaps"] == [{"restart": 1, "start_unix_s": ts + 795, "duration_s": 400.0}]
    assert [g["duration_s"] for g in rs["gaps"]] == [300.0]  # the in-attempt one only
    assert rs["count"] == 2 and rs["lost_s"] == 700.0
    assert rs["lost_unit_h"] == pytest.approx(700 * 8 / 3600, abs=0.01)
    assert any("1 requeue(s) (archive)" in line for line in summary_lines(eff))


# -- the hooks ------------------------------------------------------------------------------


def test_epilog_of_a_requeued_attempt_reports_its_prologs_restart(tmp_path: Path) -> None:
    """Slurm counts a requeue before the ended attempt's epilog runs (its
    SLURM_JOB_RESTART_COUNT is the next attempt's, seen on 22.05). The epilog takes the attempt
    from its prolog's reading, so attempt 0's epilog is not spooled as attempt 1's (where
    attempt 1's own epilog would replace it)."""
    from tests.hooks.test_hooks_run import make_node, run_hook

    hook_env, base = make_node(tmp_path)
    slurm = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n1", "SLURM_JOB_USER": "alice",
             "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}
    for phase, count in (("prolog", "0"), ("epilog", "1"), ("prolog", "1"), ("epilog", "1")):
        res = run_hook(phase, hook_env, {**slurm, "SLURM_JOB_RESTART_COUNT": count,
                                         "SLURM_JOB_EXIT_CODE2": "0:0"})
        assert res.returncode == 0 and "hook error" not in res.stderr, res.stderr
    spool = base / "spool"
    assert sorted(p.name for p in spool.glob("77.*.json")) == [
        "77.n1.epilog.json", "77.n1.epilog.r1.json", "77.n1.prolog.json", "77.n1.prolog.r1.json"]
    # No prolog reading (state lost): the epilog falls back to Slurm's count.
    res = run_hook("epilog", hook_env, {**slurm, "SLURM_JOB_ID": "78",
                                        "SLURM_JOB_RESTART_COUNT": "2"})
    assert res.returncode == 0 and (spool / "78.n1.epilog.r2.json").exists(), res.stderr
