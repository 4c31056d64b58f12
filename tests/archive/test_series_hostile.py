"""The series ingest against one bad side file (issue 16 §3).

Each hostile side file is written byte for byte in the BVTS format (bluevela/telemetry/format.py)
as a user who controls a node's spool file could write it, beside a good job; one real ingest
must quarantine it with a clear reason and still build the good job's series. The memory
figures come from the ingest run in a child process (its own VmHWM) under an address-space limit
(RLIMIT_AS) so an allocation the size of the issue's (3.7 GiB) fails there for real instead of
taking the test machine's memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.series_layout import read_series
from bluevela.archive.spool import DONE_DIR, QUARANTINE_DIR, write_report
from bluevela.site import load_site

REPO = Path(__file__).resolve().parents[2]
T0 = 1_750_000_000.0
GOOD_COLS = ["gpu0.util_pct", "gpu1.util_pct", "node.cpu_busy_pct"]


def _side(spool: Path, job: int, node: str, times: list[float], cols: list[Any], *,
          interval: float = 10.0, components: dict[str, Any] | None = None) -> Path:
    """A side file `<job>.<node>.series.bvts`: `cols` are names (component = the part before
    the last '.') or ready {name, component, unit} dicts; record k holds k in every column."""
    columns = [c if isinstance(c, dict) else
               {"name": c, "component": c.rpartition(".")[0], "unit": "1"} for c in cols]
    head = {"node": node, "interval_s": interval, "start_unix_s": times[0], "columns": columns,
            "components": components or {}, "job_id": job}
    data = b"BVTS1\n" + json.dumps(head, separators=(",", ":")).encode() + b"\n"
    for k, t in enumerate(times):
        data += struct.pack(f"<d{len(columns)}f", t, *([float(k)] * len(columns)))
    path = spool / f"{job}.{node}.series.bvts"
    path.write_bytes(data)
    return path


def _reports(spool: Path, job: int, node: str, start: float = T0, end: float = T0 + 60) -> None:
    for phase, t in (("prolog", start), ("epilog", end)):
        write_report(spool, sample_report(job, node, phase, nodelist=[node], time=t))


def _good_job(spool: Path, job: int, node: str = "ok1") -> None:
    _reports(spool, job, node)
    _side(spool, job, node, [T0 + 10 * k for k in range(6)], GOOD_COLS)


def _assert_built(archive: Path, job: int, node: str = "ok1") -> None:
    s = read_series(archive, job)
    assert s is not None and s.nodes == [node] and s.gpu["util_pct"].shape == (1, 2, 6)
    assert list(s.gpu["util_pct"][0, 1]) == [0, 1, 2, 3, 4, 5]


def _gpu9999(spool: Path, job: int) -> Path:
    """The issue's file: one column of GPU 9999, two records 1e6 s apart (191 bytes)."""
    _reports(spool, job, "n1")
    return _side(spool, job, "n1", [T0, T0 + 1e6],
                 [{"name": "gpu9999.util_pct", "component": "gpu9999", "unit": "%"}])


