"""Bare torch references for `bv bench run gemm hbm h2d d2h`, timed exactly as bv times them.

A reference is only a reference if the one thing that differs is bv itself. So this file uses
bv's method, written out again in bare torch (it imports nothing from bluevela):

- the same shapes, dtypes and sizes (`bluevela/bench/gemm.py`, `memory.py`): bf16 matmuls
  4096/8192/16384 into a preallocated output (`out=`), random normal inputs; a 1 GiB
  device-to-device copy counting bytes read + written; 256 MiB pinned host <-> device copies.
  On a CPU: fp32 256/512 matmuls and a 64 MiB host copy (bv's CPU path);
- the same timing (`bluevela/bench/timing.py`): warm-up calls, one call timed to size the loop
  (`budget_s / estimate`, clamped to 3..20), then every timed call launched back to back, each
  between its own pair of CUDA events, ONE synchronize at the end, the median of the per-call
  times. (The old reference synchronised after every call and allocated a new output each
  time, which is slower than bv's loop: bv "beat" bare torch, 808.6 vs 772.6 TFLOP/s.)

tests/bench/test_device_reference.py checks on a CPU that both timing loops make the same calls in
the same order, and that the shapes and sizes here are bv's. `interleave.py` runs this and bv's
measurements alternately on the same warm device and reports the ratio with its spread.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

GPU_SHAPES = (4096, 8192, 16384)
CPU_SHAPES = (256, 512)
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
HOST_DEVICE_BYTES = 256 << 20
# bv bench run's defaults (RunParams): budget per sweep point, warm-up, iteration bounds.
BUDGET_S = 0.5
WARMUP = 2
GEMM_WARMUP = 3  # gemm warms up max(warmup, 3) times
MIN_ITERS = 3
MAX_ITERS = 20


def iterations(estimate_s: float, budget_s: float, min_iters: int = MIN_ITERS,
               max_iters: int = MAX_ITERS) -> int:
    if estimate_s <= 0:
        return max_iters
    return max(min_iters, min(max_iters, int(budget_s / estimate_s)))


def cuda_median_s(torch: Any, fn: Callable[[], object], *, budget_s: float = BUDGET_S,
                  warmup: int = WARMUP, min_iters: int = MIN_ITERS,
                  max_iters: int = MAX_ITERS) -> float:
    """Median seconds per call: back-to-back calls, an event pair around each, one sync."""
    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = iterations(start.elapsed_time(end) / 1e3, budget_s, min_iters, max_iters)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def cpu_median_s(fn: Callable[[], object], *, budget_s: float = BUDGET_S, warmup: int = WARMUP,
                 min_iters: int = MIN_ITERS, max_iters: int = MAX_ITERS) -> float:
    """Median wall seconds per call on the CPU; the last warm-up call sizes the loop."""
    first = 0.0
    for _ in range(max(warmup, 1)):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
    times = []
    for _ in range(iterations(first, budget_s, min_iters, max_iters)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_tflops(torch: Any, budget_s: float = BUDGET_S) -> dict[int, float]:
    """TFLOP/s per shape: bf16 on GPU 0, fp32 on the CPU."""
    out: dict[int, float] = {}
    cuda = torch.cuda.is_available()
    for n in GPU_SHAPES if cuda else CPU_SHAPES:
        kw: dict[str, Any] = ({"device": 0, "dtype": torch.bfloat16} if cuda
                              else {"dtype": torch.float32})
        a, b, c = torch.randn(n, n, **kw), torch.randn(n, n, **kw), torch.empty(n, n, **kw)

        def mm(a: Any = a, b: Any = b, c: Any = c) -> object:
            return torch.matmul(a, b, out=c)

        t = (cuda_median_s(torch, mm, budget_s=budget_s, warmup=max(WARMUP, GEMM_WARMUP))
             if cuda else cpu_median_s(mm, budget_s=budget_s))
        out[n] = 2.0 * n * n * n / t / 1e12
        del a, b, c
    if cuda:
        torch.cuda.empty_cache()
    return out


def copy_gbs(torch: Any, budget_s: float = BUDGET_S) -> float:
    """Device-to-device (CPU: host) copy GB/s, bytes read + written."""
    cuda = torch.cuda.is_available()
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=0 if cuda else "cpu").fill_(7)
    dst = torch.empty_like(src)
    t = (cuda_median_s(torch, lambda: dst.copy_(src), budget_s=budget_s) if cuda
         else cpu_median_s(lambda: dst.copy_(src), budget_s=budget_s))
    return 2 * nbytes / t / 1e9  # the buffers die with this frame (bv: the same)


def host_device_gbs(torch: Any, to_device: bool, budget_s: float = BUDGET_S) -> float:
    """Pinned host <-> GPU 0 copy GB/s (buffer bytes / time)."""
    host = torch.empty(HOST_DEVICE_BYTES, dtype=torch.uint8, pin_memory=True).fill_(7)
    gpu = torch.empty(HOST_DEVICE_BYTES, dtype=torch.uint8, device=0)
    if to_device:
        def fn() -> object:
            return gpu.copy_(host, non_blocking=True)
    else:
        def fn() -> object:
            return host.copy_(gpu, non_blocking=True)
    t = cuda_median_s(torch, fn, budget_s=budget_s)
    return HOST_DEVICE_BYTES / t / 1e9


def measure(torch: Any, budget_s: float = BUDGET_S) -> dict[str, float]:
    """Every reference figure under the names `interleave.py` compares (no h2d/d2h on CPU)."""
    g = gemm_tflops(torch, budget_s)
    figs = {f"gemm_{n}_tflops": v for n, v in g.items()}
    figs["gemm_tflops"] = max(g.values())
    figs["hbm_gbs"] = copy_gbs(torch, budget_s)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # as bv does after each measurement's buffers are gone
        torch.cuda.set_device(0)
        figs["h2d_gbs"] = host_device_gbs(torch, True, budget_s)
        torch.cuda.empty_cache()
        figs["d2h_gbs"] = host_device_gbs(torch, False, budget_s)
        torch.cuda.empty_cache()
    return figs


def main(argv: list[str]) -> int:
    import torch

    budget_s = float(argv[0]) if argv else BUDGET_S
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": dev, "torch": torch.__version__, **measure(torch, budget_s)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
