"""Timing loops shared by the measurements: warm-up, an iteration count that fits a time
budget, then the median of per-iteration times (CUDA events on a GPU, perf_counter on a CPU).

torch is passed in by the caller (imported there, inside a function): nothing here imports it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def iterations_for(estimate_s: float, budget_s: float, *, min_iters: int = 3,
                   max_iters: int = 20) -> int:
    """How many timed iterations fit `budget_s` when one takes `estimate_s` (bounded)."""
    if estimate_s <= 0:
        return max_iters
    return max(min_iters, min(max_iters, int(budget_s / estimate_s)))


def median_cpu_s(fn: Callable[[], object], *, budget_s: float, warmup: int = 1,
                 min_iters: int = 3, max_iters: int = 20) -> float:
    """Median wall seconds of `fn()` on the CPU, after `warmup` calls."""
    for _ in range(max(warmup, 1)):
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
    n = iterations_for(first, budget_s, min_iters=min_iters, max_iters=max_iters)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_cuda_s(torch: Any, fn: Callable[[], object], *, budget_s: float, warmup: int = 2,
                  min_iters: int = 3, max_iters: int = 20) -> float:
    """Median seconds of `fn()` on the current CUDA device, timed with CUDA events.

    Each timed iteration is bracketed by its own pair of events on the current stream, so the
    launch overhead between iterations does not count; the median drops clock ramp-up outliers.
    """
    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = iterations_for(start.elapsed_time(end) / 1e3, budget_s, min_iters=min_iters,
                       max_iters=max_iters)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def gpu_count(torch: Any) -> int:
    """CUDA devices torch can use (0 without CUDA)."""
    try:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a driver that fails to initialise
        return 0
