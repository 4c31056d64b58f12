"""Blue Vela size, the hooks' side (issue 27 §3): what grows with the nodes of a job and of the
fleet, N = 64 .. 4,096.

(a) One job on N nodes: N prologs, then (the job's window later) N epilogs write their
    reports and series side files into one spool, as the hooks build and write them (the
    hooks' `_spool` through `write_report`'s bounded child, `spool_series` cutting the
    sampler's segment: tests/hooks/test_scale_hooks.py `run_job_hooks`, on the disk of /tmp unless
    --base says otherwise); then one `bv archive ingest --json` in a fresh interpreter: wall
    time, peak RSS (getrusage of the child), the archive's size.
(b) The fleet view of an N-node cluster: `sinfo -h -N -o %N|%T|%P|%E` and `scontrol show
    reservation -o` as Slurm 22.05 prints them (generated: allocated, mixed, idle, completing,
    drained/draining by bv's checks, the nightly and operators, down, a maintenance
    reservation, the breaker's slots), printed by stand-in executables on PATH, through
    `python -m bluevela.fleet_metrics` and `bv health nodes` (--json and the plain table),
    each in a fresh interpreter, with the spool of (a)'s job of the same size beside it.
    Every run's output is checked (every node once, each drained node with its reason and
    source, the breaker's counts): a figure of a wrong answer is not printed.

Every figure carries the 1-minute load average at its run (the machine is shared), and the
growth exponent of each figure over N (least squares of log(value) on log(N)): 1 is linear.

    python3 benchmarks/bench_scale_hooks.py [--sizes 64,256,1024,4096]
        [--fleet-sizes 256,1024,4096] [--window-s 600] [--base DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import fit_exponent, loadavg  # noqa: E402

from tests.hooks.test_scale_hooks import (  # noqa: E402
    NodeDirs,
    check_fleet_metrics,
    check_health_nodes,
    fleet_env,
    ingest,
    install_standins,
    make_fleet,
    node_name,
    run_fleet_metrics,
    run_health_nodes,
    run_job_hooks,
    tree_bytes,
    write_site,
)

FLEET_SITE_NODES = 4096  # the cluster (a)'s jobs run on


def exponent(points: dict[int, float]) -> float | None:
    return fit_exponent(list(points), list(points.values()))


def job_side(base: Path, n: int, window_s: float) -> tuple[dict[str, Any], NodeDirs]:
    site = write_site(base / "site.yaml", FLEET_SITE_NODES)
    dirs = NodeDirs(base / f"job{n}", site)
    fig: dict[str, Any] = {}
    run = run_job_hooks(dirs, n, window_s=window_s)
    fig["prolog_writes_s"] = (run.prolog_s, loadavg())
    fig["epilog_writes_s"] = (run.epilog_s, loadavg())
    fig["epilog_ms_per_node"] = (run.epilog_ms_per_node, loadavg())
    fig["prolog_cpu_ms_per_node"] = (1000 * run.prolog_cpu_s / n, loadavg())
    fig["epilog_cpu_ms_per_node"] = (1000 * run.epilog_cpu_s / n, loadavg())
    fig["spool_mb"] = (run.spool_bytes / 2**20, loadavg())
    m, res = ingest(dirs)
    la = loadavg()
    assert res["reports_ingested"] == 2 * n and res["jobs_archived"], res
    assert not res["quarantined"] and not any(p.is_file() for p in dirs.spool.iterdir())
    assert len(list((dirs.spool / "done").iterdir())) == 3 * n
    fig["ingest_wall_s"] = (m.wall_s, la)
    fig["ingest_in_process_s"] = (res["seconds"], la)
    fig["ingest_cpu_s"] = (m.cpu_s, la)
    fig["ingest_peak_rss_mb"] = (m.rss_mb, la)
    fig["archive_mb"] = (tree_bytes(dirs.archive) / 2**20, la)
    fig["series_h5_mb"] = (tree_bytes(dirs.archive / "series") / 2**20, la)
    return fig, dirs


def fleet_side(base: Path, n: int, spool: Path | None) -> dict[str, Any]:
    """(b) at `n` nodes; `spool`: (a)'s spool of an `n`-node job (every node has a report)."""
    work = base / f"fleet{n}"
    work.mkdir(parents=True)
    fleet = make_fleet(n)
    install_standins(work / "bin", fleet)
    site = write_site(work / "site.yaml", n)
    if spool is None:
        spool = work / "spool"
        spool.mkdir()
    (work / "state").mkdir()
    env = fleet_env(work / "bin", site, spool, work / "state")
    fig: dict[str, Any] = {}
    fm, prom = run_fleet_metrics(work, env)
    la = loadavg()
    check_fleet_metrics(fleet, prom)
    fig["fleet_metrics_s"] = (fm.wall_s, la)
    fig["fleet_metrics_cpu_s"] = (fm.cpu_s, la)
    fig["fleet_metrics_rss_mb"] = (fm.rss_mb, la)
    fig["fleet_prom_kb"] = (len(prom.encode()) / 1024, la)
    hn = run_health_nodes(work, env)
    la = loadavg()
    rows = json.loads(hn.stdout)
    check_health_nodes(fleet, rows, None if spool.parent == work else
                       {node_name(i) for i in range(1, n + 1)})
    fig["health_nodes_json_s"] = (hn.wall_s, la)
    fig["health_nodes_json_cpu_s"] = (hn.cpu_s, la)
    fig["health_nodes_json_rss_mb"] = (hn.rss_mb, la)
    fig["health_nodes_json_kb"] = (len(hn.stdout.encode()) / 1024, la)
    ht = run_health_nodes(work, env, as_json=False)
    la = loadavg()
    assert len(ht.stdout.splitlines()) == n + 1
    fig["health_nodes_table_s"] = (ht.wall_s, la)
    fig["health_nodes_table_cpu_s"] = (ht.cpu_s, la)
    fig["health_nodes_table_kb"] = (len(ht.stdout.encode()) / 1024, la)
    fig["sinfo_kb"] = (len(fleet.sinfo.encode()) / 1024, la)
    return fig


