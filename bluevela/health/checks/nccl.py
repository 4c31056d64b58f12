"""`nccl`: all_reduce bus bandwidth inside the node, by nccl-tests' definition.

torch.distributed over the node's GPUs (NCCL) or, on a CPU class, over `nccl.procs` local
processes (gloo, default 2). Each rank is a fresh `python -m bluevela.health.nccl_worker`
process (torch is imported there only); the ranks meet through a FileStore in a private
temporary directory. The time of one all_reduce is the mean over `iters` after `warmup`,
taken from the slowest rank. algbw = size / time (GB = 1e9 B); busbw = algbw * 2(n-1)/n,
compared with the class's `min_busbw_gbs` at its `size_bytes`. A single rank has no bus
bandwidth (the factor is 0): not applicable (OK). Registered as noisy: the runner retries it.
In a prolog or epilog whose job was given GPUs (`SLURM_JOB_GPUS`), only those GPUs run
(`CUDA_VISIBLE_DEVICES` with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so CUDA counts them as NVML and
Slurm's gres do): another job may hold the others. busbw is comparable across rank counts (the
2(n-1)/n factor exists for that), so the class's floor applies; such a pass (metric
`subset_gpus_count`) does not make the node's nccl fresh. Where nccl is not run at all (a
node with jobs): runner.for_jobs_here.
Every attempt is recorded in the state dir (`nccl_attempts.json`), every pass too: the prolog
reruns nccl when its last pass is older than `health.nccl_freshness_h`, and backs off
exponentially (15 min doubling, capped at 6 h) while attempts do not pass.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.checks_registry import check
from bluevela.health.result import CheckResult, Status

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

NVIDIA_CTL = Path("/dev/nvidiactl")
WORKER_TIMEOUT_S = 900.0  # the runner's own timeout normally ends a hung run first
_ATTEMPT_RECORDED_BY: int | None = None  # the check's child that counted its attempt


@dataclass(frozen=True)
class NCCLFacts:
    backend: str
    ranks: int
    size_bytes: int
    iters: int
    time_s: float | None = None  # one all_reduce, slowest rank's mean
    error: str | None = None
    subset: tuple[int, ...] | None = None  # the job's GPUs when not all of the class's


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} B"  # pragma: no cover


def bus_bandwidth(size_bytes: int, time_s: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 B/s) for an all_reduce, as nccl-tests defines them."""
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def measure(backend: str, ranks: int, size_bytes: int, iters: int, warmup: int,
            timeout_s: float = WORKER_TIMEOUT_S,
            gpus: tuple[int, ...] | None = None) -> NCCLFacts:
    """Run `ranks` worker processes and collect the slowest rank's time per all_reduce
    (`gpus`: only these GPUs, by NVML index, are visible to the workers)."""
    if importlib.util.find_spec("torch") is None:
        return NCCLFacts(backend, ranks, size_bytes, iters, error="torch is not installed",
                         subset=gpus)
    tmp = tempfile.mkdtemp(prefix="bv-nccl-")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if gpus is not None:
        env.update(CUDA_VISIBLE_DEVICES=",".join(str(g) for g in gpus),
                   CUDA_DEVICE_ORDER="PCI_BUS_ID")
    procs = []
    try:
        for rank in range(ranks):
            argv = [sys.executable, "-m", "bluevela.health.nccl_worker",
                    "--rank", str(rank), "--world", str(ranks), "--backend", backend,
                    "--store", os.path.join(tmp, "store"), "--size", str(size_bytes),
                    "--iters", str(iters), "--warmup", str(warmup)]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, text=True, env=env))
        times: list[float] = []
        errors: list[str] = []
        for rank, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                errors.append(f"rank {rank} timed out after {timeout_s:g} s")
                continue
            line = out.strip().splitlines()[-1] if out.strip() else ""
            try:
                times.append(float(json.loads(line)["time_s"]))
            except (ValueError, KeyError, TypeError):
                last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
                errors.append(f"rank {rank}: {last}")
        if errors:
            return NCCLFacts(backend, ranks, size_bytes, iters, error="; ".join(errors[:2]),
                             subset=gpus)
        return NCCLFacts(backend, ranks, size_bytes, iters, time_s=max(times), subset=gpus)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def probe_nccl(ctx: ProbeContext) -> NCCLFacts:
    """One measurement at the class's size (GPUs: NCCL over all of them; else gloo).

    The attempt is recorded in the state dir before it runs (a run killed at its timeout
    counts too): the prolog backs off a node whose nccl does not pass (`state.nccl_is_stale`).
    """
    global _ATTEMPT_RECORDED_BY
    cls, t = ctx.node_class, ctx.node_class.nccl
    if ctx.state_dir is not None and _ATTEMPT_RECORDED_BY != os.getpid():
        from bluevela.health.state import record_nccl_attempt

        # One attempt per run of the check: its retries run in the same child process.
        _ATTEMPT_RECORDED_BY = os.getpid()
        record_nccl_attempt(ctx.state_dir)
    gpus = job_gpus_subset(ctx)
    if cls.gpus > 0:
        backend, ranks = "nccl", len(gpus) if gpus is not None else cls.gpus
        if not NVIDIA_CTL.exists():
            return NCCLFacts(backend, ranks, t.size_bytes, t.iters,
                             error=f"no NVIDIA device ({NVIDIA_CTL} missing)", subset=gpus)
    else:
        backend, ranks = "gloo", t.procs or 2
    return measure(backend, ranks, t.size_bytes, t.iters, t.warmup, gpus=gpus)


