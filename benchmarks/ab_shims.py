"""The prolog as slurmd runs it, old checkout vs this one (issue 24: the fail-open shim).

    python benchmarks/ab_shims.py --old <checkout of 9058adc> [--runs 20] [--rounds 3]
                                  [--shim-only]

Each side is its own checkout's `prolog_epilog/prolog` with an interpreter whose bluevela is
that checkout (a venv over this Python with the checkout first on its path: the hook runs
`-I`; with --shim-only both sides run this checkout's package, so only the shims differ), /etc/bluevela bind-mounted in a private mount namespace (root and unshare needed), no
PATH, the healthy H100 fixture and a fresh nccl mark (quick tier only), syslog to a socket
nobody reads. Rounds alternate the order; the figures are each round's new/old ratio of the
median wall time and of the median CPU time (user + system of the shim and everything it
started: steadier than wall time on a shared machine), then the medians themselves.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "health" / "h100-healthy"


def side(tmp: Path, name: str, checkout: Path, package: Path) -> tuple[Path, Path]:
    """(etc dir, shim) of one side: `checkout`'s shim, `package`'s bluevela."""
    venv = tmp / f"venv-{name}"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "00-checkout.pth").write_text(f"{package}\n")
    node = tmp / f"node-{name}"
    for d in ("state", "spool", "metrics"):
        (node / d).mkdir(parents=True)
    etc = tmp / f"etc-{name}"
    etc.mkdir()
    (etc / "python").write_text(f"{venv / 'bin' / 'python3'}\n")
    (etc / "hook.env").write_text(
        f"BV_SITE={REPO / 'site.yaml'}\nBV_NODE_CLASS=h100\nBV_CACHE_DIR=off\n"
        f"BV_SYSFS_ROOT={FIXTURE / 'root'}\nBV_NVML_SNAPSHOT={FIXTURE / 'nvml.json'}\n"
        f"BV_STATE_DIR={node / 'state'}\nBV_SPOOL_DIR={node / 'spool'}\n"
        f"BV_METRICS_DIR={node / 'metrics'}\nBV_SYSLOG_SOCKET={tmp / 'nobody-reads'}\n")
    (etc / "hook.env").chmod(0o644)
    return etc, checkout / "prolog_epilog" / "prolog"


def run_once(etc: Path, shim: Path, job: int) -> tuple[float, float]:
    (etc.parent / f"node-{etc.name[4:]}" / "state" / "nccl_last_pass.json").write_text(
        json.dumps({"time": time.time()}))
    script = 'mount --bind "$1" /etc/bluevela && cd / && shift && exec /usr/bin/env -i "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh",
            str(etc), f"SLURM_JOB_ID={job}", "SLURMD_NODENAME=gpu001", "/bin/sh", str(shim)]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode != 0 or "hook error" in p.stderr:
        raise SystemExit(f"{shim}: exit {p.returncode}: {p.stderr}")
    return took, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="a checkout of the old version")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shim-only", action="store_true",
                    help="both sides run this checkout's package: only the shims differ")
    args = ap.parse_args()
    Path("/etc/bluevela").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bv-ab-shims-") as d:
        tmp = Path(d)
        old = args.old.resolve()
        sides = {"old": side(tmp, "old", old, REPO if args.shim_only else old),
                 "new": side(tmp, "new", REPO, REPO)}
        job = 1
        for name in ("old", "new"):  # warm the page cache and bytecode
            run_once(*sides[name], job)
            job += 1
        wall: dict[str, list[float]] = {"old": [], "new": []}
        cpu: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            order = ("old", "new") if r % 2 == 0 else ("new", "old")
            for name in order:
                runs = []
                for _ in range(args.runs):
                    runs.append(run_once(*sides[name], job))
                    job += 1
                wall[name].append(statistics.median(w for w, _ in runs))
                cpu[name].append(statistics.median(c for _, c in runs))
        print("prolog via its shim, median of", args.runs, "runs per side and round")
        for what, fig in (("wall", wall), ("cpu", cpu)):
            ratios = [n / o for n, o in zip(fig["new"], fig["old"], strict=True)]
            print(f"{what} old s:", " ".join(f"{v:.3f}" for v in fig["old"]))
            print(f"{what} new s:", " ".join(f"{v:.3f}" for v in fig["new"]))
            print(f"{what} new/old per round:", " ".join(f"{v:.2f}" for v in ratios),
                  f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
