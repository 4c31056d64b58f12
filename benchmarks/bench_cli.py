"""CLI start-up and submit overhead (issues 2 and 28).

- `bv --help` and `bv submit --dry-run` wall time as a ratio to `python -c "import click"`
  (interleaved pairs, median of the pairs' ratios with their quartiles; goal <= 2.0). The dry
  run is what a login node pays: a site.yaml in the working directory (its validated cache
  warm, as after the first call);
- `bv submit` (no wait) against raw `sbatch --parsable` of the same script on the dev cluster
  (paired runs, median ratio; goal <= 1.2). Submitted jobs are held and cancelled afterwards.
  `BV_BENCH_CLI_LOCAL=1` skips it (no cluster).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from _common import PY, REPO, Figure, devcluster_env, time_cmd


def _timed(argv: Sequence[str], **kw: object) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time_cmd(argv, **kw)  # type: ignore[arg-type]
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def _ratio(a: Sequence[str], b: Sequence[str], n: int, **kw: object) -> tuple[float, str]:
    """Median of n interleaved pairs' wall-time ratios a/b (the first run of each warms the
    caches and is not counted), and a note with their quartiles, both medians, and the
    median ratio of CPU times (steadier than wall time on a shared machine)."""
    _timed(a, **kw)
    _timed(b, **kw)
    ta, tb, ratios, cpu = [], [], [], []
    for i in range(n):
        # alternate which goes first: load on a shared machine falls on both sides
        if i % 2 == 0:
            x, y = _timed(a, **kw), _timed(b, **kw)
        else:
            y, x = _timed(b, **kw), _timed(a, **kw)
        ta.append(x[0])
        tb.append(y[0])
        ratios.append(x[0] / y[0])
        cpu.append(x[1] / y[1])
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    c1, _, c3 = statistics.quantiles(cpu, n=4)
    return statistics.median(ratios), (
        f"quartiles {q1:.2f}-{q3:.2f} over {n} pairs; {statistics.median(ta) * 1e3:.0f} ms vs "
        f"import click {statistics.median(tb) * 1e3:.0f} ms; CPU time {statistics.median(cpu):.2f}"
        f" ({c1:.2f}-{c3:.2f})")


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    n = 5 if args.quick else 15
    click_cmd = [PY, "-c", "import click"]
    site = {"BV_SITE": str(REPO / "site.yaml")}
    r, note = _ratio([PY, "-m", "bluevela", "--help"], click_cmd, n, env=site)
    yield Figure("cli.help_vs_import_click", r, "ratio", "<= 2.0", note)
    # a login node: site.yaml in the working directory, no BV_SITE
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bv-bench-cli-{os.getpid()}"
    work.mkdir(exist_ok=True)
    (work / "site.yaml").write_bytes((REPO / "site.yaml").read_bytes())
    dry = [PY, "-m", "bluevela", "submit", "--dry-run", "-N", "2",
           str(REPO / "examples" / "train_ddp.py")]
    try:  # BV_SITE="" is unset to bv: it finds ./site.yaml
        r, note = _ratio(dry, click_cmd, n, env={"BV_SITE": "", "PYTHONPATH": str(REPO)},
                         cwd=work)
    finally:
        (work / "site.yaml").unlink()
        work.rmdir()
    yield Figure("cli.dry_run_vs_import_click", r, "ratio", "<= 2.0", note)

    if os.environ.get("BV_BENCH_CLI_LOCAL"):
        return
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