def table(title: str, results: dict[int, dict[str, Any]]) -> list[str]:
    sizes = sorted(results)
    names = list(results[sizes[0]])
    head = f"| {title} | " + " | ".join(f"N={n}" for n in sizes) + " | exponent |"
    out = [head, "|" + "---|" * (len(sizes) + 2)]
    for name in names:
        pts = {n: results[n][name][0] for n in sizes}
        k = exponent(pts)
        cells = [f"{pts[n]:.3g} (la {results[n][name][1]:.1f})" for n in sizes]
        out.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if k is None else f'{k:.2f}'} |")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", default="64,256,1024,4096")
    p.add_argument("--fleet-sizes", default="256,1024,4096")
    p.add_argument("--window-s", type=float, default=600.0, help="the job's length (series)")
    p.add_argument("--base", type=Path, default=None, help="where the spools go (default /tmp)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    fleet_sizes = [int(s) for s in args.fleet_sizes.split(",") if s]
    base = Path(tempfile.mkdtemp(prefix="bv-bench-scale-hooks-", dir=args.base))
    jobs: dict[int, dict[str, Any]] = {}
    fleets: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    try:
        spools: dict[int, Path] = {}
        for n in sizes:
            jobs[n], dirs = job_side(base, n, args.window_s)
            print(f"job N={n}: " + ", ".join(f"{k} {v[0]:.3g}" for k, v in jobs[n].items()),
                  flush=True)
            if n in fleet_sizes:
                spools[n] = dirs.spool
            else:
                shutil.rmtree(dirs.base)
        for n in fleet_sizes:
            fleets[n] = fleet_side(base, n, spools.get(n))
            print(f"fleet N={n}: " + ", ".join(f"{k} {v[0]:.3g}" for k, v in fleets[n].items()),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    lines = []
    if jobs:
        lines += table("one job's hooks + one ingest", jobs) + [""]
    if fleets:
        lines += table("fleet view", fleets)
    print("\n".join(lines))
    print(f"\n(total {time.perf_counter() - t0:.0f} s; job window {args.window_s:g} s; "
          f"la = 1-min load average at the run)")
    if args.json:
        args.json.write_text(json.dumps({"jobs": jobs, "fleets": fleets,
                                         "window_s": args.window_s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
