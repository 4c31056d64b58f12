"""Cardinality of bluevela's Prometheus files: series per node, textfile bytes, the fleet file,
and what a 1,000-node fleet sends Prometheus.

- Per node: a real epilog (the quick tier, what every prolog/epilog writes) on the recorded
  H100 fixture (8 GPUs, 8 IB ports) writes `bluevela.prom`; its series are counted with
  prometheus_client's parser and again through Debian's node_exporter (textfile collector only,
  on 127.0.0.1) so the count is what Prometheus really ingests, and its scrape error must be 0.
  No GPU here: nccl (full tier, where a GPU is present) adds one node-level series and one
  check's status/timestamp/duration (4), counted in by name.
- Fleet file: `render_fleet` for 1,000 nodes (`BV_BENCH_METRICS_NODES`), 5 % drained.
- Fleet total = nodes x per-node series + the fleet file. Per-job labels: what putting a job id
  on each per-GPU series would add per day (every job a GPU runs starts a new series; assumed
  jobs per node per day: `BV_BENCH_JOBS_PER_DAY`, default 12), the cost that jobstats' users met.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from _common import PY, REPO, Figure

sys.path.insert(0, str(REPO))

NCCL_EXTRA = 4  # bluevela_nccl_busbw_bytes_per_second + nccl's check status/timestamp/duration


def _epilog_textfile(tmp: Path) -> Path:
    from tests.fixture_trees import materialized

    fx = materialized() / "h100-healthy"
    env = {**os.environ, "BV_SITE": str(REPO / "site.yaml"), "BV_NODE_CLASS": "h100",
           "BV_SYSFS_ROOT": str(fx / "root"), "BV_NVML_SNAPSHOT": str(fx / "nvml.json"),
           "BV_STATE_DIR": str(tmp / "state"), "BV_METRICS_DIR": str(tmp / "metrics"),
           "BV_SPOOL_DIR": str(tmp / "spool"), "SLURM_CONF": "/nonexistent",
           "SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "1", "BV_HOOK_LOG_LEVEL": "ERROR"}
    subprocess.run([PY, "-m", "bluevela.hooks", "epilog"], env=env, check=True,
                   capture_output=True, timeout=120)
    return tmp / "metrics" / "bluevela.prom"


def _samples(text: str) -> list[tuple[str, dict[str, str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def _node_exporter_samples(textfile_dir: Path) -> tuple[int, float] | None:
    """(bluevela samples, node_textfile_scrape_error) as the real node_exporter serves them."""
    exe = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if exe is None:
        return None
    from bluevela.bench.dist import free_port

    port = free_port()
    proc = subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}",
                             "--collector.disable-defaults", "--collector.textfile",
                             f"--collector.textfile.directory={textfile_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    return None
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    lines = [ln for ln in body.splitlines() if ln and not ln.startswith("#")]
    ours = sum(1 for ln in lines if ln.startswith("bluevela_"))
    err = next(float(ln.split()[-1]) for ln in lines if ln.startswith("node_textfile_scrape_error"))
    return ours, err


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    from bluevela.fleet_metrics import render_fleet
    from bluevela.health.metrics import render
    from bluevela.health.state import LAST_RESULTS, read_json
    from bluevela.site import load_site
    from bluevela.slurm.client import NodeInfo

    nodes = int(os.environ.get("BV_BENCH_METRICS_NODES", "1000"))
    jobs_per_day = float(os.environ.get("BV_BENCH_JOBS_PER_DAY", "12"))
    with tempfile.TemporaryDirectory(prefix="bv-bench-metrics-") as d:
        tmp = Path(d)
        prom = _epilog_textfile(tmp)
        text = prom.read_text()
        samples = _samples(text)
        per_node = len(samples) + NCCL_EXTRA
        per_gpu = sum(1 for _, lab in samples if "gpu" in lab)
        per_port = sum(1 for _, lab in samples if "port" in lab)
        yield Figure("metrics_series_per_node", per_node, "series",
                     note=f"H100 fixture, 8 GPUs + 8 IB ports; {per_gpu} per-GPU, "
                     f"{per_port} per-port, {per_node - per_gpu - per_port} node-level "
                     f"(incl. {NCCL_EXTRA} of nccl, full tier)")
        yield Figure("metrics_textfile_bytes", len(text.encode()), "bytes",
                     note="bluevela.prom of one node (HELP/TYPE lines included)")
        served = _node_exporter_samples(prom.parent)
        if served is not None:
            yield Figure("metrics_node_exporter_series", served[0], "series",
                         note=f"the same file through Debian's node_exporter; "
                         f"node_textfile_scrape_error={served[1]:g}")
        last = read_json(tmp / "state" / LAST_RESULTS)
        assert isinstance(last, dict)
        reps = 20 if args.quick else 100
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            render(last, hostname="gpu001")
            times.append(time.perf_counter() - t0)
        yield Figure("metrics_render_ms", statistics.median(times) * 1e3, "ms",
                     note=f"median of {reps} renders (p90 "
                     f"{sorted(times)[int(reps * 0.9) - 1] * 1e3:.2f} ms)")

    site = load_site(REPO / "site.yaml")
    fleet = [NodeInfo(f"gpu{i:04d}", "IDLE+DRAIN" if i % 20 == 0 else "ALLOCATED",
                      "bv: ib: mlx5_3/1 state DOWN" if i % 20 == 0 else "", ("gpu",))
             for i in range(1, nodes + 1)]
    t0 = time.perf_counter()
    fleet_text = render_fleet(site, fleet)
    fleet_ms = (time.perf_counter() - t0) * 1e3
    fleet_series = len(_samples(fleet_text))
    yield Figure("metrics_fleet_file_series", fleet_series, "series",
                 note=f"{nodes} nodes, 5 % drained; {len(fleet_text.encode()) / 1024:.0f} KiB, "
                 f"rendered in {fleet_ms:.0f} ms")
    total = nodes * per_node + fleet_series
    yield Figure(f"metrics_fleet_series_{nodes}_nodes", total, "series",
                 note=f"{nodes} x {per_node} + the fleet file (node_exporter's own families "
                 "not counted)")
    churn = nodes * per_gpu * jobs_per_day
    yield Figure("metrics_job_label_new_series_per_day", churn, "series/day",
                 note=f"if each per-GPU series carried a job id: {per_gpu} per-GPU series x "
                 f"{jobs_per_day:g} jobs/node/day x {nodes} nodes; bluevela keeps job ids off "
                 f"({churn / total:.1f}x the fleet's whole series count, every day)")

