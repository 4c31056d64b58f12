"""Node sampler CPU, before vs after: two checkouts' daemons side by side on the same machine.

    git worktree add --detach /tmp/old-wt <old-commit>
    python benchmarks/ab_telemetry.py --old-repo /tmp/old-wt

Each pair starts both daemons at once (`python -m bluevela.telemetry.sampler` with PYTHONPATH
= its checkout, its own site.yaml, the checkout's healthy H100 fixture: 8 GPUs from the NVML
snapshot, 8 IB ports, 1 s interval), skips 5 s of start-up, then takes each one's CPU time
(utime + stime of the whole process, threads included) over the same window, so both see the
same machine load. Prints the median CPU share of one core per side and the median of the
per-pair new/old ratios with their quartiles. Not registered in run.py: it needs a second
checkout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import PY, REPO

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _start(repo: Path, state: Path, interval: float) -> subprocess.Popen[bytes]:
    fixture = repo / "tests" / "data" / "health" / "h100-healthy"
    env = dict(os.environ, BV_HOOK_ENV="none", BV_SITE=str(repo / "site.yaml"),
               BV_CACHE_DIR="off", BV_NODE_CLASS="h100", BV_SYSFS_ROOT=str(fixture / "root"),
               BV_NVML_SNAPSHOT=str(fixture / "nvml.json"), BV_STATE_DIR=str(state),
               BV_SAMPLER_INTERVAL_S=str(interval), BV_HOOK_LOG_LEVEL="WARNING",
               PYTHONPATH=str(repo))
    for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC"):
        env.pop(k, None)
    return subprocess.Popen([PY, "-m", "bluevela.telemetry.sampler"], env=env, cwd="/")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-repo", type=Path, required=True)
    ap.add_argument("-n", type=int, default=5, help="pairs (default 5)")
    ap.add_argument("--seconds", type=float, default=30.0, help="window per pair (default 30)")
    ap.add_argument("--interval", type=float, default=1.0, help="sampler interval (default 1)")
    args = ap.parse_args()
    new_pct, old_pct, ratios = [], [], []
    for k in range(args.n):
        with tempfile.TemporaryDirectory(prefix="bv-ab-telemetry-") as d:
            procs = {"new": _start(REPO, Path(d) / "new", args.interval),
                     "old": _start(args.old_repo, Path(d) / "old", args.interval)}
            try:
                time.sleep(5)
                c0 = {n: _cpu_s(p.pid) for n, p in procs.items()}
                t0 = time.monotonic()
                time.sleep(args.seconds)
                c1 = {n: _cpu_s(p.pid) for n, p in procs.items()}
                dt = time.monotonic() - t0
            finally:
                for p in procs.values():
                    p.send_signal(signal.SIGTERM)
                    p.wait(30)
        new, old = (100.0 * (c1[s] - c0[s]) / dt for s in ("new", "old"))
        if old <= 0:
            raise SystemExit(f"pair {k}: the old sampler used no CPU (did it start?)")
        new_pct.append(new)
        old_pct.append(old)
        ratios.append(new / old)
        print(f"pair {k}: new {new:.2f} %  old {old:.2f} %  ratio {new / old:.3f}", flush=True)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"sampler CPU at {args.interval:g} s, % of one core: new {statistics.median(new_pct):.2f}"
          f"  old {statistics.median(old_pct):.2f}  new/old {statistics.median(ratios):.3f}"
          f" (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(ratios)} pairs of {args.seconds:g} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
