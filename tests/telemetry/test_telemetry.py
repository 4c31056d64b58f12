"""The node sampler, its BVTS format, the epilog's window cut and the per-job series archive.

Probes read the recorded H100 fixture (tests/data/health/h100-healthy: NVML snapshot + sysfs
tree); IB byte rates are checked on a copy of that tree whose counters are advanced.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.series_layout import read_series, series_path
from bluevela.archive.spool import DONE_DIR, QUARANTINE_DIR, write_report
from bluevela.health.context import ProbeContext
from bluevela.site import load_site
from bluevela.telemetry.format import (
    Column,
    FormatError,
    Header,
    SegmentWriter,
    cut_window,
    read_file,
)
from bluevela.telemetry.sampler import CgroupCPU, Config, NodeReader, Sampler
from bluevela.telemetry.window import write_side_file

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "tests" / "data" / "health" / "h100-healthy"
T0 = 1_750_000_000.0


def _ctx(root: Path = H100 / "root", snapshot: Path | None = H100 / "nvml.json") -> ProbeContext:
    site = load_site(REPO / "site.yaml")
    return ProbeContext(site.node_classes["h100"], "h100", root=root, nvml_snapshot=snapshot)


def _sampler(tmp: Path, ctx: ProbeContext | None = None, **kw: float) -> Sampler:
    cfg = Config(tmp / "samples", "gpu001", kw.get("interval", 10.0),
                 kw.get("retain_s", 48 * 3600.0), int(kw.get("max_bytes", 256 << 20)))
    return Sampler(ctx or _ctx(), cfg)


def _write_seg(samples: Path, node: str, start: float, cols: list[str], rows: list[list[float]],
               interval: float = 10.0) -> Path:
    samples.mkdir(parents=True, exist_ok=True)
    columns = tuple(Column(c, c.rpartition(".")[0], "1") for c in cols)
    path = samples / f"seg-{int(start)}.bvts"
    w = SegmentWriter(path, Header(node, interval, columns, start))
    for i, row in enumerate(rows):
        w.append(start + i * interval, row)
    w.close()
    return path


# -- format -----------------------------------------------------------------------------------


def test_format_round_trip_and_partial_last_record(tmp_path: Path) -> None:
    path = _write_seg(tmp_path, "n1", T0, ["gpu0.util_pct", "node.cpu_busy_pct"],
                      [[1.5, float("nan")], [2.5, 40.0]])
    seg = read_file(path)
    recs = list(seg.records())
    assert seg.header.node == "n1" and seg.header.names == ("gpu0.util_pct", "node.cpu_busy_pct")
    assert [r[0] for r in recs] == [T0, T0 + 10]
    assert recs[1][1] == (2.5, 40.0) and math.isnan(recs[0][1][1])
    with open(path, "ab") as fh:  # a record being written when the epilog reads
        fh.write(b"\x01\x02\x03")
    assert read_file(path).n_records == 2 and read_file(path).truncated == 3
    with pytest.raises(FormatError, match="truncated record"):
        read_file(path, strict=True)


def test_format_refuses_bad_magic_header_and_symlinks(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"NOTBVTS\n{}\n")
    (tmp_path / "b").write_bytes(b"BVTS1\n{\"node\": \"n\", \"interval_s\": -1, \"columns\": []}\n")
    (tmp_path / "c").write_bytes(b"BVTS1\n{\"node\": \"n\"")
    for name, msg in (("a", "bad magic"), ("b", "interval_s"), ("c", "not terminated")):
        with pytest.raises(FormatError, match=msg):
            read_file(tmp_path / name)
    real = _write_seg(tmp_path, "n1", T0, ["node.x"], [[1.0]])
    os.symlink(real, tmp_path / "link")
    with pytest.raises(OSError):
        read_file(tmp_path / "link")


# -- the sampler on the H100 fixture ----------------------------------------------------------


def test_sampler_columns_from_the_h100_fixture(tmp_path: Path) -> None:
    s = _sampler(tmp_path)
    s.record(T0)
    s.record(T0 + 10)
    s.store.writer.close()  # type: ignore[union-attr]
    [seg_name] = os.listdir(tmp_path / "samples")
    seg = read_file(tmp_path / "samples" / seg_name)
    names = seg.header.names
    assert len([n for n in names if n.startswith("gpu")]) == 8 * 7
    assert len([n for n in names if n.startswith("ib.")]) == 8 * 3
    assert "ib.mlx5_7/1.rx_bytes_per_s" in names and "node.cpu_throttled_pct" in names
    assert seg.header.components["gpu0"]["uuid"].startswith("GPU-")
    (_, first), (_, second) = list(seg.records())
    vals = dict(zip(names, second, strict=True))
    assert vals["gpu0.temp_c"] == 31.0 and abs(vals["gpu0.power_w"] - 69.81) < 0.01
    assert vals["gpu0.xid_count"] == 0.0 and vals["gpu0.clocks_event_reasons"] == 1.0
    assert vals["ib.mlx5_0/1.rx_bytes_per_s"] == 0.0  # static counters
    assert math.isnan(dict(zip(names, first, strict=True))["ib.mlx5_0/1.rx_bytes_per_s"])
    assert math.isnan(vals["gpu0.util_pct"])  # not in this snapshot: NaN, never invented


def test_sampler_ib_rates_and_snapshot_util_keys(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(H100 / "root" / "sys", root / "sys", symlinks=True)
    snap = tmp_path / "nvml.json"
    import json

    data = json.loads((H100 / "nvml.json").read_text())
    data["gpus"][3]["util_pct"] = 97
    data["gpus"][3]["sm_clock_mhz"] = 1980
    snap.write_text(json.dumps(data))
    s = _sampler(tmp_path, _ctx(root, snap))
    cdir = root / "sys/class/infiniband/mlx5_2/ports/1/counters"
    rcv = int((cdir / "port_rcv_data").read_text())
    s.sample(T0)
    (cdir / "port_rcv_data").write_text(f"{rcv + 2500}\n")  # 4-byte words
    (cdir / "symbol_error").write_text(f"{int((cdir / 'symbol_error').read_text()) + 30}\n")
    cols, vals, _ = s.sample(T0 + 10)
    v = dict(zip((c.name for c in cols), vals, strict=True))
    assert v["ib.mlx5_2/1.rx_bytes_per_s"] == pytest.approx(1000.0)  # 2500 * 4 B / 10 s
    assert v["ib.mlx5_2/1.errors_per_s"] == pytest.approx(3.0)
    assert v["ib.mlx5_1/1.rx_bytes_per_s"] == 0.0
    assert v["gpu3.util_pct"] == 97.0 and v["gpu3.sm_clock_mhz"] == 1980.0


def test_sampler_counts_new_xids_per_gpu(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("[  10.0] NVRM: Xid (PCI:0000:18:00): 13, old one\n")
    ctx = _ctx()
    ctx = ProbeContext(ctx.node_class, "h100", root=ctx.root, nvml_snapshot=ctx.nvml_snapshot,
                       kmsg=kmsg)
    s = _sampler(tmp_path, ctx)
    s.sample(T0)
    with open(kmsg, "a") as fh:
        fh.write("[  20.0] NVRM: Xid (PCI:0000:18:00): 79, fallen off the bus\n")
    cols, vals, _ = s.sample(T0 + 10)
    v = dict(zip((c.name for c in cols), vals, strict=True))
    xids = {n: x for n, x in v.items() if n.endswith("xid_count")}
    assert sum(xids.values()) == 1.0  # the old line is before the sampler started


def test_cgroup_v1_split_hierarchies_and_v2(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu" / "bv9" / "node1"
    acct = tmp_path / "cpuacct" / "bv9" / "node1"
    cpu.mkdir(parents=True)
    acct.mkdir(parents=True)

    def v1(usage_ns: int, periods: int, throttled: int) -> None:
        (cpu / "cpu.stat").write_text(f"nr_periods {periods}\nnr_throttled {throttled}\n"
                                      "throttled_time 0\n")
        (acct / "cpuacct.usage").write_text(f"{usage_ns}\n")

    v1(0, 0, 0)
    r = NodeReader(Path("/"), CgroupCPU.find(cpu), ncpu=2)
    r.read(T0)
    v1(int(10e9), 100, 25)  # 10 CPU-seconds over 10 s on 2 CPUs; 25 of 100 periods throttled
    out = r.read(T0 + 10)
    assert out["cpu_busy_pct"] == pytest.approx(50.0)
    assert out["cpu_throttled_pct"] == pytest.approx(25.0)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 0\nnr_periods 0\nnr_throttled 0\n")
    r2 = NodeReader(Path("/"), CgroupCPU.find(v2), ncpu=4)
    r2.read(T0)
    (v2 / "cpu.stat").write_text("usage_usec 4000000\nnr_periods 10\nnr_throttled 0\n")
    out = r2.read(T0 + 1)
    assert out["cpu_busy_pct"] == pytest.approx(100.0) and out["cpu_throttled_pct"] == 0.0


def test_retention_by_age_and_size(tmp_path: Path) -> None:
    samples = tmp_path / "samples"
    now = T0 + 100 * 3600
    for h in range(0, 100, 10):  # segments every 10 h, ~ 1 KB each
        _write_seg(samples, "n1", T0 + h * 3600, ["node.x"], [[1.0]] * 80)
    s = _sampler(tmp_path, retain_s=48 * 3600.0)
    removed = s.store.prune(now)
    # A segment goes once the next one started more than 48 h ago.
    assert sorted(removed) == [f"seg-{int(T0 + h * 3600)}.bvts" for h in range(0, 50, 10)]
    size = (samples / f"seg-{int(T0 + 90 * 3600)}.bvts").stat().st_size
    s2 = _sampler(tmp_path, retain_s=1e9, max_bytes=2 * size)
    s2.store.prune(now)
    assert sorted(os.listdir(samples)) == [f"seg-{int(T0 + h * 3600)}.bvts" for h in (80, 90)]


def test_sampler_restart_appends_a_new_segment_and_sigterm_is_clean(tmp_path: Path) -> None:
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
               BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(H100 / "root"),
               BV_NVML_SNAPSHOT=str(H100 / "nvml.json"), BV_STATE_DIR=str(tmp_path),
               BV_SAMPLER_INTERVAL_S="0.2")
    samples = tmp_path / "samples"
    for _ in range(2):
        n_before = len(os.listdir(samples)) if samples.exists() else 0
        p = subprocess.Popen([sys.executable, "-I", "-m", "bluevela.telemetry.sampler"],
                             env=env, cwd="/", stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            segs = sorted(samples.glob("seg-*.bvts")) if samples.exists() else []
            if len(segs) > n_before and read_file(segs[-1]).n_records >= 3:
                break
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=10)
        assert p.returncode == 0, err.decode()
        assert b"Traceback" not in err and b"stopped after" in err
    segs = sorted(samples.glob("seg-*.bvts"))
    assert len(segs) == 2  # the restart wrote a new segment, never into the old one
    for seg in segs:
        assert read_file(seg, strict=True).n_records >= 3  # whole records only


# -- the epilog's cut ---------------------------------------------------------------------------


def test_window_cut_unions_columns_and_keeps_the_window(tmp_path: Path) -> None:
    samples = tmp_path / "samples"
    _write_seg(samples, "n1", T0, ["gpu0.util_pct", "gpu1.util_pct"],
               [[float(i), float(i)] for i in range(6)])
    # GPU1 fell off the bus: the next segment lacks it.
    _write_seg(samples, "n1", T0 + 60, ["gpu0.util_pct"], [[float(i)] for i in range(6)])
    header, data = cut_window(samples, T0 + 20, T0 + 80, node="n1", job_id=5)  # type: ignore[misc]
    assert header.names == ("gpu0.util_pct", "gpu1.util_pct") and header.job_id == 5
    recs = list(struct.iter_unpack("<d2f", data))
    assert [r[0] - T0 for r in recs] == [20, 30, 40, 50, 60, 70, 80]
    assert recs[-1][1] == 2.0 and math.isnan(recs[-1][2]) and recs[0][2] == 2.0
    assert cut_window(samples, T0 + 1000, T0 + 2000, node="n1") is None
    spool = tmp_path / "spool"
    path = write_side_file(spool, samples, 5, "n1", T0 + 30, T0 + 80, 10.0)
    assert path == spool / "5.n1.series.bvts"
    assert read_file(path, strict=True).n_records == 7  # 20..80: from start - interval
    assert not [p for p in os.listdir(spool) if p.endswith(".tmp")]


# -- ingest: the per-job series file ----------------------------------------------------------


def _job(spool: Path, samples_root: Path, job_id: int, nodes: list[str], node: str,
         offset: float = 0.0, drop: int | None = None, n: int = 6) -> None:
    """Reports and a side file for `node` of a job on 2 GPUs, 1 port; sample k of node i has
    util = 10*i + k, taken `offset` s after the grid point (node clocks differ)."""
    i = nodes.index(node)
    cols = ["gpu0.util_pct", "gpu1.util_pct", "ib.mlx5_0/1.rx_bytes_per_s",
            "node.cpu_busy_pct"][: 4 if i == 0 else 2] + ["node.cpu_busy_pct"] * (i != 0)
    cols = list(dict.fromkeys(cols))
    samples = samples_root / node / "samples"
    rows = []
    for k in range(n):
        rows.append([10.0 * i + k] * len(cols))
    seg = _write_seg(samples, node, T0 + offset, cols, rows)
    if drop is not None:  # a missed sample: rewrite without row `drop`
        seg.unlink()
        w = SegmentWriter(seg, Header(node, 10.0, tuple(Column(c, c.rpartition(".")[0], "1")
                                                          for c in cols), T0))
        for k, row in enumerate(rows):
            if k != drop:
                w.append(T0 + offset + 10 * k, row)
        w.close()
    write_side_file(spool, samples, job_id, node, T0 + 10, T0 + 10 * n, 10.0)
    for phase in ("prolog", "epilog"):
        write_report(spool, sample_report(job_id, node, phase, nodelist=nodes,
                                          time=T0 + (60 if phase == "epilog" else 0)))


def test_ingest_builds_aligned_series_and_is_idempotent(dirs: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["a1", "a2"]
    _job(spool, tmp_path, 40, nodes, "a1")
    _job(spool, tmp_path, 40, nodes, "a2", offset=3.0, drop=2)  # 3 s late, one sample missed
    res = ingest(spool, archive, now=T0 + 120)
    assert res.jobs_archived == [40] and not res.quarantined
    with h5py.File(series_path(archive, 40), "r") as f:  # h5py alone
        assert f.attrs["format"] == "bluevela-job-series" and f.attrs["schema_version"] == 1
        assert f.attrs["interval_s"] == 10.0 and f.attrs["t0_unix_s"] == T0
        assert [n.decode() for n in f["nodes"][()]] == nodes
        util = f["gpu/util_pct"][()]
        assert util.shape == (2, 2, 6) and f["gpu/util_pct"].attrs["unit"] == "1"
        assert list(f["time"][()] - T0) == [0, 10, 20, 30, 40, 50]
        assert list(util[0, 0]) == [0, 1, 2, 3, 4, 5]
        a2 = util[1, 0]
        assert list(a2[[0, 1, 3, 4, 5]]) == [10, 11, 13, 14, 15] and math.isnan(a2[2])
        assert f["ib/rx_bytes_per_s"].shape == (2, 1, 6)
        assert np.isnan(f["ib/rx_bytes_per_s"][1]).all()  # a2 has no port
        assert f["ib/port"][0, 0] == b"mlx5_0/1"
    assert sorted(os.listdir(spool / DONE_DIR)).count("40.a1.series.bvts") == 1
    assert not list(spool.glob("*.bvts"))
    # Re-ingest of the same side file: nothing added twice, the file unchanged.
    before = series_path(archive, 40).stat().st_mtime_ns
    shutil.copy(spool / DONE_DIR / "40.a2.series.bvts", spool / "40.a2.series.bvts")
    res = ingest(spool, archive, now=T0 + 130)
    assert not res.quarantined and not list(spool.glob("*.bvts"))
    assert series_path(archive, 40).stat().st_mtime_ns == before
    s = read_series(archive, 40)
    assert s is not None and s.nodes == nodes and s.gpu["util_pct"].shape == (2, 2, 6)


def test_late_node_is_added_by_rewriting_the_series_file(dirs: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["b1", "b2", "b3"]
    _job(spool, tmp_path, 41, nodes, "b1")
    _job(spool, tmp_path, 41, nodes, "b2")
    assert ingest(spool, archive, now=T0 + 60 + 601).jobs_timed_out == [41]
    assert read_series(archive, 41).nodes == ["b1", "b2"]  # type: ignore[union-attr]
    _job(spool, tmp_path, 41, nodes, "b3", n=8)  # the late node ran 20 s longer
    ingest(spool, archive, now=T0 + 2000)
    s = read_series(archive, 41)
    assert s is not None and s.nodes == nodes and len(s.time) == 8
    assert list(s.gpu["util_pct"][2, 0]) == [20 + k for k in range(8)]
    assert list(s.gpu["util_pct"][0, 0, :6]) == [0, 1, 2, 3, 4, 5]
    assert np.isnan(s.gpu["util_pct"][0, 0, 6:]).all()


def test_hostile_side_files_are_quarantined(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["c1", "c2", "c3", "c4", "c5"]
    for node in nodes:
        _job(spool, tmp_path, 42, nodes, node)
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    os.unlink(spool / "42.c2.series.bvts")
    os.symlink(secret, spool / "42.c2.series.bvts")
    (spool / "42.c3.series.bvts").write_bytes(b"BVTS1\nnot json\n")
    with open(spool / "42.c4.series.bvts", "ab") as fh:
        fh.write(b"\0" * 5)  # a truncated record
    good = (spool / "42.c1.series.bvts").read_bytes()
    (spool / "42.c5.series.bvts").write_bytes(good)  # says it is c1
    res = ingest(spool, archive, now=T0 + 120)
    q = dict(res.quarantined)
    assert set(q) == {f"42.{n}.series.bvts" for n in ("c2", "c3", "c4", "c5")}
    assert "symlink" in q["42.c2.series.bvts"] and "header" in q["42.c3.series.bvts"]
    assert "truncated" in q["42.c4.series.bvts"] and "does not match" in q["42.c5.series.bvts"]
    assert (spool / QUARANTINE_DIR / "42.c2.series.bvts").is_symlink()
    assert secret.read_text() == "root only\n"
    assert read_series(archive, 42).nodes == ["c1"]  # type: ignore[union-attr]


def test_side_files_wait_until_their_job_is_archived(dirs: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    spool, archive = dirs
    nodes = ["d1", "d2"]
    _job(spool, tmp_path, 43, nodes, "d1")  # d2 has not reported yet
    res = ingest(spool, archive, now=T0 + 120)
    assert res.waiting_jobs == [43] and (spool / "43.d1.series.bvts").exists()
    assert read_series(archive, 43) is None


def test_sampler_stop_event_ends_the_loop(tmp_path: Path) -> None:
    s = _sampler(tmp_path, interval=0.05)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t = time.monotonic()
    assert s.run(stop) == 0 and time.monotonic() - t < 5
    assert s.store.writer is None and s.samples_taken >= 2


@pytest.mark.parametrize("site", ["/nonexistent/site.yaml", "relative/site.yaml"])
def test_sampler_bad_site_is_one_line_and_exit_2(tmp_path: Path, site: str) -> None:
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=site, BV_CACHE_DIR="off",
               BV_STATE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-I", "-m", "bluevela.telemetry.sampler"], env=env,
                       cwd="/", capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("bv-sampler: "), p.stderr
    assert not (tmp_path / "samples").exists()


def test_a_killed_writers_temporary_series_file_is_removed(dirs: tuple[Path, Path],
                                                           tmp_path: Path) -> None:
    spool, archive = dirs
    (archive / "series").mkdir()
    stale = archive / "series" / ".44.h5.999999.tmp"
    stale.write_bytes(b"half an HDF5 file")
    _job(spool, tmp_path, 44, ["e1"], "e1")
    ingest(spool, archive, now=T0 + 120)
    assert not stale.exists() and read_series(archive, 44).nodes == ["e1"]  # type: ignore[union-attr]
    assert sorted(os.listdir(archive / "series")) == ["44.h5"]


def test_gpu_class_without_nvml_samples_the_rest(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A GPU class whose NVML does not start: the NVML source is the snapshot gather_live
    recorded on a VM with no driver (init_error "NVML Shared Library Not Found"), so the test
    holds on a machine with GPUs too. The sampler warns exactly once, records the 8 GPUs of
    the class as missing, and still records the IB ports and the node."""
    no_driver = REPO / "tests" / "data" / "health" / "nvml-real-no-driver.json"
    s = _sampler(tmp_path, _ctx(snapshot=no_driver))
    caplog.set_level("WARNING", logger="bluevela.telemetry.gpu")
    for i in range(3):
        cols, vals, comps = s.sample(T0 + 10 * i)
    names = [c.name for c in cols]
    v = dict(zip(names, vals, strict=True))
    assert not [n for n in names if n.startswith("gpu")] and set(comps) == {"node"}
    assert "ib.mlx5_0/1.rx_bytes_per_s" in names and "node.cpu_busy_pct" in names
    assert v["ib.mlx5_0/1.rx_bytes_per_s"] == 0.0 and v["node.mem_used_bytes"] > 0
    assert v["node.gpus_missing"] == 8.0 and v["node.nvml_hung_s"] == 0.0
    warned = [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()]
    assert warned == ["NVML: NVML Shared Library Not Found"], warned


def test_epilog_step_spools_the_window_from_the_prolog_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bluevela.telemetry.window import spool_series

    state, spool = tmp_path / "state", tmp_path / "spool"
    _write_seg(state / "samples", "n1", T0, ["node.cpu_busy_pct"], [[float(i)] for i in range(30)])
    site = load_site(REPO / "site.yaml")
    for k, v in {"BV_STATE_DIR": state, "BV_SPOOL_DIR": spool, "BV_SAMPLER_INTERVAL_S": 10}.items():
        monkeypatch.setenv(k, str(v))
    assert spool_series(site, 9, "n1", None, now=T0 + 200) is None  # no start: nothing
    path = spool_series(site, 9, "n1", {"time": T0 + 100.0}, now=T0 + 200)
    seg = read_file(path, strict=True)  # type: ignore[arg-type]
    assert [t - T0 for t, _ in seg.records()] == [90.0 + 10 * k for k in range(12)]
    assert seg.header.job_id == 9 and oct(os.stat(path).st_mode & 0o777) == "0o644"
