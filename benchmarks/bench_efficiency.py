"""`bv archive show JOB --efficiency`: time and peak memory for a 1,000-node x 8-GPU 24-hour job
at 10 s (8,640 samples), the HTML page's size, and whether the planted stragglers are found.

The job's series is synthetic: each node's day from bench_telemetry's generator (`_node_rows`:
GPU util 90-100 % with checkpoint dips, power following util, drifting temperatures, SM clock
with occasional SW-power-cap dips), written straight into the archive layout with
`bluevela.archive.series_layout.write_rows` (chunk per node, shuffle + gzip), without the
spool/ingest path (bench_telemetry measures that). Planted: gpu0418 GPU 3 power-braked (410 W,
HW power brake 38 % of samples), gpu0734 GPU 6 thermally throttled (HW thermal slowdown in half
the samples, SM clock 1,400 MHz), gpu0082 all GPUs 20 points lower utilisation, gpu0251 GPU 7
idle, gpu0501 without samples for 6 h, gpu1000 without any; a 15-minute job-wide restart gap.
The job's 2,000 prolog/epilog reports go through the real spool and ingest.

`BV_BENCH_EFF_NODES` sets the node count (`--quick`: 100). The CLI runs in a child process; its
peak RSS comes from getrusage of a wrapper that only runs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import PY, REPO, Figure

sys.path.insert(0, str(REPO))

T0 = 1_790_000_000.0
JOB = 7
T = 8640  # 24 h at 10 s
G = 8
GAP = slice(5000, 5090)  # 15 min: the job restarted
PLANTED = {("gpu0418", 3), ("gpu0734", 6), ("gpu0082", None)}


def _telemetry_generator() -> Any:
    """bench_telemetry's `_node_rows` (the same synthetic day the ingest benchmark uses)."""
    path = Path(__file__).with_name("bench_telemetry.py")
    spec = importlib.util.spec_from_file_location("bench_telemetry", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._node_rows


def _node_day(node_rows: Any, rng: Any, i: int, name: str) -> tuple[dict[str, Any],
                                                                      dict[str, Any]]:
    """One node's [G, T] GPU metrics and [T] node metrics, with the planted faults."""
    import numpy as np

    cols, mat = node_rows(rng, T, i)
    col = {c: k for k, c in enumerate(cols)}
    gpu = {m: np.stack([mat[:, col[f"gpu{g}.{m}"]] for g in range(G)])
           for m in ("util_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz",
                     "clocks_event_reasons", "xid_count")}
    node = {m: mat[:, col[f"node.{m}"]].copy() for m in
            ("cpu_busy_pct", "cpu_throttled_pct", "mem_used_bytes", "net_rx_bytes_per_s",
             "net_tx_bytes_per_s")}
    gpu["util_pct"][:, GAP] = 0
    gpu["power_w"][:, GAP] = 70
    gpu["clocks_event_reasons"][:, GAP] = 1
    node["cpu_busy_pct"][GAP] = 2
    if name == "gpu0418":
        brake = rng.random(T) < 0.38
        gpu["power_w"][3] = 410 + rng.normal(0, 12, T)
        gpu["clocks_event_reasons"][3] = np.where(brake, 0x80, gpu["clocks_event_reasons"][3])
    elif name == "gpu0734":
        hot = rng.random(T) < 0.5
        gpu["clocks_event_reasons"][6] = np.where(hot, 0x40, gpu["clocks_event_reasons"][6])
        gpu["sm_clock_mhz"][6] = np.where(hot, 1400, gpu["sm_clock_mhz"][6])
        gpu["temp_c"][6] += 25
    elif name == "gpu0082":
        gpu["util_pct"] -= 20
    elif name == "gpu0251":
        gpu["util_pct"][7] = 0
        gpu["power_w"][7] = 68
    elif name == "gpu0501":
        for v in (*gpu.values(), *node.values()):
            v[..., 2000:4160] = np.nan
    elif name == "gpu1000":
        for v in (*gpu.values(), *node.values()):
            v[...] = np.nan
    return gpu, node


def write_job(path: Path, n_nodes: int) -> list[str]:
    """The synthetic job's series file, one node at a time (bounded memory)."""
    import numpy as np

    from bluevela.archive import series_layout as series

    node_rows = _telemetry_generator()
    nodes = [f"gpu{i:04d}" for i in range(1, n_nodes + 1)]
    if n_nodes < 1000:  # keep the planted names
        keep = sorted({"gpu0418", "gpu0734", "gpu0082", "gpu0251", "gpu0501", "gpu1000"})
        nodes = sorted(set(nodes[:n_nodes - len(keep)]) | set(keep))
    plan = series.SeriesPlan(JOB, 10.0, T0, T, nodes, G, 0, list(series.GPU_METRICS), [],
                             list(series.NODE_METRICS), {})
    rng = np.random.default_rng(2026)
    times = T0 + np.arange(T, dtype=np.float64) * 10.0

    def rows() -> Iterator[series.NodeWindow]:
        for i, name in enumerate(nodes):
            gpu, node = _node_day(node_rows, rng, i, name)
            yield series.NodeWindow(name, 10.0, times,
                                    {m: v.astype(np.float32) for m, v in gpu.items()}, {},
                                    {m: v.astype(np.float32) for m, v in node.items()},
                                    [], [], {})

    series.write_rows(path, plan, rows())
    return nodes


def _archive_reports(root: Path, nodes: list[str]) -> Path:
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report

    spool, archive = root / "spool", root / "archive"
    spool.mkdir()
    archive.mkdir()
    for n in nodes:
        for phase, t in (("prolog", T0), ("epilog", T0 + T * 10.0)):
            write_report(spool, sample_report(JOB, n, phase, nodelist=nodes, time=t))
    ingest(spool, archive, now=T0 + T * 10.0 + 60, compact=False)
    return archive


_WRAP = """
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)
dt = time.perf_counter() - t
sys.stderr.write(f"BENCH {dt} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024} {p.returncode}\\n")
sys.stdout.buffer.write(p.stdout)
"""


def _bv(archive: Path, *args: str) -> tuple[float, float, str]:
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive), "BV_SPOOL_DIR": str(archive.parent
                                                                          / "spool")}
    out = subprocess.run([PY, "-c", _WRAP, PY, "-m", "bluevela", "archive", *args],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=3600,
                         check=True)
    line = [x for x in out.stderr.splitlines() if x.startswith("BENCH ")][-1].split()
    if line[3] != "0":
        raise RuntimeError(f"bv archive {' '.join(args)}: exit {line[3]}: {out.stderr[-2000:]}")
    return float(line[1]), float(line[2]), out.stdout


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    quick = bool(getattr(args, "quick", False))
    n = int(os.environ.get("BV_BENCH_EFF_NODES") or (100 if quick else 1000))
    with tempfile.TemporaryDirectory(prefix="bv-bench-eff-") as d:
        root = Path(d)
        t = time.perf_counter()
        nodes = write_job(root / "job.h5", n)
        gen_s = time.perf_counter() - t
        size = (root / "job.h5").stat().st_size
        archive = _archive_reports(root, nodes)
        (archive / "series").mkdir(exist_ok=True)
        (root / "job.h5").rename(archive / "series" / f"{JOB}.h5")
        what = f"{n} nodes x {G} GPUs x {T} samples"
        yield Figure("efficiency_synthetic_series_file", size / 1e6, "MB", "",
                     f"{what}, written in {gen_s:.0f} s (not a measured path)")
        secs, rss, out = _bv(archive, "show", str(JOB), "--efficiency", "--json")
        yield Figure(f"efficiency_{n}_node_day", secs, "s", "<= 60",
                     f"bv archive show --efficiency --json, {what}, whole CLI")
        yield Figure(f"efficiency_{n}_node_day_peak_rss", rss, "MB", "<= 1024",
                     "child process (getrusage)")
        d_eff = json.loads(out)
        found = {(s["node"], s["gpu"]) for s in d_eff["stragglers"]}
        yield Figure("efficiency_planted_stragglers_found", len(found & PLANTED), "",
                     f">= {len(PLANTED)}", ", ".join(s["evidence"] for s in d_eff["stragglers"]
                                                     [:4]))
        yield Figure("efficiency_false_stragglers", len(found - PLANTED), "", "<= 0",
                     ", ".join(f"{a} GPU {b}" for a, b in sorted(found - PLANTED, key=str)))
        rs = d_eff["restarts"]
        yield Figure("efficiency_restart_gap_found", rs["lost_s"], "s", "",
                     f"planted 900 s; {rs['count']} gap(s), {rs['stalls']} stalls "
                     f"({rs['stalls_s']:.0f} s, checkpoint dips)")
        page = root / "eff.html"
        secs_h, rss_h, _ = _bv(archive, "show", str(JOB), "--efficiency", "--html", str(page))
        yield Figure(f"efficiency_{n}_node_day_with_html", secs_h, "s", "<= 60",
                     f"--html, peak RSS {rss_h:.0f} MB")
        yield Figure(f"efficiency_html_{n}_nodes", page.stat().st_size / 1e6, "MB", "<= 2",
                     "self-contained page")


if __name__ == "__main__":
    ns = argparse.Namespace(quick="--quick" in sys.argv)
    for fig in figures(ns):
        print(fig.line(), flush=True)
