"""The efficiency analysis's stages one at a time (`report/efficiency_stages.py`), its typed
findings (`efficiency_model.Finding`, `Straggler`) and the thermal class it shares with the gpu
check (`health/throttle.py`), on small hand-made series: each stage's dataclass result is
checked against figures computed by hand, without the page.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from bluevela.health.throttle import CLASSES, HW_SLOWDOWN, HW_THERMAL_SLOWDOWN, SW_THERMAL_SLOWDOWN
from bluevela.report import efficiency_stages as st
from bluevela.report.efficiency import analyze
from bluevela.report.efficiency_model import Finding, Thresholds
from bluevela.report.efficiency_source import accumulate, mem_source
from tests.report.test_efficiency import T0, make_series

TH = Thresholds()


def _two_nodes() -> SimpleNamespace:
    """2 nodes x 1 GPU x 6 samples at 5 s (test_efficiency's hand-computed job)."""
    nan = np.nan
    util = np.array([[[0, 80, 90, 100, 90, 0]], [[0, 60, 70, 80, nan, 0]]], np.float32)
    power = np.array([[[100, 400, 500, 600, 500, 100]], [[100, 300, 300, 300, nan, 100]]],
                     np.float32)
    return SimpleNamespace(job_id=7, interval_s=5.0, time=T0 + 5.0 * np.arange(6),
                           nodes=["a", "b"], gpu={"util_pct": util, "power_w": power}, node={})


def test_each_stage_by_hand() -> None:
    src = mem_source(_two_nodes())
    acc = accumulate(src, TH, block_nodes=1)
    steady = st.steady_state(acc, src.n_gpus, TH)
    # job-wide utilisation per sample 0, 70, 80, 90, 90, 0: p90 90, steady >= 45: samples 1-4
    assert (steady.use_gpu, steady.basis, steady.p90) == (True, "GPU utilisation", 90.0)
    assert steady.bins.tolist() == [False, True, True, True, True, False]
    assert steady.samples == 4
    cov = st.coverage(acc, steady, src.nodes, {"nodelist": ["a", "b", "c"]}, TH)
    assert cov.node.tolist() == [1.0, 0.75] and cov.covered.tolist() == [True, True]
    assert cov.missing == [{"node": "c", "coverage": 0.0,
                            "why": "no time series from this node"}]
    gpu = st.gpu_figures(acc, steady, cov, TH)
    assert gpu.util[:, 0].tolist() == [90.0, 70.0] and gpu.power[:, 0].tolist() == [500, 300]
    assert gpu.pool.all() and not gpu.idle.any() and np.isnan(gpu.clock).all()
    en = st.energy(acc, gpu, None)
    assert en.node_j.tolist() == [11000.0, 5500.0] and en.summary["series_j"] == 16500
    cpu = st.cpu_figures(acc, steady, len(src.nodes))
    assert cpu.summary == {"busy_mean_pct": None, "throttled_mean_pct": None}
    rows = st.node_rows(src.nodes, cov, gpu, cpu, en, [])
    assert [(r.node, r.gpu_util_pct, r.gpu_power_w, r.straggler) for r in rows] == [
        ("a", 90.0, 500.0, False), ("b", 70.0, 300.0, False)]


def test_findings_are_typed_and_frozen() -> None:
    s = make_series()
    s.gpu["util_pct"][5, 2, 3:-3] = 70
    s.gpu["sm_clock_mhz"][5, 2, 3:-3] = 1400
    (one,) = analyze(s).stragglers
    assert [f.metric for f in one.findings] == ["util_pct", "sm_clock_mhz"]
    assert all(isinstance(f, Finding) and f.on_gpu for f in one.findings)
    assert one.findings[0].value == 70.0 and one.findings[0].text.startswith("util 70% ")
    assert one.metrics == {f.metric: {"value": f.value, "job_median": f.job_median}
                           for f in one.findings}
    assert one.score == max(f.score for f in one.findings) > 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.findings[0].value = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("bits", "metric"), [
    (SW_THERMAL_SLOWDOWN, "thermal"), (HW_THERMAL_SLOWDOWN, "thermal"),
    (HW_SLOWDOWN, "hw_slowdown")])
def test_the_thermal_class_is_health_throttles(bits: int, metric: str) -> None:
    """SW and HW thermal slowdown are both "thermal slowdown"; HW slowdown (the umbrella bit,
    also a power brake) is its own finding, never called thermal."""
    s = make_series()
    s.gpu["clocks_event_reasons"][2, 1, 40:100] = bits
    (one,) = analyze(s).stragglers
    assert [f.metric for f in one.findings] == [metric]
    assert one.evidence.startswith(f"gpu002 GPU 1: {CLASSES[metric].label} 53% of samples")
    assert ("°C vs job median" in one.evidence) == (metric == "thermal")


def test_a_whole_nodes_gpus_are_named_once_with_merged_findings() -> None:
    s = make_series()
    s.gpu["clocks_event_reasons"][4, :, 30:100] = HW_THERMAL_SLOWDOWN | HW_SLOWDOWN
    (one,) = analyze(s).stragglers
    assert (one.node, one.gpu, [f.metric for f in one.findings]) == (
        "gpu004", None, ["thermal", "hw_slowdown"])
    assert one.evidence.startswith("gpu004 (all 4 GPUs): thermal slowdown 61% of samples")
