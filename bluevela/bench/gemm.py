"""`gemm`: matrix multiply throughput, TFLOP/s = 2·M·N·K / time / 1e12.

bf16 on every GPU of the node over a few square shapes (the best shape is the GPU's figure, the
slowest GPU the node's); fp32 on a CPU node. Inputs are random normal: zeros run measurably
faster on Hopper (less switching power), which would flatter the figure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from bluevela.bench.registry import Check, RunParams, register
from bluevela.bench.result import Facts, Figure
from bluevela.bench.timing import gpu_count, median_cpu_s, median_cuda_s

logger = logging.getLogger(__name__)

GPU_SHAPES = (4096, 8192, 16384)  # 8192^3 is the usual best shape on H100/H200
CPU_SHAPES = (256, 512)
UNIT = "TFLOP/s"


def tflops(n: int, seconds: float) -> float:
    """TFLOP/s of an n x n x n matmul that took `seconds`."""
    return 2.0 * n * n * n / seconds / 1e12


def _matmul(torch: Any, a: Any, b: Any, c: Any) -> Callable[[], object]:
    def run() -> object:
        return torch.matmul(a, b, out=c)

    return run


def _gpu(torch: Any, params: RunParams, ngpu: int) -> Facts:
    figures: list[Figure] = []
    per_gpu: list[float] = []
    for dev in range(ngpu):
        torch.cuda.set_device(dev)
        best = 0.0
        for n in GPU_SHAPES:
            a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
            c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
            t = median_cuda_s(torch, _matmul(torch, a, b, c), budget_s=params.budget_s,
                              warmup=max(params.warmup, 3), max_iters=params.max_iters)
            value = tflops(n, t)
            figures.append(Figure("gemm_tflops", value, UNIT, device=dev, size=n))
            best = max(best, value)
            del a, b, c
        torch.cuda.empty_cache()
        figures.append(Figure("gemm_tflops", best, UNIT, device=dev))
        per_gpu.append(best)
    figures.append(Figure("gemm_tflops", min(per_gpu), UNIT))
    name = torch.cuda.get_device_name(0)
    return Facts("gemm", tuple(figures), note=f"bf16, {ngpu} x {name}, shapes {GPU_SHAPES}")


def _cpu(torch: Any, params: RunParams) -> Facts:
    figures: list[Figure] = []
    best = 0.0
    for n in CPU_SHAPES:
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        c = torch.empty(n, n, dtype=torch.float32)
        t = median_cpu_s(_matmul(torch, a, b, c), budget_s=params.budget_s,
                         warmup=params.warmup, max_iters=params.max_iters)
        value = tflops(n, t)
        figures.append(Figure("gemm_tflops", value, UNIT, size=n))
        best = max(best, value)
    figures.append(Figure("gemm_tflops", best, UNIT))
    return Facts("gemm", tuple(figures),
                 note=f"fp32 on CPU, {torch.get_num_threads()} thread(s), shapes {CPU_SHAPES}")


@register("gemm", scope="node", checks=(Check("gemm_tflops", "gemm_tflops"),),
          summary="matmul TFLOP/s (bf16 per GPU, fp32 on CPU)")
def gather(params: RunParams) -> Facts:
    """Measure matmul throughput on this node."""
    import torch

    ngpu = gpu_count(torch)
    if params.gpus and ngpu < params.gpus:
        from bluevela.bench.evaluate import short_of_gpus

        return short_of_gpus("gemm", params.gpus, ngpu)
    return _gpu(torch, params, ngpu) if ngpu else _cpu(torch, params)
