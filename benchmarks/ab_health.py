"""Prolog quick tier, before vs after: two checkouts, interleaved on the same machine.

    git worktree add --detach /tmp/old-wt <old-commit>
    python3 -m venv --system-site-packages /tmp/oldenv
    echo /tmp/old-wt > "$(/tmp/oldenv/bin/python -c 'import site; print(site.getsitepackages()[0])')/old.pth"
    python benchmarks/ab_health.py --old-repo /tmp/old-wt --old-python /tmp/oldenv/bin/python

Each side runs `python -I -m bluevela.hooks prolog` as the shims do and bench_health does (bare
environment, its own hook.env pointing at its own site.yaml and healthy H100 fixture, a fresh
nccl mark so only the quick tier runs), alternating old/new run by run, so both see the same
machine load. Prints p50/p95 per side and the new/old ratio of the p50s with the spread of the
per-pair ratios (quartiles). Not registered in run.py: it needs a second checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import PY, REPO, percentile


def _node(tmp: Path, repo: Path) -> Path:
    fixture = repo / "tests" / "data" / "health" / "h100-healthy"
    for d in ("state", "spool", "metrics"):
        (tmp / d).mkdir()
    (tmp / "state" / "nccl_last_pass.json").write_text(json.dumps({"time": time.time()}))
    hook_env = tmp / "hook.env"
    hook_env.write_text(
        f"BV_SITE={repo / 'site.yaml'}\nBV_NODE_CLASS=h100\n"
        f"BV_SYSFS_ROOT={fixture / 'root'}\nBV_NVML_SNAPSHOT={fixture / 'nvml.json'}\n"
        f"BV_STATE_DIR={tmp / 'state'}\nBV_SPOOL_DIR={tmp / 'spool'}\n"
        f"BV_METRICS_DIR={tmp / 'metrics'}\n")
    return hook_env


def _run(py: str, hook_env: Path, spool: Path, job: int) -> tuple[float, float]:
    env = {"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001",
           "SLURM_JOB_ID": str(job), "SLURM_JOB_USER": "bench"}
    t0 = time.perf_counter()
    # As the prolog_epilog/ shims exec it: `python -I -m` from `/` (started without -I, the
    # hook re-executes itself isolated: a second interpreter start no node pays).
    subprocess.run([py, "-I", "-m", "bluevela.hooks", "prolog"], env=env, check=True,
                   capture_output=True, cwd="/")
    wall = time.perf_counter() - t0
    report = json.loads((spool / f"{job}.gpu001.prolog.json").read_text())
    if report["health"]["tier"] != "quick" or report["health"]["status"] != "OK":
        raise SystemExit(f"{py}: unexpected report {report['health']}")
    return wall, float(report["health"]["duration_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-repo", type=Path, required=True)
    ap.add_argument("--old-python", required=True)
    ap.add_argument("-n", type=int, default=30, help="runs per side (default 30)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bv-ab-") as d:
        old_dir, new_dir = Path(d) / "old", Path(d) / "new"
        old_dir.mkdir()
        new_dir.mkdir()
        sides = {"old": (args.old_python, _node(old_dir, args.old_repo.resolve()), old_dir),
                 "new": (PY, _node(new_dir, REPO), new_dir)}
        walls: dict[str, list[float]] = {"old": [], "new": []}
        checks: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(1, args.n + 2):
            order = ("old", "new") if i % 2 else ("new", "old")
            for side in order:
                py, env, tmp = sides[side]
                w, c = _run(py, env, tmp / "spool", i)
                if i > 1:  # the first pair warms the caches (site cache, page cache)
                    walls[side].append(w)
                    checks[side].append(c)
    for side in ("old", "new"):
        w = walls[side]
        print(f"{side}: prolog p50 {statistics.median(w):.3f} s, p95 {percentile(w, 95):.3f} s; "
              f"checks p50 {statistics.median(checks[side]) * 1000:.1f} ms ({len(w)} runs)")
    ratios = sorted(n / o for n, o in zip(walls["new"], walls["old"], strict=True))
    q1, q3 = percentile(ratios, 25), percentile(ratios, 75)
    print(f"new/old prolog p50 ratio {statistics.median(walls['new']) / statistics.median(walls['old']):.2f} "
          f"(per-pair ratios: median {statistics.median(ratios):.2f}, quartiles {q1:.2f}-{q3:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
