"""bv's measurements against the bare-torch reference, interleaved on the same warm device.

    python benchmarks/device/interleave.py [--pairs N] [--budget-s S] > interleave.json

In ONE process (one CUDA context, one allocator, the GPU kept warm): a discarded warm-up round
of both, then N rounds of bv (`bluevela.bench.gemm.gather`, `memory.gather_hbm/h2d/d2h`: what
`bv bench run` calls) followed by the reference (`reference.measure`, same method in bare torch),
A B A B ... Each round gives a ratio bv / reference per figure; the ratio is reported as the
median over the rounds with its min-max and inter-quartile range, so a difference smaller than
the spread is not read as bv being faster or slower. On a CPU it runs bv's and the reference's
CPU paths (the tests use that); the GPU figures need a real H100/H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference  # noqa: E402  (this directory, not a package)

Figures = dict[str, float]


def bv_figures(budget_s: float) -> Figures:
    """bv's own measurements on this device, under reference.measure's names."""
    from bluevela.bench import gemm, memory
    from bluevela.bench.registry import RunParams
    from bluevela.bench.result import NODE
    from bluevela.site import BenchThresholds

    params = RunParams(thresholds=BenchThresholds(), budget_s=budget_s)
    figs: Figures = {}
    g = gemm.gather(params)
    gpu0 = [f for f in g.figures if f.device in (0, NODE) and f.size]
    by_size: dict[int, float] = {}
    for f in gpu0:  # on a GPU node device 0's shapes; on a CPU the node's
        if f.device == 0 or f.size not in by_size:
            by_size[f.size] = f.value
    figs.update({f"gemm_{n}_tflops": v for n, v in sorted(by_size.items())})
    figs["gemm_tflops"] = max(by_size.values())
    for name, fn in (("hbm", memory.gather_hbm), ("h2d", memory.gather_h2d),
                     ("d2h", memory.gather_d2h)):
        facts = fn(params)
        if not facts.applicable:
            continue
        if not facts.ran:
            raise RuntimeError(f"bv {name} did not run: {facts.note}")
        # GPU 0's figure on a GPU node (it comes first), the node's on a CPU
        figs[f"{name}_gbs"] = next(f.value for f in facts.figures
                                   if f.device in (0, NODE) and not f.size)
    return figs


def ref_figures(budget_s: float) -> Figures:
    import torch

    return reference.measure(torch, budget_s)


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (the quartiles equal the median with one value)."""
    med = statistics.median(values)
    q1, q3 = (statistics.quantiles(values, n=4, method="inclusive")[::2] if len(values) > 1
              else (med, med))
    return {"median": med, "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def interleave(pairs: int, budget_s: float, a: Callable[[float], Figures] = bv_figures,
               b: Callable[[float], Figures] = ref_figures) -> dict[str, Any]:
    """`a` then `b`, `pairs` times after one discarded round; per-figure ratios a/b."""
    a(budget_s)
    b(budget_s)
    rounds = []
    for _ in range(pairs):
        fa = a(budget_s)
        fb = b(budget_s)
        rounds.append({"bv": fa, "reference": fb,
                       "ratio": {k: fa[k] / fb[k] for k in sorted(fa.keys() & fb.keys())
                                 if fb[k] > 0}})
    names = sorted(set.intersection(*(set(r["ratio"]) for r in rounds))) if rounds else []
    summary = {k: {"ratio": spread([r["ratio"][k] for r in rounds]),
                   "bv_median": statistics.median(r["bv"][k] for r in rounds),
                   "reference_median": statistics.median(r["reference"][k] for r in rounds)}
               for k in names}
    return {"pairs": pairs, "budget_s": budget_s, "order": "warm-up A B, then (A B) x pairs; "
            "A = bv (bluevela.bench), B = bare torch (benchmarks/device/reference.py)",
            "summary": summary, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=reference.BUDGET_S)
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    import torch

    doc = interleave(args.pairs, args.budget_s)
    doc["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc["torch"] = torch.__version__
    print(json.dumps(doc, indent=1, sort_keys=True))
    for k, s in doc["summary"].items():
        r = s["ratio"]
        print(f"{k:18} bv/ref median {r['median']:.3f}  min-max {r['min']:.3f}-{r['max']:.3f}  "
              f"IQR {r['q1']:.3f}-{r['q3']:.3f}  (bv {s['bv_median']:.4g}, "
              f"ref {s['reference_median']:.4g})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
