"""Bare torch references on a real GPU, for ratios against `bv bench run` in the same run.

Prints one JSON object: the best bf16 matmul TFLOP/s over a few large shapes, device-to-device
copy GB/s (bytes read + written), pinned host-to-device and device-to-host GB/s. Timed with CUDA
events after warm-up; median of repeats; random data (never zeros).
"""

from __future__ import annotations

import json
import statistics

import torch


def _time_ms(fn, reps: int = 20, warmup: int = 5) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_tflops() -> dict[str, float]:
    out = {}
    for n in (4096, 8192, 16384):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = _time_ms(lambda a=a, b=b: torch.mm(a, b), reps=10 if n == 16384 else 30)
        out[f"gemm_bf16_{n}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
    return out


def copy_gbs() -> float:
    n = 1 << 30  # 1 GiB of bytes, well past L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps=30)
    return 2 * n / (ms * 1e-3) / 1e9


def h2d_d2h_gbs() -> tuple[float, float]:
    n = 1 << 30
    host = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = _time_ms(lambda: dev.copy_(host, non_blocking=True), reps=10)
    d2h = _time_ms(lambda: host.copy_(dev, non_blocking=True), reps=10)
    return n / (h2d * 1e-3) / 1e9, n / (d2h * 1e-3) / 1e9


def main() -> None:
    g = gemm_tflops()
    h2d, d2h = h2d_d2h_gbs()
    print(json.dumps({
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        **g,
        "gemm_bf16_best_tflops": max(g.values()),
        "copy_d2d_gbs": copy_gbs(),
        "h2d_gbs": h2d,
        "d2h_gbs": d2h,
    }))


if __name__ == "__main__":
    main()
