"""The nightly benchmarks' own cost: the all_reduce measurement's overhead, and the wall time of a
3-node nightly on the dev cluster.

- Overhead: two local gloo ranks (the CPU path of `allreduce`) alternate, on one process group,
  a bare `dist.all_reduce` loop and our `time_all_reduce` (warm-up, agreed iteration count,
  slowest-rank time) over the same sizes and iteration count. The figure is our busbw over the
  bare loop's at the headline size, the median over repetitions (goal >= 0.95).
- Wall time: `bv bench nightly --wait` over node1..node3 of the dev cluster
  (`slurm/devcluster up`; BV_DEVCLUSTER_ID picks the instance), healthy links.

`--quick` halves the repetitions. This file is also the rank program of the overhead figure
(`python bench_nightly.py --rank`, started twice with RANK/WORLD_SIZE set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from _common import PY, REPO, Figure, devcluster_env

sys.path.insert(0, str(REPO))

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
ITERS = 20


def rank_main(reps: int) -> None:
    """One rank of the overhead comparison; rank 0 prints JSON {size: [ratios]}."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from bluevela.bench.allreduce import SweepConfig, time_all_reduce

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    # A budget far over what ITERS take makes ours run exactly ITERS timed iterations too.
    cfg = SweepConfig(SIZES, budget_s=1e6, warmup=2, max_iters=ITERS, min_iters=ITERS)
    ratios: dict[int, list[float]] = {s: [] for s in SIZES}
    for _ in range(reps):
        for size in SIZES:
            t = torch.zeros(size // 4, dtype=torch.float32)
            for _ in range(2):
                dist.all_reduce(t)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ITERS):
                dist.all_reduce(t)
            bare = torch.tensor([(time.perf_counter() - t0) / ITERS], dtype=torch.float64)
            dist.all_reduce(bare, op=dist.ReduceOp.MAX)
            ours = time_all_reduce(torch, dist, t, cfg, cuda=False)
            ratios[size].append(float(bare.item()) / ours)  # busbw ratio = time ratio inverse
    if dist.get_rank() == 0:
        print(json.dumps({str(k): v for k, v in ratios.items()}))
    dist.destroy_process_group()


def overhead(reps: int) -> dict[int, float]:
    from bluevela.bench.dist import free_port

    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([PY, __file__, "--rank", "--reps", str(reps)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"overhead ranks failed: {[p.returncode for p in procs]}")
    data = json.loads(outs[0].strip().splitlines()[-1])
    return {int(k): statistics.median(v) for k, v in data.items()}


def _cluster_env() -> dict[str, str] | None:
    env = devcluster_env()
    if env is None:
        return None
    for n in ("node1", "node2", "node3"):
        subprocess.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], env=env,
                       capture_output=True, check=False)
    return env


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    reps = 5 if args.quick else 10
    ratios = overhead(reps)
    head = max(SIZES)
    yield Figure("bench.allreduce_busbw_vs_bare_loop", ratios[head], "ratio", ">= 0.95",
                 f"gloo, 2 local ranks, {head >> 20} MiB, {ITERS} iters, median of {reps}; "
                 + ", ".join(f"{s >> 10} KiB {r:.3f}" for s, r in sorted(ratios.items())))
    env = _cluster_env()
    if env is None:
        yield Figure("bench.nightly_3node_wall_s", float("nan"), "s", "",
                     "dev cluster unavailable (needs root and slurm/devcluster)")
        return
    t0 = time.perf_counter()
    proc = subprocess.run([PY, "-m", "bluevela", "bench", "nightly", "--wait", "--json"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
                          check=False)
    wall = time.perf_counter() - t0
    try:
        doc = json.loads(proc.stdout)
        note = f"status {doc['status']}, {len(doc['selected'])} nodes, {len(doc['pairs'])} pairs"
    except ValueError:
        note = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    yield Figure("bench.nightly_3node_wall_s", wall, "s", "<= 180", note)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    a = parser.parse_args()
    if a.rank:
        rank_main(a.reps)
    else:
        for fig in figures(a):
            print(fig.line())
