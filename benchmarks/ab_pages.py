"""The three HTML pages, old checkout vs new: size, time and peak memory, interleaved.

Pages: the nightly report of a 1,000-node night with 7 nights of history (tests/
test_bench_report.py's `big_record`), the efficiency page of a 1,000-node x 8-GPU x 24 h job
(bench_efficiency's synthetic series; `--eff-nodes` to shrink it), and the fleet report of a
1,000-node, 30-day fleet (tests/report/test_report_fleet.py's `big_fleet`, `--jobs`). The data is built
once, by this checkout's code, into `--data DIR` (kept, reused when present: the on-disk formats
are the same in both checkouts). Each page is rendered through the `bv` CLI in a fresh
interpreter whose PYTHONPATH is the checkout, so each side imports its own package; the
wrapper reports wall time and the child's peak RSS (getrusage). Rounds alternate the order
(old,new / new,old) so load on a shared machine falls on both sides.

Usage: python3 benchmarks/ab_pages.py --old /tmp/old-f [--new .] [--rounds 3] [--data DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import PY, REPO

sys.path.insert(0, str(REPO))

_WRAP = """
import resource, subprocess, sys, time
t = time.perf_counter()
p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
dt = time.perf_counter() - t
sys.stderr.buffer.write(p.stderr[-2000:])
sys.stderr.write(f"\\nBENCH {dt} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024} {p.returncode}\\n")
"""


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(data: Path, eff_nodes: int, jobs: int) -> dict[str, Any]:
    """The three data sets under `data` (skipped when `data/meta.json` exists)."""
    meta_path = data / "meta.json"
    if meta_path.exists():
        return dict(json.loads(meta_path.read_text()))
    data.mkdir(parents=True, exist_ok=True)
    from bluevela.bench.store import nightly_dir, write_night
    from tests.bench.test_bench_report import BIG_NIGHTS, BIG_SLOW, big_record
    from tests.report.test_report_fleet import big_fleet

    t = time.perf_counter()
    night_archive = data / "night-archive"
    for i, night in enumerate(BIG_NIGHTS):
        last = i == len(BIG_NIGHTS) - 1
        write_night(nightly_dir(night_archive),
                    big_record(night, BIG_SLOW if last else (), 1.0 + 0.01 * i))
    (data / "night-site.yaml").write_text(
        "cluster: bench\nnode_classes:\n  gpu: {nodes: \"gpu[0001-1000]\", gpus: 8, "
        f"gpu_model: H100}}\npaths:\n  archive: {night_archive}\n")
    print(f"nightly data: {time.perf_counter() - t:.0f} s", flush=True)

    t = time.perf_counter()
    eff = _load("bench_efficiency")
    nodes = eff.write_job(data / "job.h5", eff_nodes)
    (data / "eff").mkdir()
    archive = eff._archive_reports(data / "eff", nodes)
    (archive / "series").mkdir(exist_ok=True)
    (data / "job.h5").rename(archive / "series" / f"{eff.JOB}.h5")
    print(f"efficiency data: {time.perf_counter() - t:.0f} s", flush=True)

    t = time.perf_counter()
    fleet_archive = data / "fleet-archive"
    fleet_archive.mkdir()
    since, now = big_fleet(fleet_archive, jobs=jobs, widths=(1, 1, 1, 1, 1, 2, 4, 8),
                           max_hours=3.0)
    (data / "fleet-site.yaml").write_text(
        "cluster: bench\nnode_classes:\n  gpu: {nodes: \"gpu[0001-1000]\", gpus: 8, "
        "gpu_model: H100}\n")
    print(f"fleet data: {time.perf_counter() - t:.0f} s", flush=True)
    meta = {"eff_archive": str(archive), "job": eff.JOB, "eff_nodes": eff_nodes,
            "since": since, "now": now, "jobs": jobs}
    meta_path.write_text(json.dumps(meta))
    return meta


def commands(data: Path, meta: dict[str, Any], out: Path) -> dict[str, tuple[list[str],
                                                                             dict[str, str]]]:
    """page -> (bv argv, extra environment)."""
    return {
        "nightly": (["--site", str(data / "night-site.yaml"), "bench", "report", "--html",
                     str(out / "nightly.html")], {}),
        "efficiency": (["archive", "show", str(meta["job"]), "--efficiency", "--html",
                        str(out / "efficiency.html")],
                       {"BV_ARCHIVE_DIR": meta["eff_archive"],
                        "BV_SPOOL_DIR": str(Path(meta["eff_archive"]).parent / "spool")}),
        "fleet": (["--site", str(data / "fleet-site.yaml"), "report", "fleet", "--archive-dir",
                   str(data / "fleet-archive"), "--since", str(meta["since"]), "--now",
                   str(meta["now"]), "--html", str(out / "fleet.html")], {}),
    }


def run_once(checkout: Path, argv: list[str], extra: dict[str, str]) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BV_")}
    env.update(extra, PYTHONPATH=str(checkout), BV_CACHE_DIR="off")
    p = subprocess.run([PY, "-c", _WRAP, PY, "-m", "bluevela", *argv], capture_output=True,
                       text=True, env=env, cwd="/", timeout=3600, check=False)
    line = [x for x in p.stderr.splitlines() if x.startswith("BENCH ")][-1].split()
    if line[3] != "0":
        raise RuntimeError(f"{checkout}: bv {' '.join(argv)}: exit {line[3]}: "
                           f"{p.stderr[-1500:]}")
    return float(line[1]), float(line[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", type=Path, default=Path("/tmp/bv-ab-pages"))
    ap.add_argument("--eff-nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--pages", default="nightly,efficiency,fleet")
    ap.add_argument("--only", choices=("old", "new"), default=None,
                    help="measure one side only (e.g. the 'before' while 'new' is unwritten)")
    args = ap.parse_args()
    meta = build(args.data, args.eff_nodes, args.jobs)
    sides = {"old": args.old.resolve(), "new": args.new.resolve()}
    if args.only:
        sides = {args.only: sides[args.only]}
    res: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for page in args.pages.split(","):
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                out = args.data / f"out-{side}"
                out.mkdir(exist_ok=True)
                argv, extra = commands(args.data, meta, out)[page]
                secs, rss = run_once(sides[side], argv, extra)
                size = (out / f"{page}.html").stat().st_size
                res.setdefault((page, side), []).append((secs, rss, size))
                print(f"{page:<10} {side:<3} round {r}: {secs:7.2f} s  {rss:7.0f} MB  "
                      f"{size / 1e6:7.3f} MB page", flush=True)
    print()
    for page in args.pages.split(","):
        rows = {s: res[(page, s)] for s in sides if (page, s) in res}
        for s, xs in rows.items():
            ts = [x[0] for x in xs]
            print(f"{page:<10} {s:<3} time median {statistics.median(ts):.2f} s "
                  f"(min {min(ts):.2f}, max {max(ts):.2f}), peak RSS median "
                  f"{statistics.median(x[1] for x in xs):.0f} MB, page {xs[-1][2] / 1e6:.3f} MB")
        if len(rows) == 2:
            o, n = rows["old"], rows["new"]
            ratios = sorted(b[0] / a[0] for a, b in zip(o, n, strict=True))
            print(f"{page:<10} new/old time ratio per round: "
                  + ", ".join(f"{x:.2f}" for x in ratios)
                  + f"; RSS ratio {statistics.median(x[1] for x in n) / statistics.median(x[1] for x in o):.2f}"
                  + f"; size ratio {n[-1][2] / o[-1][2]:.2f}")


if __name__ == "__main__":
    main()
