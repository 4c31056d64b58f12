"""The node sampler and the per-job series archive: overhead, bytes, ingest time and memory.

- Sampler overhead: the real daemon (`python -I -m bluevela.telemetry.sampler`) against the
  recorded H100 fixture (8 GPUs from an NVML snapshot, 8 IB ports from a sysfs tree, /proc of
  this machine), at 1 s and at 10 s, run side by side for 60 s (20 s with `--quick`), then
  SIGTERM. CPU share of one core from /proc/<pid>/stat between 5 s after start and the end
  (steady state, start-up excluded; start-up reported apart), RSS from /proc/<pid>/status.
  No GPU here: live NVML's own cost is not in these figures; the cost of one sample with the
  snapshot parsed afresh (as a live read would build it) is reported separately.
- Faults (`BV_BENCH_TELEMETRY=faults` runs these alone): sample() with NVML read on its worker
  thread against the same reading inline (interleaved rounds, median ratio and quartiles); a
  tick while the recorded hung-NVML snapshot blocks (the first waits the deadline, later ones
  not); SIGTERM to exit of the real sampler whose libnvidia-ml (a C stand-in) hangs in
  nvmlInit; on a full 64 KiB tmpfs (root): descriptors gained, write attempts under backoff,
  intervals from space freed to the first new segment.
- Archive: a synthetic job of 1,000 nodes (`BV_BENCH_SERIES_NODES`; 20 with `--quick`) x 24 h
  at 10 s, 8 GPUs and 8 ports per node, with noisy values shaped like a training job (GPU util 90-100 % with
  checkpoint dips, power following util, integer temperatures drifting, SM clock with
  occasional throttles, IB rates with bursts), written as the epilog's side files and ingested
  by the real `ingest` in a child process (its peak RSS: VmHWM). With fewer nodes the
  1,000-node figures are extrapolated linearly (the file is chunked per node; ingest works one
  node at a time) and say so. Peak RSS is also measured at a quarter of the nodes: it must not
  grow with the node count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import PY, REPO, Figure

sys.path.insert(0, str(REPO))

H100 = REPO / "tests" / "data" / "health" / "h100-healthy"
T0 = 1_767_225_600.0  # 2026-01-01
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _run_sampler(interval: float, duration: float, state: Path, out: dict[str, float]) -> None:
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
               BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(H100 / "root"),
               BV_NVML_SNAPSHOT=str(H100 / "nvml.json"), BV_STATE_DIR=str(state),
               BV_SAMPLER_INTERVAL_S=str(interval), BV_HOOK_LOG_LEVEL="WARNING")
    t_start = time.monotonic()
    p = subprocess.Popen([PY, "-I", "-m", "bluevela.telemetry.sampler"], env=env, cwd="/",
                         stdout=subprocess.DEVNULL)
    time.sleep(5)
    c0, w0 = _cpu_s(p.pid), time.monotonic()
    out["startup_cpu_s"] = c0
    time.sleep(max(1.0, duration - (time.monotonic() - t_start)))
    c1, w1 = _cpu_s(p.pid), time.monotonic()
    out["rss_mb"] = _rss_mb(p.pid)
    out["cpu_pct"] = 100.0 * (c1 - c0) / (w1 - w0)
    p.send_signal(signal.SIGTERM)
    out["exit"] = p.wait(timeout=60)
    segs = sorted((state / "samples").glob("seg-*.bvts"))
    out["bytes"] = sum(s.stat().st_size for s in segs)
    from bluevela.telemetry.format import read_file

    out["records"] = sum(read_file(s).n_records for s in segs)
    out["record_bytes"] = read_file(segs[-1]).header.record_size if segs else float("nan")


def _sample_cost_ms() -> float:
    """One sample with the snapshot parsed afresh each time (no replay cache)."""
    from bluevela.health.context import ProbeContext
    from bluevela.site import load_site
    from bluevela.telemetry.sampler import Config, Sampler

    site = load_site(REPO / "site.yaml")
    ctx = ProbeContext(site.node_classes["h100"], "h100", root=H100 / "root",
                       nvml_snapshot=H100 / "nvml.json")
    s = Sampler(ctx, Config(Path("/nonexistent"), "gpu001", 10.0, 1e9, 1 << 30))
    n = 50
    t = time.perf_counter()
    for i in range(n):
        s.gpu._cache = None
        s.sample(T0 + 10 * i)
    return 1000 * (time.perf_counter() - t) / n


# -- a synthetic job --------------------------------------------------------------------------


def _node_rows(rng: Any, T: int, node_i: int) -> tuple[list[str], Any]:
    """Columns and a [T, C] float32 matrix of one node's day, noisy like a training job."""
    import numpy as np

    cols: list[str] = []
    mats: list[Any] = []
    k = np.arange(T)
    ckpt = (k % 180) < 3  # a 30 s checkpoint every 30 min: GPUs idle
    for g in range(8):
        util = np.clip(np.rint(rng.normal(96, 2.5, T)), 0, 100)
        util[ckpt] = rng.integers(0, 5, ckpt.sum())
        power = np.round(180 + 5.0 * util + rng.normal(0, 15, T), 3)
        temp = np.rint(60 + 0.1 * util + np.cumsum(rng.normal(0, 0.05, T)).clip(-8, 8))
        mem = np.full(T, 71.5e9 + g * 1e8) + np.repeat(rng.integers(0, 64, T // 360 + 1),
                                                       360)[:T] * (1 << 21)
        clock = np.full(T, 1980.0)
        throttle = rng.random(T) < 0.01
        clock[throttle] = rng.integers(1600, 1900, throttle.sum())
        reasons = np.where(throttle, 4.0, 0.0)
        reasons[ckpt] = 1.0
        xid = np.zeros(T)
        for m, v in (("util_pct", util), ("mem_used_bytes", mem), ("power_w", power),
                     ("temp_c", temp), ("sm_clock_mhz", clock),
                     ("clocks_event_reasons", reasons), ("xid_count", xid)):
            cols.append(f"gpu{g}.{m}")
            mats.append(v)
    for p in range(8):
        base = rng.normal(38e9, 4e9, T).clip(0)
        base[ckpt] = rng.normal(2e8, 5e7, ckpt.sum()).clip(0)
        for m, v in (("rx_bytes_per_s", np.round(base * rng.normal(1, 0.02, T))),
                     ("tx_bytes_per_s", np.round(base * rng.normal(1, 0.02, T))),
                     ("errors_per_s", (rng.random(T) < 0.001) * 0.1)):
            cols.append(f"ib.mlx5_{p}/1.{m}")
            mats.append(v)
    node = {"cpu_busy_pct": rng.normal(25, 5, T).clip(0, 100),
            "cpu_throttled_pct": np.zeros(T),
            "mem_used_bytes": 5.1e11 + np.cumsum(rng.normal(0, 1e7, T)),
            "net_rx_bytes_per_s": rng.lognormal(13, 1, T),
            "net_tx_bytes_per_s": rng.lognormal(12, 1, T)}
    for m, v in node.items():
        cols.append(f"node.{m}")
        mats.append(v)
    del node_i
    return cols, np.stack(mats, axis=1).astype(np.float32)


def _spool_job(spool: Path, job_id: int, n_nodes: int, T: int, interval: float, *,
               series: bool) -> int:
    """The epilog's reports (`series=False`) or side files (`series=True`) of a synthetic
    job; returns the bytes written."""
    import numpy as np

    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import series_name, write_report
    from bluevela.telemetry.format import Column, Header

    rng = np.random.default_rng(12)
    nodes = [f"gpu{i:04d}" for i in range(1, n_nodes + 1)]
    total = 0
    for i, node in enumerate(nodes):
        if not series:
            for phase in ("prolog", "epilog"):
                total += write_report(spool, sample_report(
                    job_id, node, phase, nodelist=nodes,
                    time=T0 + (T * interval if phase == "epilog" else 0))).stat().st_size
            continue
        cols, mat = _node_rows(rng, T, i)
        columns = tuple(Column(c, c.rpartition(".")[0], "") for c in cols)
        header = Header(node, interval, columns, T0, {f"gpu{g}": {"uuid": f"GPU-{i:04d}-{g}"}
                                                     for g in range(8)}, job_id)
        rec = np.empty(T, dtype=[("t", "<f8"), ("v", "<f4", (len(cols),))])
        rec["t"] = T0 + np.arange(T) * interval + rng.normal(0, 0.05, T)
        rec["v"] = mat
        data = header.encode() + rec.tobytes()
        (spool / series_name(job_id, node)).write_bytes(data)
        total += len(data)
    return total


_INGEST = """
import json, sys, time
from pathlib import Path
from bluevela.archive.ingest import ingest
t = time.perf_counter()
r = ingest(Path(sys.argv[1]), Path(sys.argv[2]), compact=False)
# The peak of this process's own memory (VmHWM): getrusage's ru_maxrss after fork+exec can
# report the parent's peak on Linux.
status = Path("/proc/self/status").read_text()
hwm_kb = int(status.split("VmHWM:")[1].split()[0])
print(json.dumps({"seconds": time.perf_counter() - t, "jobs": r.jobs_archived,
                  "quarantined": len(r.quarantined),
                  "maxrss_mb": hwm_kb / 1024}))
"""


def _ingest(spool: Path, archive: Path) -> dict[str, Any]:
    out = subprocess.run([PY, "-c", _INGEST, str(spool), str(archive)], capture_output=True,
                         text=True, check=True, timeout=3600)
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def _ingest_job(tmp: Path, n_nodes: int, T: int) -> dict[str, Any]:
    """Reports first (the job is archived), then the side files: the second ingest is the
    series file alone, its time and peak RSS apart from the reports'."""
    spool, archive = tmp / f"spool{n_nodes}", tmp / f"archive{n_nodes}"
    spool.mkdir()
    archive.mkdir()
    _spool_job(spool, 7, n_nodes, T, 10.0, series=False)
    reports = _ingest(spool, archive)
    side = _spool_job(spool, 7, n_nodes, T, 10.0, series=True)
    res = _ingest(spool, archive)
    assert not res["quarantined"], res
    res["reports_seconds"] = reports["seconds"]
    res["reports_maxrss_mb"] = reports["maxrss_mb"]
    path = archive / "series" / "7.h5"
    res["file_bytes"] = path.stat().st_size
    res["side_bytes"] = side
    t = time.perf_counter()
    import h5py

    with h5py.File(path, "r") as f:  # what an efficiency view reads: one metric, all nodes
        f["gpu/util_pct"][()]
    res["read_util_s"] = time.perf_counter() - t
    shutil.rmtree(spool)
    return res


# -- faults (issue 16 section 2) ----------------------------------------------------------------

HUNG_NVML_C = """
#include <unistd.h>
int nvmlInitWithFlags(unsigned int f) { (void)f; for (;;) pause(); return 0; }
int nvmlInit_v2(void) { for (;;) pause(); return 0; }
"""


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    import statistics

    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def _h100_sampler(snapshot: Path, samples: Path, interval: float = 10.0) -> Any:
    from bluevela.health.context import ProbeContext
    from bluevela.site import load_site
    from bluevela.telemetry.sampler import Config, Sampler

    site = load_site(REPO / "site.yaml")
    ctx = ProbeContext(site.node_classes["h100"], "h100", root=H100 / "root",
                       nvml_snapshot=snapshot)
    return Sampler(ctx, Config(samples, "gpu001", interval, 1e9, 1 << 30))


def _thread_vs_direct(rounds: int, per_round: int = 20) -> tuple[list[float], float, float]:
    """sample() with NVML read through the worker thread (as now) against the same sample()
    with the reading called on the loop's thread (as before), interleaved: per-round ratios."""
    threaded = _h100_sampler(H100 / "nvml.json", Path("/nonexistent"))
    direct = _h100_sampler(H100 / "nvml.json", Path("/nonexistent"))
    direct.gpu.worker.get = lambda deadline_s, max_age_s: direct.gpu._fetch()
    ratios, ta, tb = [], [], []
    for r in range(rounds):
        times = []
        for s in (threaded, direct) if r % 2 else (direct, threaded):
            t = time.perf_counter()
            for i in range(per_round):
                s.sample(T0 + 10 * i)
            times.append((time.perf_counter() - t) / per_round)
        a, b = (times[1], times[0]) if r % 2 == 0 else (times[0], times[1])
        ta.append(a)
        tb.append(b)
        ratios.append(a / b)
    return ratios, 1000 * sorted(ta)[len(ta) // 2], 1000 * sorted(tb)[len(tb) // 2]


def _hung_ticks(n: int) -> tuple[float, list[float]]:
    """Tick times (ms) with the recorded hung-NVML snapshot: the first waits the deadline."""
    s = _h100_sampler(REPO / "tests/data/health/h100-gpu-nvml-hang/nvml.json",
                      Path("/nonexistent"), interval=0.2)
    t = time.perf_counter()
    s.sample(T0)
    first = 1000 * (time.perf_counter() - t)
    rest = []
    for i in range(1, n):
        t = time.perf_counter()
        s.sample(T0 + 0.2 * i)
        rest.append(1000 * (time.perf_counter() - t))
    return first, rest


def _sigterm_exit_hung(tmp: Path, runs: int) -> list[float]:
    """SIGTERM to exit (s) of the real sampler whose libnvidia-ml hangs in nvmlInit."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return []
    (tmp / "hung.c").write_text(HUNG_NVML_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp / "libnvidia-ml.so.1"),
                    str(tmp / "hung.c")], check=True, capture_output=True)
    out = []
    for k in range(runs):
        env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
                   BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(H100 / "root"),
                   BV_NVML_SNAPSHOT="", BV_STATE_DIR=str(tmp / f"hung{k}"),
                   BV_SAMPLER_INTERVAL_S="1", BV_HOOK_LOG_LEVEL="WARNING",
                   LD_LIBRARY_PATH=str(tmp))
        p = subprocess.Popen([PY, "-I", "-m", "bluevela.telemetry.sampler"], env=env, cwd="/",
                             stderr=subprocess.DEVNULL)
        time.sleep(3)
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
            out.append(time.monotonic() - t)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            out.append(float("inf"))
    return out


def _full_disk(tmp: Path, interval: float = 0.05, seconds: float = 5.0) -> dict[str, float]:
    """The real sampler on a full 64 KiB tmpfs: descriptors gained, write attempts, and how
    many intervals after space returns the first record lands (root only)."""
    mnt = tmp / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        return {}
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        for size in (4096, 512, 8):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
        os.close(fd)
        env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(REPO / "site.yaml"),
                   BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(H100 / "root"),
                   BV_NVML_SNAPSHOT=str(H100 / "nvml.json"), BV_STATE_DIR=str(mnt),
                   BV_SAMPLER_INTERVAL_S=str(interval), BV_HOOK_LOG_LEVEL="DEBUG")
        p = subprocess.Popen([PY, "-I", "-m", "bluevela.telemetry.sampler"], env=env, cwd="/",
                             stderr=subprocess.PIPE)
        time.sleep(1.5)
        fd0 = len(os.listdir(f"/proc/{p.pid}/fd"))
        time.sleep(seconds)
        fd1 = len(os.listdir(f"/proc/{p.pid}/fd"))
        (mnt / "filler").unlink()
        t = time.monotonic()
        while not list((mnt / "samples").glob("seg-*.bvts")) and time.monotonic() - t < 60:
            time.sleep(interval / 5)
        back = time.monotonic() - t
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        attempts = err.decode().count("sample not written")
        return {"fd_growth": fd1 - fd0, "ticks": (seconds + 1.5) / interval,
                "attempts": attempts, "recovery_intervals": back / interval}
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fault_figures(tmp: Path, quick: bool) -> Iterator[Figure]:
    ratios, a_ms, b_ms = _thread_vs_direct(10 if quick else 40)
    q1, med, q3 = _quartiles(ratios)
    yield Figure("sampler_sample_ms_nvml_thread_vs_inline", med, "ratio", "<= 1.2",
                 f"thread {a_ms:.2f} ms / inline {b_ms:.2f} ms, median of {len(ratios)} "
                 f"interleaved rounds, quartiles {q1:.3f}-{q3:.3f}")
    first, rest = _hung_ticks(30)
    q1, med, q3 = _quartiles(rest)
    yield Figure("sampler_sample_ms_nvml_hung_first", first, "ms", "<= 150",
                 "the first tick waits the deadline (half of a 0.2 s interval)")
    yield Figure("sampler_sample_ms_nvml_hung_later", med, "ms", "",
                 f"no wait while the call hangs; quartiles {q1:.2f}-{q3:.2f}, {len(rest)} ticks")
    exits = _sigterm_exit_hung(tmp, 3 if quick else 5)
    if exits:
        yield Figure("sampler_sigterm_exit_s_nvml_hung", max(exits), "s", "<= 2",
                     f"worst of {len(exits)} (median {sorted(exits)[len(exits) // 2]:.2f} s); "
                     "hung libnvidia-ml stand-in, 1 s interval")
    disk = _full_disk(tmp)
    if disk:
        yield Figure("sampler_full_disk_fd_growth", disk["fd_growth"], "fds", "<= 0",
                     f"over {disk['ticks']:.0f} ticks of 0.05 s on a full 64 KiB tmpfs")
        yield Figure("sampler_full_disk_write_attempts", disk["attempts"], "attempts", "",
                     f"of {disk['ticks']:.0f} ticks (backoff 1, 2, 4 ... 32 intervals)")
        yield Figure("sampler_full_disk_recovery_intervals", disk["recovery_intervals"],
                     "intervals", "<= 33", "from space freed to the first new segment")


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    quick = getattr(args, "quick", False)
    if os.environ.get("BV_BENCH_TELEMETRY") == "faults":  # the fault figures alone
        with tempfile.TemporaryDirectory(prefix="bv-bench-telemetry-") as d:
            yield from fault_figures(Path(d), quick)
        return
    duration = 20.0 if quick else 60.0
    with tempfile.TemporaryDirectory(prefix="bv-bench-telemetry-") as d:
        tmp = Path(d)
        runs: dict[float, dict[str, float]] = {1.0: {}, 10.0: {}}
        threads = [threading.Thread(target=_run_sampler,
                                    args=(iv, duration, tmp / f"state{int(iv)}", runs[iv]))
                   for iv in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        note = f"H100 fixture replay, {duration:.0f} s, steady state"
        for iv, r in runs.items():
            yield Figure(f"sampler_cpu_pct_of_one_core_{iv:g}s", r["cpu_pct"], "%", "<= 1",
                         note)
            yield Figure(f"sampler_rss_{iv:g}s", r["rss_mb"], "MB", "<= 64", note)
        yield Figure("sampler_startup_cpu", runs[10.0]["startup_cpu_s"], "s", "",
                     "first 5 s: imports, site, first sample")
        yield Figure("sampler_sample_cost_uncached", _sample_cost_ms(), "ms", "",
                     "8 GPUs + 8 ports + node, snapshot parsed afresh each sample")
        rb = runs[10.0]["record_bytes"]
        yield Figure("sampler_record_bytes", rb, "B", "", "8 GPUs x 7 + 8 ports x 3 + 7 node")
        yield Figure("sampler_disk_per_node_day_10s", rb * 8640 / 1e6, "MB", "<= 256",
                     "local segments, before retention")

        yield from fault_figures(tmp, quick)

        n = int(os.environ.get("BV_BENCH_SERIES_NODES") or (20 if quick else 1000))
        T = 8640  # 24 h at 10 s
        small = _ingest_job(tmp, max(4, n // 4), T)
        big = _ingest_job(tmp, n, T)
        per_node_hour = big["file_bytes"] / (n * 24)
        yield Figure("series_bytes_per_node_hour", per_node_hour / 1e3, "kB", "",
                     f"gzip+shuffle, {n} nodes x 24 h x 10 s, noisy values")
        yield Figure("spool_side_file_bytes_per_node_hour", big["side_bytes"] / (n * 24) / 1e3,
                     "kB", "", "uncompressed BVTS")
        scale = 1000 / n
        yield Figure("series_1000_node_day_file", big["file_bytes"] * scale / 1e9, "GB", "<= 5",
                     f"extrapolated x{scale:g} from {n} nodes" if scale != 1 else "measured")
        yield Figure("series_1000_node_day_ingest", big["seconds"] * scale, "s", "<= 1800",
                     (f"extrapolated x{scale:g} from {n} nodes, " if scale != 1 else "")
                     + "series file alone, one core")
        yield Figure("reports_1000_node_job_ingest", big["reports_seconds"] * scale, "s", "",
                     "the job's 2,000 reports, ingested before (for comparison)")
        yield Figure(f"series_ingest_peak_rss_{n}_nodes", big["maxrss_mb"], "MB", "",
                     "child process, series alone")
        yield Figure(f"series_ingest_peak_rss_{max(4, n // 4)}_nodes", small["maxrss_mb"], "MB",
                     "", "bounded: about the same as with 4x the nodes")
        yield Figure(f"read_one_metric_{n}_nodes", big["read_util_s"], "s", "",
                     "h5py: /gpu/util_pct, all nodes, whole day")
