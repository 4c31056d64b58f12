"""The series ingest when the job's existing series file cannot be read (issue 23 §6).

Job 70 ran on n1 and n2; n1's side file was ingested first (its file moved to done/, its rows
only in `<archive>/series/70.h5`), n2's comes later. When that later ingest cannot read the
series file, for real: another process has it open for writing (`h5py.File(path, "a")` in a
child: HDF5 refuses with an OSError), its superblock is damaged, or a directory stands where it should be, the
file must stay as it is and n2's side file must wait in the spool; once the file reads again,
the next ingest adds n2 beside n1's rows. 9058adc rebuilt the file from n2's side file alone:
n1's rows were gone.

A bug in the build (a TypeError raised where `_put` writes a row) must not quarantine the
user's side file either: it stays in the spool and a later ingest builds it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bluevela.archive import series_ingest, series_layout
from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.series_layout import read_series, series_path
from bluevela.archive.spool import DONE_DIR, QUARANTINE_DIR, write_report

T0 = 1_750_000_000.0
COLS = ["gpu0.util_pct", "gpu1.util_pct", "node.cpu_busy_pct"]
JOB = 70


def _side(spool: Path, job: int, node: str, base: float) -> None:
    """Node `node`'s side file: 6 records 10 s apart, record k holds base + k in each column."""
    columns = [{"name": c, "component": c.rpartition(".")[0], "unit": "1"} for c in COLS]
    head = {"node": node, "interval_s": 10.0, "start_unix_s": T0, "columns": columns,
            "components": {}, "job_id": job}
    data = b"BVTS1\n" + json.dumps(head, separators=(",", ":")).encode() + b"\n"
    for k in range(6):
        data += struct.pack(f"<d{len(COLS)}f", T0 + 10 * k, *([base + k] * len(COLS)))
    (spool / f"{job}.{node}.series.bvts").write_bytes(data)


def _reports(spool: Path, job: int, nodes: list[str]) -> None:
    for node in nodes:
        for phase, t in (("prolog", T0), ("epilog", T0 + 60)):
            write_report(spool, sample_report(job, node, phase, nodelist=nodes, time=t))


def _ingest(spool: Path, archive: Path) -> Any:
    return ingest(spool, archive, now=T0 + 120, compact=False)


def _n1_ingested(spool: Path, archive: Path) -> None:
    _reports(spool, JOB, ["n1", "n2"])
    _side(spool, JOB, "n1", 100.0)
    res = _ingest(spool, archive)
    assert res.jobs_archived == [JOB] and not res.quarantined
    s = read_series(archive, JOB)
    assert s is not None and s.nodes == ["n1"]
    assert (spool / DONE_DIR / f"{JOB}.n1.series.bvts").is_file()
    _side(spool, JOB, "n2", 200.0)  # the late node


def _assert_waits(spool: Path, archive: Path, res: Any, before: bytes | int | None) -> None:
    """n2's side file is pending (not done, not quarantined); the series file untouched (the
    same bytes, or the same inode where the locker's open rewrote its flags)."""
    assert not res.quarantined, res.quarantined
    assert (spool / f"{JOB}.n2.series.bvts").is_file()
    assert not (spool / DONE_DIR / f"{JOB}.n2.series.bvts").exists()
    assert not (spool / QUARANTINE_DIR / f"{JOB}.n2.series.bvts").exists()
    if isinstance(before, bytes):
        assert series_path(archive, JOB).read_bytes() == before
    elif before is not None:
        assert series_path(archive, JOB).stat().st_ino == before


def _assert_both(spool: Path, archive: Path) -> None:
    s = read_series(archive, JOB)
    assert s is not None and s.nodes == ["n1", "n2"]
    assert list(s.gpu["util_pct"][0, 1]) == [100, 101, 102, 103, 104, 105]  # n1's rows kept
    assert list(s.gpu["util_pct"][1, 0]) == [200, 201, 202, 203, 204, 205]
    assert list(s.node["cpu_busy_pct"][0]) == [100, 101, 102, 103, 104, 105]
    assert (spool / DONE_DIR / f"{JOB}.n2.series.bvts").is_file()


@pytest.fixture
def locker(dirs: tuple[Path, Path]) -> Iterator[subprocess.Popen[str]]:
    """A child that holds HDF5's write lock on job 70's series file until its stdin closes."""
    path = series_path(dirs[1], JOB)
    code = ("import h5py, sys\n"
            f"f = h5py.File({str(path)!r}, 'a')\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n"
            "f.close()\n")
    p: subprocess.Popen[str] | None = None

    def start() -> subprocess.Popen[str]:
        nonlocal p
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        return p

    yield start  # type: ignore[misc]
    if p is not None and p.poll() is None:
        p.kill()
        p.wait()


