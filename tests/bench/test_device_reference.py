"""The bare-torch reference times exactly as bv does (issue 9, item 7), checked on a CPU.

The GPU figures themselves need a real H100/H200 (benchmarks/device/run.sh); here:
- both CUDA timing loops make the same calls in the same order (warm-up, one sizing call, then
  back-to-back launches between event pairs and ONE synchronize), on a recording stand-in for
  torch.cuda, and give the same median;
- the reference uses bv's shapes, dtypes and sizes;
- `interleave.py` runs bv's and the reference's CPU paths alternately and reports each ratio
  with its spread.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bluevela.bench import gemm, memory, timing
from bluevela.bench.registry import RunParams
from bluevela.site import BenchThresholds
from tests.conftest import REPO
from tests.fakes import RecordingCuda

sys.path.insert(0, str(REPO / "benchmarks" / "device"))
import interleave  # noqa: E402
import reference  # noqa: E402

# Per-launch device times with outliers: a loop that timed differently would show it.
KERNEL_MS = (1.0, 1.3, 0.9, 5.0, 1.1, 1.0, 0.95)


@pytest.mark.parametrize(("budget_s", "warmup"), [(0.5, 3), (0.5, 2), (0.004, 2), (10.0, 5)])
def test_reference_cuda_loop_is_bvs(budget_s: float, warmup: int) -> None:
    bv, ref = RecordingCuda(KERNEL_MS), RecordingCuda(KERNEL_MS)
    t_bv = timing.median_cuda_s(bv, bv.launch, budget_s=budget_s, warmup=warmup)
    t_ref = reference.cuda_median_s(ref, ref.launch, budget_s=budget_s, warmup=warmup)
    assert ref.calls == bv.calls
    assert t_ref == t_bv
    # The method itself: after the sizing call, launches back to back, one sync at the end.
    timed = bv.calls[bv.calls.index("sync", warmup + 1) + 1:]
    assert timed[-1] == "sync" and "sync" not in timed[:-1] and "event-sync" not in timed
    assert timed[:-1] == ["record", "launch", "record"] * (len(timed[:-1]) // 3)


def test_reference_defaults_are_bvs() -> None:
    params = RunParams(thresholds=BenchThresholds())
    assert reference.GPU_SHAPES == gemm.GPU_SHAPES and reference.CPU_SHAPES == gemm.CPU_SHAPES
    assert reference.GPU_COPY_BYTES == memory.GPU_COPY_BYTES
    assert reference.CPU_COPY_BYTES == memory.CPU_COPY_BYTES
    assert reference.HOST_DEVICE_BYTES == memory.HOST_DEVICE_BYTES
    assert (reference.BUDGET_S, reference.WARMUP, reference.MAX_ITERS) == (
        params.budget_s, params.warmup, params.max_iters)
    for est in (0.0, 1e-5, 0.02, 0.3, 5.0):
        assert reference.iterations(est, 0.5) == timing.iterations_for(est, 0.5)


def test_interleave_reports_ratio_with_spread() -> None:
    """Two (bv, reference) rounds on the CPU paths; every shared figure has a ratio spread."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "interleave.py"),
                           "--pairs", "2", "--budget-s", "0.005"], capture_output=True,
                          text=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["device"] == "cpu" and doc["pairs"] == 2 and len(doc["rounds"]) == 2
    want = {"gemm_256_tflops", "gemm_512_tflops", "gemm_tflops", "hbm_gbs"}
    assert set(doc["summary"]) == want  # h2d/d2h do not apply on a CPU
    for s in doc["summary"].values():
        r = s["ratio"]
        assert 0 < r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
        assert s["bv_median"] > 0 and s["reference_median"] > 0


def test_interleave_alternates_a_and_b() -> None:
    order: list[str] = []

    def a(budget_s: float) -> dict[str, float]:
        order.append("A")
        return {"x": 2.0}

    def b(budget_s: float) -> dict[str, float]:
        order.append("B")
        return {"x": 4.0 if len(order) % 4 else 1.0}

    doc = interleave.interleave(3, 0.1, a, b)
    assert order == ["A", "B"] * 4  # one discarded warm-up round, then three pairs
    # ratios 2.0, 0.5, 2.0 over the three pairs
    assert doc["summary"]["x"]["ratio"] == {"median": 2.0, "min": 0.5, "max": 2.0, "q1": 1.25,
                                            "q3": 2.0}
