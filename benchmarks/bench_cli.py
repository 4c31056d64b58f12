"""CLI start-up and submit overhead (issue 2).

- `bv --help` and `bv submit --dry-run` wall time as a ratio to `python -c "import click"`
  (paired runs, median of ratios; goal <= 2.0);
- `bv submit` (no wait) against raw `sbatch --parsable` of the same script on the dev cluster
  (paired runs, median ratio; goal <= 1.2). Submitted jobs are held and cancelled afterwards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from collections.abc import Iterator

from _common import PY, REPO, Figure, devcluster_env, paired_ratio, time_cmd


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    n = 5 if args.quick else 15
    click_cmd = [PY, "-c", "import click"]
    site = {"BV_SITE": str(REPO / "site.yaml")}
    r, a, b = paired_ratio([PY, "-m", "bluevela", "--help"], click_cmd, n, env=site)
    yield Figure("cli.help_vs_import_click", r, "ratio", "<= 2.0",
                 f"bv --help {a * 1e3:.0f} ms, import click {b * 1e3:.0f} ms")
    dry = [PY, "-m", "bluevela", "submit", "--dry-run", "-N", "2", "examples/train_ddp.py"]
    r, a, b = paired_ratio(dry, click_cmd, n, env=site, cwd=REPO)
    yield Figure("cli.dry_run_vs_import_click", r, "ratio", "<= 2.0",
                 f"dry-run {a * 1e3:.0f} ms, import click {b * 1e3:.0f} ms")

    env = devcluster_env()
    if env is None:
        yield Figure("cli.submit_vs_sbatch", float("nan"), "ratio", "<= 1.2", "dev cluster not up")
        return
    # Held jobs never run; both commands do the same controller round trip.
    held = subprocess.run([*dry[:4], "--hold", *dry[4:]], capture_output=True, text=True,
                          env={**os.environ, **site}, cwd=REPO, check=True).stdout
    bv = [PY, "-m", "bluevela", "submit", "--hold", "-N", "2", "examples/train_ddp.py"]
    ratios, tb, ts = [], [], []
    try:
        for _ in range(n):
            x = time_cmd(bv, env=env, cwd=REPO)
            y = time_cmd(["sbatch", "--parsable"], env=env, stdin=held, cwd=REPO)
            ratios.append(x / y)
            tb.append(x)
            ts.append(y)
    finally:
        subprocess.run(["scancel", "--user=root", "--state=PENDING"], env={**os.environ, **env},
                       check=False)
        subprocess.run(["scancel", "--user=root"], env={**os.environ, **env}, check=False)
    import statistics

    yield Figure("cli.submit_vs_sbatch", statistics.median(ratios), "ratio", "<= 1.2",
                 f"bv submit {statistics.median(tb) * 1e3:.0f} ms, sbatch "
                 f"{statistics.median(ts) * 1e3:.0f} ms (median of {n} pairs)")
    yield Figure("cli.submit_overhead", (statistics.median(tb) - statistics.median(ts)) * 1e3,
                 "ms", "", "bv submit minus sbatch, medians")