def test_a_locked_series_file_is_left_and_the_late_node_waits(
        dirs: tuple[Path, Path], locker: Any) -> None:
    spool, archive = dirs
    _n1_ingested(spool, archive)
    before = series_path(archive, JOB).stat().st_ino
    held = locker()
    res = _ingest(spool, archive)  # h5py: "file is already open for write" (a real OSError)
    _assert_waits(spool, archive, res, before)
    held.stdin.close()
    assert held.wait(30) == 0
    res = _ingest(spool, archive)
    assert not res.quarantined
    _assert_both(spool, archive)


def test_a_damaged_series_file_is_never_rebuilt_over(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _n1_ingested(spool, archive)
    path = series_path(archive, JOB)
    good = path.read_bytes()
    with open(path, "r+b") as f:  # the HDF5 signature gone: h5py cannot open it
        f.write(b"\0" * 8)
    damaged = path.read_bytes()
    for _ in range(2):  # and again: the side file keeps waiting, nothing is lost
        _assert_waits(spool, archive, _ingest(spool, archive), damaged)
    path.write_bytes(good)  # the operator restores it from a backup
    _ingest(spool, archive)
    _assert_both(spool, archive)


def test_a_directory_where_the_series_file_was_is_left(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _n1_ingested(spool, archive)
    path = series_path(archive, JOB)
    aside = path.with_name("70.h5.aside")
    os.rename(path, aside)
    path.mkdir()
    (path / "keep").write_text("x")  # not an empty directory: rename(2) cannot replace it
    _assert_waits(spool, archive, _ingest(spool, archive), None)
    assert (path / "keep").read_text() == "x"
    (path / "keep").unlink()
    path.rmdir()
    os.rename(aside, path)
    _ingest(spool, archive)
    _assert_both(spool, archive)


def test_a_bug_in_the_build_quarantines_nothing_and_the_next_job_is_built(
        dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    spool, archive = dirs
    _n1_ingested(spool, archive)
    _reports(spool, 71, ["m1"])
    _side(spool, 71, "m1", 300.0)
    real_put = series_layout.put_row

    def buggy_put(f: Any, plan: Any, row: int, windows: Any) -> None:
        if plan.job_id == JOB:  # a bug where job 70's rows are written
            raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")
        real_put(f, plan, row, windows)

    monkeypatch.setattr(series_layout, "put_row", buggy_put)
    before = series_path(archive, JOB).read_bytes()
    res = _ingest(spool, archive)
    _assert_waits(spool, archive, res, before)  # 9058adc: quarantined with "TypeError: ..."
    s71 = read_series(archive, 71)
    assert s71 is not None and s71.nodes == ["m1"]  # the next job all the same
    monkeypatch.setattr(series_layout, "put_row", real_put)  # the bug fixed
    _ingest(spool, archive)
    _assert_both(spool, archive)


def test_a_side_file_that_breaks_its_load_is_quarantined_alone(
        dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """n2's file gains a partial record after its check (a writer still appending), so its
    strict load fails in the build: n2 alone is quarantined, n3 is built beside n1's rows
    (9058adc quarantined every new side file of the job, n3's good one too)."""
    spool, archive = dirs
    _reports(spool, JOB, ["n1", "n2", "n3"])
    _side(spool, JOB, "n1", 100.0)
    _ingest(spool, archive)
    _side(spool, JOB, "n2", 200.0)
    _side(spool, JOB, "n3", 300.0)
    real_check = series_ingest.check_side_file

    def check_then_append(probe: Any, *args: Any, **kwargs: Any) -> None:
        real_check(probe, *args, **kwargs)
        if probe.header.node == "n2":
            with open(spool / f"{JOB}.n2.series.bvts", "ab") as f:
                f.write(b"\1\2\3")

    monkeypatch.setattr(series_ingest, "check_side_file", check_then_append)
    res = _ingest(spool, archive)
    assert dict(res.quarantined) == {
        f"{JOB}.n2.series.bvts": "series side file: truncated record (3 trailing bytes)"}
    s = read_series(archive, JOB)
    assert s is not None and s.nodes == ["n1", "n3"]
    assert list(s.gpu["util_pct"][0, 0]) == [100, 101, 102, 103, 104, 105]
    assert list(s.gpu["util_pct"][1, 0]) == [300, 301, 302, 303, 304, 305]
