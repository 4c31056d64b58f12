"""`allreduce` (inside one node) and `allreduce-pair` (between two nodes): a torch.distributed
all_reduce sweep over message sizes, NCCL on GPUs and gloo on CPUs.

Figures follow nccl-tests: algbw = bytes / time (GB = 1e9 B), busbw = algbw x 2(n-1)/n, with
the time of one all_reduce averaged over a timed loop and taken as the slowest rank's. The
headline is the largest size (the one the node class's floor is set for). With one rank the
factor is 0: there is no bus bandwidth to report, so the measurement does not apply.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from bluevela.bench.dist import RankEnv, free_port, from_environment, spawn_local
from bluevela.bench.registry import Check, RunParams, register
from bluevela.bench.result import Facts, Figure
from bluevela.bench.timing import gpu_count, iterations_for
from bluevela.errors import BenchError

logger = logging.getLogger(__name__)

GPU_DEFAULT_BYTES = 1 << 30
CPU_DEFAULT_BYTES = 4 << 20
MIN_BYTES = 64 << 10
SWEEP_POINTS = 6
UNIT = "GB/s"
PairScope = Literal["node", "pair"]


def sweep_sizes(largest: int, points: int = SWEEP_POINTS, smallest: int = MIN_BYTES) -> list[int]:
    """Sizes from `largest` down by factors of 4 (at most `points`, none under `smallest`),
    ascending, each a multiple of 4 bytes (float32 elements)."""
    largest = max(4, largest - largest % 4)
    sizes: list[int] = []
    size = largest
    while len(sizes) < points and (size >= smallest or not sizes):
        sizes.append(size - size % 4)
        size //= 4
    return sorted(set(sizes))


def bus_factor(world: int) -> float:
    """nccl-tests' all_reduce bus bandwidth factor 2(n-1)/n (0 for one rank)."""
    return 2.0 * (world - 1) / world if world > 0 else 0.0


def figures_from_times(prefix: str, world: int, times: Sequence[tuple[int, float]]) -> list[Figure]:
    """algbw/busbw figures for each (size, seconds per all_reduce), plus the headline at the
    largest size. Pure: the unit test feeds it recorded times."""
    factor = bus_factor(world)
    figures: list[Figure] = []
    for size, seconds in sorted(times):
        algbw = size / seconds / 1e9 if seconds > 0 else math.nan
        figures.append(Figure(f"{prefix}_algbw_gbs", algbw, UNIT, size=size))
        figures.append(Figure(f"{prefix}_busbw_gbs", algbw * factor, UNIT, size=size))
    if times:
        size, seconds = max(times)
        algbw = size / seconds / 1e9 if seconds > 0 else math.nan
        figures.append(Figure(f"{prefix}_algbw_gbs", algbw, UNIT))
        figures.append(Figure(f"{prefix}_busbw_gbs", algbw * factor, UNIT))
    return figures


@dataclass(frozen=True)
class SweepConfig:
    sizes: tuple[int, ...]
    budget_s: float = 0.5
    warmup: int = 2
    max_iters: int = 20
    min_iters: int = 2


def time_all_reduce(torch: Any, dist: Any, tensor: Any, cfg: SweepConfig, cuda: bool) -> float:
    """Seconds of one all_reduce of `tensor`, averaged over a timed loop, slowest rank's.

    Every rank runs the same number of iterations: rank 0's estimate is agreed on first
    (a MAX all_reduce), so no rank waits in a collective the others skipped.
    """
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(max(cfg.warmup, 1)):
        dist.all_reduce(tensor)
    sync()
    t0 = time.perf_counter()
    dist.all_reduce(tensor)
    sync()
    device = tensor.device
    est = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(est, op=dist.ReduceOp.MAX)
    iters = iterations_for(float(est.item()), cfg.budget_s, min_iters=cfg.min_iters,
                           max_iters=cfg.max_iters)
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(tensor)
        end.record()
        torch.cuda.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        elapsed = time.perf_counter() - t0
    per_op = torch.tensor([elapsed / iters], dtype=torch.float64, device=device)
    dist.all_reduce(per_op, op=dist.ReduceOp.MAX)
    return float(per_op.item())


