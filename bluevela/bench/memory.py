"""`hbm`, `h2d`, `d2h`: memory copy bandwidth in GB/s (GB = 1e9 B).

- `hbm`: device-to-device copy on every GPU, counting bytes read + written (2 x buffer), as
  STREAM's copy does; on a CPU node the same copy in host memory.
- `h2d` / `d2h`: pinned host memory to and from every GPU (buffer bytes / time). They do not
  apply on a CPU node: "not applicable", not a failure.
"""

from __future__ import annotations

import logging
from typing import Any

from bluevela.bench.registry import Check, RunParams, register
from bluevela.bench.result import Facts, Figure
from bluevela.bench.timing import gpu_count, median_cpu_s, median_cuda_s

logger = logging.getLogger(__name__)

GPU_COPY_BYTES = 1 << 30  # 1 GiB: ~0.7 ms at 3 TB/s, far past every cache
CPU_COPY_BYTES = 64 << 20
HOST_DEVICE_BYTES = 256 << 20
UNIT = "GB/s"


def _no_gpus(name: str, params: RunParams, ngpu: int) -> Facts | None:
    if params.gpus and ngpu < params.gpus:
        from bluevela.bench.evaluate import short_of_gpus

        return short_of_gpus(name, params.gpus, ngpu)
    return None


def _per_gpu(name: str, values: list[float], extra: str) -> Facts:
    figures = [Figure(name + "_gbs", v, UNIT, device=i) for i, v in enumerate(values)]
    figures.append(Figure(name + "_gbs", min(values), UNIT))
    return Facts(name, tuple(figures), note=extra)


def _d2d(torch: Any, params: RunParams, dev: int) -> float:
    torch.cuda.set_device(dev)
    src = torch.empty(GPU_COPY_BYTES, dtype=torch.uint8, device=dev).fill_(7)
    dst = torch.empty_like(src)
    t = median_cuda_s(torch, lambda: dst.copy_(src), budget_s=params.budget_s,
                      warmup=params.warmup, max_iters=params.max_iters)
    return 2 * GPU_COPY_BYTES / t / 1e9


@register("hbm", scope="node", checks=(Check("hbm_gbs", "hbm_gbs"),),
          summary="device memory copy GB/s, read + written (host memory on CPU nodes)")
def gather_hbm(params: RunParams) -> Facts:
    """Measure memory copy bandwidth on this node."""
    import torch

    ngpu = gpu_count(torch)
    if (failed := _no_gpus("hbm", params, ngpu)) is not None:
        return failed
    if ngpu:
        values = []
        for d in range(ngpu):
            values.append(_d2d(torch, params, d))
            torch.cuda.empty_cache()  # the buffers died with _d2d's frame
        return _per_gpu("hbm", values, f"device copy of {GPU_COPY_BYTES >> 20} MiB, "
                                       "read + written")
    src = torch.empty(CPU_COPY_BYTES, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    t = median_cpu_s(lambda: dst.copy_(src), budget_s=params.budget_s, warmup=params.warmup,
                     max_iters=params.max_iters)
    value = 2 * CPU_COPY_BYTES / t / 1e9
    return Facts("hbm", (Figure("hbm_gbs", value, UNIT),),
                 note=f"host memory copy of {CPU_COPY_BYTES >> 20} MiB, read + written")


def _host_device(torch: Any, params: RunParams, dev: int, to_device: bool) -> float:
    torch.cuda.set_device(dev)
    host = torch.empty(HOST_DEVICE_BYTES, dtype=torch.uint8, pin_memory=True).fill_(7)
    gpu = torch.empty(HOST_DEVICE_BYTES, dtype=torch.uint8, device=dev)
    if to_device:
        def fn() -> object:
            return gpu.copy_(host, non_blocking=True)
    else:
        def fn() -> object:
            return host.copy_(gpu, non_blocking=True)
    t = median_cuda_s(torch, fn, budget_s=params.budget_s, warmup=params.warmup,
                      max_iters=params.max_iters)
    return HOST_DEVICE_BYTES / t / 1e9


def _h2d_d2h(name: str, params: RunParams, to_device: bool) -> Facts:
    import torch

    ngpu = gpu_count(torch)
    if (failed := _no_gpus(name, params, ngpu)) is not None:
        return failed
    if not ngpu:
        return Facts(name, applicable=False, note="no GPU: host-device copies do not apply")
    values = []
    for d in range(ngpu):
        values.append(_host_device(torch, params, d, to_device))
        torch.cuda.empty_cache()
    return _per_gpu(name, values, f"pinned host memory, {HOST_DEVICE_BYTES >> 20} MiB")


@register("h2d", scope="node", checks=(Check("h2d_gbs", "h2d_gbs"),),
          summary="pinned host to device copy GB/s (GPU only)")
def gather_h2d(params: RunParams) -> Facts:
    """Measure host-to-device copy bandwidth on every GPU."""
    return _h2d_d2h("h2d", params, to_device=True)


@register("d2h", scope="node", checks=(Check("d2h_gbs", "d2h_gbs"),),
          summary="device to pinned host copy GB/s (GPU only)")
def gather_d2h(params: RunParams) -> Facts:
    """Measure device-to-host copy bandwidth on every GPU."""
    return _h2d_d2h("d2h", params, to_device=False)
