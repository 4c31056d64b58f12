"""Prolog speed (issue 3): the quick tier on the healthy H100 fixture, process start included.

`python -m bluevela.hooks prolog` is run as slurmd runs it (bare environment, settings from a
hook.env) against tests/data/health/h100-healthy, with a fresh nccl mark so only the quick
tier runs. Figures: p50 and p95 wall time over >= 30 runs (goals <= 0.5 s and <= 1 s), next to
`python -c pass`, `python -c "import pydantic"` and loading site.yaml alone (cached and not), plus the checks'
own time (the report's duration_s), so one can see where the time goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import PY, REPO, Figure, percentile, time_cmd

FIXTURE = REPO / "tests" / "data" / "health" / "h100-healthy"


def _node(tmp: Path) -> Path:
    for d in ("state", "spool", "metrics"):
        (tmp / d).mkdir()
    (tmp / "state" / "nccl_last_pass.json").write_text(json.dumps({"time": time.time()}))
    hook_env = tmp / "hook.env"
    hook_env.write_text(
        f"BV_SITE={REPO / 'site.yaml'}\nBV_NODE_CLASS=h100\n"
        f"BV_SYSFS_ROOT={FIXTURE / 'root'}\nBV_NVML_SNAPSHOT={FIXTURE / 'nvml.json'}\n"
        f"BV_STATE_DIR={tmp / 'state'}\nBV_SPOOL_DIR={tmp / 'spool'}\n"
        f"BV_METRICS_DIR={tmp / 'metrics'}\n")
    return hook_env


def _times(argv: list[str], n: int, env: dict[str, str] | None = None) -> list[float]:
    return [time_cmd(argv, env=env) for _ in range(n)]


def _bare(argv: list[str], env: dict[str, str]) -> float:
    """Wall time with exactly `env` (no inherited environment), like slurmd's prolog."""
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    n = 10 if args.quick else 40
    with tempfile.TemporaryDirectory(prefix="bv-bench-health-") as d:
        tmp = Path(d)
        hook_env = _node(tmp)
        # As the prolog_epilog/ shims exec it (without -I the hook re-executes itself
        # isolated: a second interpreter start that no node pays).
        prolog = [PY, "-I", "-m", "bluevela.hooks", "prolog"]
        times, checks = [], []
        for i in range(1, n + 1):
            env = {"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001",
                   "SLURM_JOB_ID": str(i), "SLURM_JOB_USER": "bench"}
            times.append(_bare(prolog, env))
            report = json.loads((tmp / "spool" / f"{i}.gpu001.prolog.json").read_text())
            assert report["health"]["tier"] == "quick", report["health"]["tier"]
            assert report["health"]["status"] == "OK", report["health"]
            checks.append(report["health"]["duration_s"])
    base = _times([PY, "-c", "pass"], n)
    pyd = _times([PY, "-c", "import pydantic"], max(5, n // 4))
    load = f"from bluevela.site import load_site; load_site({str(REPO / 'site.yaml')!r})"
    site = _times([PY, "-c", load], max(5, n // 4))
    cold = _times([PY, "-c", load], max(5, n // 4), {"BV_CACHE_DIR": "off"})
    p50, p95 = statistics.median(times), percentile(times, 95)
    note = f"{n} runs, healthy H100 fixture (8 GPUs, 8 NDR ports), process start included"
    yield Figure("health.prolog_quick_p50", p50, "s", "<= 0.5", note)
    yield Figure("health.prolog_quick_p95", p95, "s", "<= 1.0", note)
    yield Figure("health.python_pass_p50", statistics.median(base), "s", "", "python -c pass")
    yield Figure("health.import_pydantic_p50", statistics.median(pyd), "s", "",
                 "python -c 'import pydantic'")
    yield Figure("health.site_load_p50", statistics.median(site), "s", "",
                 "python + load_site(site.yaml), validated-site cache hit (no pydantic, no yaml)")
    yield Figure("health.site_load_uncached_p50", statistics.median(cold), "s", "",
                 "python + load_site(site.yaml), BV_CACHE_DIR=off (yaml + pydantic validation)")
    yield Figure("health.quick_checks_p50", statistics.median(checks), "s", "",
                 "gpu+ib+node in forked children (the report's duration_s)")