def run_rank(env: RankEnv | None, scope: PairScope, cfg: SweepConfig) -> Facts:
    """This process's part of the sweep; rank 0's Facts carry the figures.

    Args:
        env: the rank (None: a group of one).
        scope: `node` (figures `allreduce_*`) or `pair` (`pair_*`, ranks on two hosts).
        cfg: sizes, time budget, iterations.
    """
    import torch
    import torch.distributed as dist

    name = "allreduce" if scope == "node" else "allreduce-pair"
    prefix = "allreduce" if scope == "node" else "pair"
    env = env or RankEnv(0, 1, 0, "127.0.0.1", free_port())
    ngpu = gpu_count(torch)
    cuda = ngpu > 0
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(env.local_rank % ngpu)
        if scope == "pair":
            # Two-node runs: Ring is the algorithm the pair floor is set for (REFERENCE.md).
            os.environ.setdefault("NCCL_ALGO", "Ring")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world, timeout=timedelta(minutes=10))
    try:
        hosts: list[Any] = [None] * env.world
        dist.all_gather_object(hosts, socket.gethostname())
        times = []
        for size in cfg.sizes:
            tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
            times.append((size, time_all_reduce(torch, dist, tensor, cfg, cuda)))
            del tensor
    finally:
        dist.destroy_process_group()
    distinct = tuple(dict.fromkeys(str(h) for h in hosts))
    note = f"{backend}, {env.world} rank(s) on {', '.join(distinct)}"
    figures = tuple(figures_from_times(prefix, env.world, times))
    if env.rank != 0:
        return Facts(name, note=f"rank {env.rank}", hosts=distinct)
    if scope == "pair" and len(distinct) < 2:
        return Facts(name, figures, ran=False, note=f"pair: every rank on one host ({note})",
                     hosts=distinct)
    if env.world < 2:
        return Facts(name, figures, applicable=False,
                     note=f"one rank: busbw factor 2(n-1)/n is 0 ({note})", hosts=distinct)
    return Facts(name, figures, note=note, hosts=distinct)


def worker_args(scope: PairScope, size_bytes: int, params: RunParams) -> list[str]:
    """The `python -m bluevela.bench.worker` arguments of one sweep."""
    return ["allreduce", "--scope", scope, "--size-bytes", str(size_bytes),
            "--budget-s", str(params.budget_s), "--warmup", str(params.warmup),
            "--max-iters", str(params.max_iters)]


def default_size(torch: Any, configured: int) -> int:
    if configured:
        return configured
    return GPU_DEFAULT_BYTES if gpu_count(torch) else CPU_DEFAULT_BYTES


def sweep_config(size_bytes: int, budget_s: float, warmup: int, max_iters: int) -> SweepConfig:
    return SweepConfig(tuple(sweep_sizes(size_bytes)), budget_s=budget_s, warmup=warmup,
                       max_iters=max_iters)


@register("allreduce", scope="node",
          checks=(Check("allreduce_busbw_gbs", "allreduce_busbw_gbs"),),
          summary="all_reduce busbw inside the node (NCCL over the GPUs, gloo on CPU)")
def gather_node(params: RunParams) -> Facts:
    """All_reduce sweep inside this node: joins a launcher's ranks, else spawns its own."""
    import torch

    ngpu = gpu_count(torch)
    if params.gpus and ngpu < params.gpus:
        from bluevela.bench.evaluate import short_of_gpus

        return short_of_gpus("allreduce", params.gpus, ngpu)
    size = default_size(torch, params.thresholds.allreduce_size_bytes)
    env = from_environment()
    if env is not None and env.world > 1:
        return run_rank(env, "node", sweep_config(size, params.budget_s, params.warmup,
                                                  params.max_iters))
    nprocs = ngpu or params.procs
    return spawn_local(nprocs, worker_args("node", size, params), "allreduce")


@register("allreduce-pair", scope="pair", checks=(Check("pair_busbw_gbs", "pair_busbw_gbs"),),
          summary="all_reduce busbw between two nodes (run under srun -N2)")
def gather_pair(params: RunParams) -> Facts:
    """All_reduce sweep over the ranks of an `srun -N2` step (one per GPU, or one per CPU node)."""
    import torch

    try:
        env = from_environment()
    except BenchError as exc:
        return Facts.failed("allreduce-pair", str(exc))
    if env is None or env.world < 2:
        return Facts.failed("allreduce-pair", "needs ranks on two nodes: run it under "
                            "srun -N2 --ntasks-per-node=<GPUs, or 1>")
    size = default_size(torch, params.thresholds.pair_size_bytes)
    return run_rank(env, "pair", sweep_config(size, params.budget_s, params.warmup,
                                              params.max_iters))
