"""Blue Vela size (issue 27): the control plane of one job as it grows, N = 16 .. 4,096 nodes.

For each N the REAL supervisor runs against N simulated agents and N x 8 simulated ranks
(benchmarks/scale_harness.py) and the figures are taken: step start, steady state (CPU of a
core, RSS, beats received vs sent), a closed and a silent node, a hang, a save of all ranks
and the epilog's read. The ranks' beats reach the supervisor as each node agent's one
aggregate per beat interval (`launch/agent.py` `Aggregator`): `datagrams/s` counts those,
`rank beats/s` the ranks' records they carry. Then `bv status --json` and `bv logs` run on a job whose attempts ran
on 1,024 nodes: stand-in `squeue`/`sacct` print the recorded formats of tests/data/slurm/
with the job's 1,024-node lists, and its output file holds bv's banners and the ranks' lines.

Every figure is printed with the 1-minute load average at its run, and the growth exponent of
each figure over N (least squares of log(value) on log(N), values > 0 only): 1 is linear.

    python3 benchmarks/bench_scale.py [--sizes 16,64,256,1024,4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import fit_exponent, loadavg  # noqa: E402
from scale_harness import run_scale  # noqa: E402

# The figures of the table, in order, with their goal at 1,024 nodes (issue 27).
COLUMNS = [
    ("step1.start_s", "start s", "<= 2 after the last connect"),
    ("step1.release_after_last_connect_s", "release s", "<= 2"),
    ("step1.dropped", "dropped", "0"),
    ("step1.start_cpu_s", "start cpu s", ""),
    ("steady.cpu_pct", "cpu %", "<= 5"),
    ("steady.rss_mb", "rss MB", "<= 200"),
    ("steady.beats_sent_per_s", "datagrams/s", ""),
    ("steady.rank_beats_per_s", "rank beats/s", ""),
    ("steady.beats_received_pct", "recv %", "100"),
    ("save.ranks_recorded", "save ranks", "8 N"),
    ("save.dropped", "save lost", "0"),
    ("epilog.read_s", "epilog s", ""),
    ("lost_closed.decision_s", "closed s", ""),
    ("lost_silent.decision_s", "silent s", "<= node_timeout + 1"),
    ("hang.decision_s", "hang s", "<= hang_timeout + 1"),
]


# --------------------------------------------------------------------------------------------
# bv status / bv logs on a 1,024-node job


def _squeue_json(job: int, nodes: str, out: Path, restarts: int) -> str:
    template = json.loads((REPO / "tests/data/slurm/squeue-22.05.8.json").read_text())
    rec = dict(template["jobs"][0])
    rec.update({"job_id": job, "name": "bv-llama", "job_state": "RUNNING", "nodes": nodes,
                "node_count": 1024, "restart_cnt": restarts, "standard_output": str(out),
                "current_working_directory": str(out.parent), "state_reason": "None",
                "user_name": "root", "user_id": 0})
    template["jobs"] = [rec]
    return json.dumps(template)


def _output_file(path: Path, job: int, attempts: int, lines_per: int) -> None:
    """bv's banners and end lines (as the supervisor prints them) around the ranks' lines."""
    with open(path, "w") as fh:
        prev = "none"
        for a in range(1, attempts + 1):
            spare = 1024 + a
            nodes = f"sn[00001-{a:05d},{a + 2:05d}-01024,{spare:05d}]"
            fh.write(f"==== bv attempt {a} job {job} nodes {nodes} previous: {prev} ====\n")
            for i in range(lines_per):
                fh.write(f"[rank{i % 8192}]: step {a * 1000 + i // 8192} loss 2.{i % 97:02d} "
                         "tokens/s 41234.5\n")
            prev = (f"sn{a + 1:05d} lost (its agent's connection closed: the node or its "
                    f"processes died); relaunching on {nodes} (spare sn{spare:05d})")
            fh.write(f"==== bv attempt {a} ended: {prev} ====\n")


def status_and_logs(tmp: Path, attempts: int = 8, lines_per: int = 50_000) -> dict[str, float]:
    job = 77
    out = tmp / f"bv-{job}.out"
    _output_file(out, job, attempts, lines_per)
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp / "squeue.json").write_text(_squeue_json(job, "sn[00001-01024]", out, 3))
    sacct = "".join(f"{job}|NODE_FAIL|0:0|sn[00001-{r + 1:05d},{r + 3:05d}-01025]|debug|root(0)|"
                    f"2026-11-26T0{r}:00:00|2026-11-26T0{r}:50:00\n" for r in range(3))
    (tmp / "sacct.txt").write_text(sacct)
    for name, src in (("squeue", "squeue.json"), ("sacct", "sacct.txt")):
        path = bindir / name
        path.write_text(f"#!/bin/sh\nexec cat {tmp / src}\n")
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    figs: dict[str, float] = {"output_mb": out.stat().st_size / 1e6}
    for name, argv in (("status_json", ["bv", "status", "--json", str(job)]),
                       ("logs", ["bv", "logs", str(job)])):
        t0 = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, check=False)
        figs[f"{name}_s"] = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: "
                               f"{proc.stderr.decode()[-500:]}")
        if name == "status_json":
            data = json.loads(proc.stdout)
            figs["status_bv_attempts"] = len(data.get("bv_attempts", []))
            figs["status_json_kb"] = len(proc.stdout) / 1e3
        else:
            figs["logs_mb"] = len(proc.stdout) / 1e6
    figs["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    figs["load"] = loadavg()
    return figs


# --------------------------------------------------------------------------------------------


def table(runs: list[dict[str, float]]) -> str:
    ns = [int(r["n"]) for r in runs]
    lines = ["| figure | goal | " + " | ".join(f"N={n}" for n in ns) + " | exponent |",
             "|---|---|" + "---|" * len(ns) + "---|"]
    for key, label, goal in COLUMNS:
        vals = [float(r.get(key, float("nan"))) for r in runs]
        exp = fit_exponent(ns, vals)
        cells = " | ".join(f"{v:.3g}" for v in vals)
        lines.append(f"| {label} (`{key}`) | {goal} | {cells} | "
                     f"{'' if exp is None else f'{exp:.2f}'} |")
    loads = " | ".join(f"{r['load_max']:.1f}" for r in runs)
    lines.append(f"| load (1-min, max of the run) | | {loads} | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256,1024,4096")
    p.add_argument("--node-timeout", type=float, default=10.0)
    # Above the node timeout, as on a real site: a silent node's ranks stop beating too, and
    # with equal timeouts the watchdog may name its rank before the node is declared lost.
    p.add_argument("--hang-timeout", type=float, default=15.0)
    p.add_argument("--steady", type=float, default=10.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-status", action="store_true", help="skip bv status/logs at 1,024")
    p.add_argument("--long-sizes", default="1024,4096",
                   help="sizes measured again in steady state with a 60 s hang timeout")
    args = p.parse_args()
    runs: list[dict[str, float]] = []
    ends: dict[int, list[str]] = {}
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"bv-scale-{n}-") as tmp:
            t0 = time.monotonic()
            try:
                res = run_scale(Path(tmp), n, node_timeout=args.node_timeout,
                                hang_timeout=args.hang_timeout, steady_s=args.steady)
            except (RuntimeError, OSError, AssertionError) as exc:
                print(f"N={n}: broke: {str(exc).splitlines()[0]}", flush=True)
                continue
            row = {"n": n, "load_max": max(res.load), "load_min": min(res.load),
                   "wall_s": time.monotonic() - t0, "rc": res.rc or 0, **res.figures}
            runs.append(row)
            ends[n] = [line for line in res.stdout.splitlines() if " ended: " in line]
            print(f"N={n}: " + json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    print(table(runs))
    long_runs: list[dict[str, float]] = []
    for n in (int(x) for x in args.long_sizes.split(",") if x):
        # The steady state alone with a 60 s hang timeout: ranks beat every 7.5 s.
        with tempfile.TemporaryDirectory(prefix=f"bv-scale-long-{n}-") as tmp:
            res = run_scale(Path(tmp), n, node_timeout=args.node_timeout, hang_timeout=60.0,
                            steady_s=args.steady, failures=False)
        row = {"n": n, "load_max": max(res.load), **res.figures}
        long_runs.append(row)
        print(f"N={n}, hang timeout 60 s: cpu {row['steady.cpu_pct']:.1f} % rss "
              f"{row['steady.rss_mb']:.1f} MB datagrams/s "
              f"{row['steady.beats_sent_per_s']:.0f} "
              f"received {row['steady.beats_received_pct']:.2f} % release "
              f"{row['step1.release_after_last_connect_s']:.2f} s (load {row['load_max']:.1f})",
              flush=True)
    extra: dict[str, float] = {}
    if not args.no_status:
        with tempfile.TemporaryDirectory(prefix="bv-scale-status-") as tmp:
            extra = status_and_logs(Path(tmp))
        print("bv status --json / bv logs, a job of 8 attempts on 1,024 nodes: "
              + json.dumps({k: round(v, 3) for k, v in extra.items()}))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "status_logs": extra, "end_lines": ends,
                                         "hang_timeout_60": long_runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
