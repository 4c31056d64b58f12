"""Pure evaluations of the benchmarks against recorded figures (tests/data/bench/README.md).

No torch, no Slurm: `(facts, thresholds, history) -> BenchResult` on the H100 figures of
REFERENCE.md, a real H200 run, and real dev-cluster CPU runs (healthy and throttled).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bluevela.bench.allreduce import bus_factor, figures_from_times, sweep_sizes
from bluevela.bench.catalog import get, measurements
from bluevela.bench.evaluate import baseline_of, evaluate
from bluevela.bench.registry import Check, register
from bluevela.bench.result import Facts, Figure, Status
from bluevela.bench.runner import facts_from_document
from bluevela.site import BenchThresholds, Site
from bluevela.site_file import validate
from tests.conftest import DATA

BENCH = DATA / "bench"


def _th(**values: float) -> BenchThresholds:
    """Thresholds from keywords (validated, the way site.yaml's are)."""
    return validate(BenchThresholds, values)


def _facts(path: Path) -> dict[str, Facts]:
    doc = json.loads(path.read_text())
    if "facts" in doc and isinstance(doc["facts"], list):
        return {f["measurement"]: Facts.from_dict(f) for f in doc["facts"]}
    if "results" in doc:
        return {f.measurement: f for f in facts_from_document(doc)}
    f = Facts.from_dict(doc)
    return {f.measurement: f}


def test_registry_has_every_measurement_once() -> None:
    names = set(measurements())
    assert names == {"gemm", "hbm", "h2d", "d2h", "allreduce", "allreduce-pair", "mpi"}
    with pytest.raises(ValueError, match="twice"):
        register("gemm", scope="node", checks=(), summary="dup")(lambda p: Facts("gemm"))
    with pytest.raises(ValueError, match="no BenchThresholds field"):
        register("x", scope="node", checks=(Check("x", "no_such"),), summary="x")


def test_h100_reference_figures_pass_the_h100_floors(site: Site) -> None:
    th = site.node_class(name="h100").bench
    for name, facts in _facts(BENCH / "h100_reference.json").items():
        result = evaluate(get(name), facts, th)
        assert result.status is Status.OK, result.message


@pytest.mark.parametrize(("name", "figure", "bad"), [
    ("gemm", "gemm_tflops", 650.0),            # a throttled GPU: 82% of the observed 794
    ("hbm", "hbm_gbs", 2400.0),
    ("h2d", "h2d_gbs", 26.0),                  # a PCIe link trained at half width
    ("allreduce", "allreduce_busbw_gbs", 370.0),  # Ring without NVLS, under the 440 floor
    ("allreduce-pair", "pair_busbw_gbs", 190.0),   # half the NICs down
    ("mpi", "mpi_bw_gbs", 23.0),
])
def test_h100_degraded_figure_is_critical(site: Site, name: str, figure: str,
                                          bad: float) -> None:
    th = site.node_class(name="h100").bench
    good = _facts(BENCH / "h100_reference.json")[name]
    figs = tuple(replace(f, value=bad) if f.headline and f.name == figure else f
                 for f in good.figures)
    result = evaluate(get(name), replace(good, figures=figs), th)
    assert result.status is Status.CRITICAL
    assert f"{figure} {bad:.4g}" in result.message and "< floor" in result.message


def test_h200_run_recorded_on_a_real_gpu(site: Site) -> None:
    """`bv bench run gemm hbm h2d d2h allreduce --json` as it came back from one H200."""
    facts = _facts(BENCH / "h200_bench_run.json")
    th = site.node_class(name="h100").bench  # H200 is at least as fast: the floors hold
    for name in ("gemm", "hbm", "h2d", "d2h"):
        assert evaluate(get(name), facts[name], th).status is Status.OK
    assert facts["gemm"].headline("gemm_tflops") == pytest.approx(787, rel=0.05)
    # One GPU: a single rank has no bus bandwidth: not applicable, not a failure.
    result = evaluate(get("allreduce"), facts["allreduce"], th)
    assert result.status is Status.OK and not result.applicable


def test_cpu_run_from_the_dev_cluster_passes_with_margin(site: Site) -> None:
    th = site.node_class(name="cpu").bench
    facts = _facts(BENCH / "cpu_node1_run.json")
    facts |= _facts(BENCH / "cpu_pair_allreduce.json") | _facts(BENCH / "cpu_pair_mpi.json")
    for name, f in facts.items():
        result = evaluate(get(name), f, th)
        assert result.status is Status.OK, result.message
        for v in result.verdicts:
            if v.limit and not v.ceiling:
                assert v.value > 10 * v.limit, f"{v.name}: CI would flake at {v.value}"
    assert not evaluate(get("h2d"), facts["h2d"], th).applicable


def test_throttled_link_fails_the_cpu_pair_floors(site: Site) -> None:
    th = site.node_class(name="cpu").bench
    facts = _facts(BENCH / "cpu_pair_allreduce_throttled.json")
    facts |= _facts(BENCH / "cpu_pair_mpi_throttled.json")
    for name, figure in (("allreduce-pair", "pair_busbw_gbs"), ("mpi", "mpi_bw_gbs")):
        result = evaluate(get(name), facts[name], th)
        assert result.status is Status.CRITICAL
        assert [v.name for v in result.failed_figures] == [figure]
        # 50 Mbit/s is 0.00625 GB/s: what came through is at most that.
        value = facts[name].headline(figure)
        assert value is not None and value < 0.00625 * 1.05


def test_regression_against_history_is_a_warning() -> None:
    th = _th(gemm_tflops=700, regression_nights=3, regression_tolerance_pct=5)
    facts = Facts("gemm", (Figure("gemm_tflops", 720.0, "TFLOP/s"),))
    # median of the last 3 nights is 790: 720 is 9% below, over the 5% tolerance
    past = {"gemm_tflops": [500.0, 790.0, 792.0, 780.0]}
    result = evaluate(get("gemm"), facts, th, past)
    assert result.status is Status.WARNING
    assert "regressed 9%" in result.message and "790" in result.message
    # within tolerance: OK; and no history at all: OK
    assert evaluate(get("gemm"), facts, th, {"gemm_tflops": [740.0]}).status is Status.OK
    assert evaluate(get("gemm"), facts, th, {}).status is Status.OK


def test_latency_is_judged_against_a_ceiling() -> None:
    th = _th(mpi_bw_gbs=1.0, mpi_lat_us_max=10.0, regression_tolerance_pct=20)
    figs = (Figure("mpi_bw_gbs", 5.0, "GB/s"), Figure("mpi_lat_us", 12.0, "us"))
    result = evaluate(get("mpi"), Facts("mpi", figs), th)
    assert result.status is Status.CRITICAL and "mpi_lat_us 12 us > ceiling 10" in result.message
    figs = (Figure("mpi_bw_gbs", 5.0, "GB/s"), Figure("mpi_lat_us", 6.0, "us"))
    assert evaluate(get("mpi"), Facts("mpi", figs), th, {"mpi_lat_us": [4.0, 4.0]}).status \
        is Status.WARNING  # 50% slower than its history


def test_could_not_run_is_unknown_never_critical() -> None:
    th = _th(gemm_tflops=700)
    result = evaluate(get("gemm"), Facts.failed("gemm", "node class has 8 GPUs, torch sees 7"),
                      th)
    assert result.status is Status.UNKNOWN and "torch sees 7" in result.message
    nan = Facts("gemm", (Figure("gemm_tflops", math.nan, "TFLOP/s"),))
    assert evaluate(get("gemm"), nan, th).status is Status.UNKNOWN
    # A floor set but the figure missing: UNKNOWN; no floor and missing: nothing to judge.
    assert evaluate(get("gemm"), Facts("gemm"), th).status is Status.UNKNOWN
    assert evaluate(get("gemm"), Facts("gemm"), _th()).status is Status.OK


def test_baseline_is_the_median_of_the_last_nights() -> None:
    assert baseline_of([1.0, 100.0, 3.0, 5.0, 4.0], 3) == 4.0
    assert math.isnan(baseline_of([], 7))
    assert baseline_of([math.nan, 2.0], 7) == 2.0


def test_busbw_follows_nccl_tests() -> None:
    assert bus_factor(1) == 0 and bus_factor(2) == 1 and bus_factor(8) == pytest.approx(1.75)
    # 8 ranks, 1 GiB in 4 ms: algbw 268.4 GB/s, busbw x 1.75
    figs = figures_from_times("allreduce", 8, [(1 << 30, 0.004), (1 << 20, 0.0001)])
    head = {f.name: f.value for f in figs if f.headline}
    assert head["allreduce_algbw_gbs"] == pytest.approx(268.435456)
    assert head["allreduce_busbw_gbs"] == pytest.approx(268.435456 * 1.75)
    assert sorted({f.size for f in figs}) == [0, 1 << 20, 1 << 30]


def test_sweep_sizes() -> None:
    assert sweep_sizes(4 << 20) == [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert sweep_sizes(8 << 30) == [8 << 20, 32 << 20, 128 << 20, 512 << 20, 2 << 30, 8 << 30]
    assert sweep_sizes(1000) == [1000]