def _in_child(tmp: Path, body: str, as_limit_gib: float = 2.0) -> dict[str, Any]:
    """Run `body` (it sets `out`) in a fresh interpreter under RLIMIT_AS; returns `out` with
    `maxrss_mib`, or {"rc", "stderr"} when the child failed."""
    code = textwrap.dedent(f"""
        import json, resource, sys
        from pathlib import Path
        lim = int({as_limit_gib} * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        spool, archive = Path({str(tmp / 'spool')!r}), Path({str(tmp / 'archive')!r})
        out = {{}}
    """) + textwrap.dedent(body) + textwrap.dedent("""
        # VmHWM, not ru_maxrss: after fork+exec ru_maxrss starts at the PARENT's peak (a
        # 750 MB pytest process in the whole suite), VmHWM is this process's own.
        hwm = [ln for ln in Path("/proc/self/status").read_text().splitlines()
               if ln.startswith("VmHWM:")]
        out["maxrss_mib"] = int(hwm[0].split()[1]) / 1024
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if k != "BV_SITE"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp)
    if p.returncode != 0:
        return {"rc": p.returncode, "stderr": p.stderr[-2000:]}
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


INGEST_BODY = """
    from bluevela.archive.ingest import ingest
    from bluevela.archive.series_layout import read_series
    res = ingest(spool, archive, now={now})
    out["quarantined"] = dict(res.quarantined)
    s = read_series(archive, 61)
    out["next_job_nodes"] = None if s is None else s.nodes
"""


def test_the_issues_191_byte_file_is_quarantined_in_bounded_memory(
        dirs: tuple[Path, Path], tmp_path: Path) -> None:
    spool, archive = dirs
    bad = _gpu9999(spool, 60)
    assert bad.stat().st_size == 191
    _good_job(spool, 61)
    out = _in_child(tmp_path, INGEST_BODY.format(now=T0 + 120))
    assert "rc" not in out, out  # 6c9e5ca: MemoryError (3.7 GiB asked under a 2 GiB limit)
    reason = out["quarantined"].get("60.n1.series.bvts", "")
    assert "GPU index 9999" in reason, out
    assert out["next_job_nodes"] == ["ok1"]  # the next job's series, in the same ingest
    assert out["maxrss_mib"] < 400, out  # far below the 3.7 GiB the file once asked for
    assert (spool / QUARANTINE_DIR / "60.n1.series.bvts").is_file()
    assert "GPU index 9999" in (spool / QUARANTINE_DIR / "60.n1.series.bvts.reason").read_text()
    assert read_series(archive, 60) is None


def _write_case(spool: Path, case: str, job: int) -> None:
    node = "n1"
    times = [T0 + 10 * k for k in range(6)]
    if case == "tiny interval":
        _reports(spool, job, node)
        _side(spool, job, node, times, GOOD_COLS, interval=1e-6)
    elif case == "duplicate metric":  # two columns, one GPU metric: one would overwrite the other
        _reports(spool, job, node)
        _side(spool, job, node, times, GOOD_COLS + [
            {"name": "util_pct", "component": "gpu0", "unit": "%"}])
    elif case == "slash in a name":
        _reports(spool, job, node)
        _side(spool, job, node, times, GOOD_COLS + ["gpu0.a/b"])
    elif case == "reserved name":  # gpu/uuid is the layout's own dataset
        _reports(spool, job, node)
        _side(spool, job, node, times, GOOD_COLS + ["gpu0.uuid"])
    elif case == "unknown component":
        _reports(spool, job, node)
        _side(spool, job, node, times, GOOD_COLS + ["../../x.y"])
    elif case == "too many ports":
        _reports(spool, job, node)
        _side(spool, job, node, times, [f"ib.mlx5_{i}/1.rx_bytes_per_s" for i in range(40)])
    elif case == "starts before the job":
        _reports(spool, job, node)
        _side(spool, job, node, [T0 - 86400.0] + times, GOOD_COLS)
    elif case == "ends in the future":
        _reports(spool, job, node)
        _side(spool, job, node, times + [T0 + 1e6], GOOD_COLS)
    elif case == "too many records":  # 100000 records in 50 s at 10 s
        _reports(spool, job, node)
        _side(spool, job, node, [T0 + k * 5e-4 for k in range(100_000)], ["node.cpu_busy_pct"])
    else:
        raise AssertionError(case)


CASES = {
    "tiny interval": "interval_s 1e-06 outside",
    "duplicate metric": "is not <component>.<metric>",
    "slash in a name": "metric 'a/b' is not a metric name",
    "reserved name": "metric 'uuid' is not a metric name",
    "unknown component": "unknown component",
    "too many ports": "more than 32 IB ports",
    "starts before the job": "s before the job",
    "ends in the future": "s after the job",
    "too many records": "100000 records in 50 s",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_side_file_is_quarantined_with_its_reason_and_the_next_job_is_built(
        dirs: tuple[Path, Path], case: str) -> None:
    spool, archive = dirs
    _write_case(spool, case, 60)
    _good_job(spool, 61)
    res = ingest(spool, archive, now=T0 + 120)
    q = dict(res.quarantined)
    assert list(q) == ["60.n1.series.bvts"], q
    assert CASES[case] in q["60.n1.series.bvts"], q
    assert read_series(archive, 60) is None
    _assert_built(archive, 61)
    assert not list(spool.glob("*.bvts"))  # nothing left to jam the next ingest
    again = ingest(spool, archive, now=T0 + 130)
    assert not again.quarantined


def test_gpu_index_is_judged_by_the_nodes_class(dirs: tuple[Path, Path]) -> None:
    """site.yaml: gpu[001-128] are h100 (8 GPUs); node1 is a CPU node (0 GPUs)."""
    from bluevela.archive.series_checks import SeriesLimits

    spool, archive = dirs
    times = [T0 + 10 * k for k in range(6)]
    for job, node, cols in ((70, "gpu001", [f"gpu{i}.util_pct" for i in range(8)]),
                            (71, "gpu002", ["gpu7.util_pct", "gpu8.util_pct"]),
                            (72, "node1", ["gpu0.util_pct"])):
        _reports(spool, job, node)
        _side(spool, job, node, times, cols)
    limits = SeriesLimits.from_site(load_site(REPO / "site.yaml"))
    res = ingest(spool, archive, now=T0 + 120, series_limits=limits)
    q = dict(res.quarantined)
    assert set(q) == {"71.gpu002.series.bvts", "72.node1.series.bvts"}
    assert "GPU index 8 outside the node's class (8 GPU(s))" in q["71.gpu002.series.bvts"]
    assert "GPU index 0 outside the node's class (0 GPU(s))" in q["72.node1.series.bvts"]
    s = read_series(archive, 70)
    assert s is not None and s.gpu["util_pct"].shape == (1, 8, 6)


def test_a_side_file_past_the_window_waits_for_its_report_then_is_quarantined(
        dirs: tuple[Path, Path]) -> None:
    """A late node's epilog spools its side file just before its report: a file that ends
    after the archived window (but not after now) waits while young, then is quarantined."""
    spool, archive = dirs
    _reports(spool, 80, "n1", end=T0 + 60)
    late = _side(spool, 80, "n1", [T0 + 10 * k for k in range(300)], GOOD_COLS)  # to T0+2990
    os.utime(late, (T0 + 3000, T0 + 3000))
    res = ingest(spool, archive, now=T0 + 3100)
    assert not res.quarantined and late.exists() and read_series(archive, 80) is None
    res = ingest(spool, archive, now=T0 + 3000 + 3601)
    assert "s after the job" in dict(res.quarantined)["80.n1.series.bvts"]


def test_a_side_file_of_an_attempt_not_archived_waits(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _reports(spool, 81, "n1")
    times = [T0 + 10 * k for k in range(6)]
    r1 = spool / "81.n1.r1.series.bvts"
    _side(spool, 81, "n1", times, GOOD_COLS).rename(r1)
    _side(spool, 81, "n1", times, GOOD_COLS)
    os.utime(r1, (T0, T0))
    res = ingest(spool, archive, now=T0 + 120)
    assert not res.quarantined and r1.exists()
    assert (spool / DONE_DIR / "81.n1.series.bvts").exists()
    res = ingest(spool, archive, now=T0 + 3601)
    assert "attempt 1 was never archived" in dict(res.quarantined)["81.n1.r1.series.bvts"]


MEMORY_BODY = """
    from bluevela.archive.ingest import ingest
    from bluevela.archive.series_checks import SeriesLimits
    from bluevela.archive.series_layout import read_series
    # Bounds lifted so the file reaches the build: the allocation itself must fail.
    res = ingest(spool, archive, now={now}, series_limits=SeriesLimits(max_node_bytes=1 << 50))
    out["quarantined"] = dict(res.quarantined)
    s = read_series(archive, 61)
    out["next_job_nodes"] = None if s is None else s.nodes
"""


def test_memory_error_in_a_build_quarantines_that_jobs_file_only(
        dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """A 30-day job at 0.1 s on 64 GPUs: one metric's row is 64 x 26M float32 (6.6 GiB),
    which the child's 2 GiB address space refuses: MemoryError, raised for real."""
    spool, archive = dirs
    end = T0 + 30 * 86400.0
    _reports(spool, 60, "n1", end=end)
    _side(spool, 60, "n1", [T0, end], ["gpu63.util_pct"], interval=0.1)
    _good_job(spool, 61)
    out = _in_child(tmp_path, MEMORY_BODY.format(now=end + 120))
    assert "rc" not in out, out
    assert out["quarantined"] == {
        "60.n1.series.bvts": "series side file: job 60 not built from it: out of memory"}
    assert out["next_job_nodes"] == ["ok1"]
    assert math.isfinite(out["maxrss_mib"])