def job_gpus_subset(ctx: ProbeContext) -> tuple[int, ...] | None:
    """The job's GPUs when the prolog/epilog knows them and they are not all of the class's
    (then nccl runs on them only); None: every GPU of the class."""
    cls = ctx.node_class
    if cls.gpus <= 0 or ctx.phase not in ("prolog", "epilog") or not ctx.job_gpus:
        return None
    gpus = tuple(g for g in ctx.job_gpus if 0 <= g < cls.gpus)
    return gpus if gpus and len(gpus) < cls.gpus else None


@check("nccl", probe=probe_nccl, noisy=True)
def evaluate_nccl(facts: NCCLFacts, cls: NodeClass) -> CheckResult:
    """all_reduce bus bandwidth at the class's size against `nccl.min_busbw_gbs`."""
    on = f", the job's GPUs {','.join(map(str, facts.subset))}" if facts.subset else ""
    where = f"{facts.backend}, {facts.ranks} ranks{on}, {human_bytes(facts.size_bytes)}"
    base: dict[str, float] = {"ranks_count": facts.ranks, "size_bytes": facts.size_bytes}
    if facts.subset:
        base["subset_gpus_count"] = len(facts.subset)
    if facts.error:
        return CheckResult("nccl", Status.UNKNOWN, f"could not run ({where}): {facts.error}", base)
    if facts.time_s is None or facts.time_s <= 0:
        return CheckResult("nccl", Status.UNKNOWN, f"no time measured ({where})", base)
    algbw, busbw = bus_bandwidth(facts.size_bytes, facts.time_s, facts.ranks)
    if facts.ranks < 2:
        # Not a failure to run: with one GPU there is no bus to measure (nccl-tests prints 0).
        return CheckResult("nccl", Status.OK,
                           f"not applicable: 1 rank has no bus bandwidth (2(n-1)/n = 0) ({where})",
                           {**base, "algbw_gbs": algbw, "time_s": facts.time_s})
    metrics = {**base, "busbw_gbs": busbw, "algbw_gbs": algbw, "time_s": facts.time_s}
    floor = cls.nccl.min_busbw_gbs
    if busbw < floor:
        return CheckResult("nccl", Status.CRITICAL,
                           f"busbw {busbw:.3g} GB/s < {floor:g} GB/s ({where})", metrics)
    return CheckResult("nccl", Status.OK, f"busbw {busbw:.3g} GB/s >= {floor:g} GB/s ({where})",
                       metrics)
