"""The nccl check: nccl-tests' bandwidth definitions, and a real gloo run on this CPU machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.checks.nccl import NCCLFacts, bus_bandwidth, evaluate_nccl, measure
from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.runner import plan_prolog, plan_tier, run_plan
from bluevela.health.state import (
    NCCL_RETRY_BASE_S,
    NCCL_RETRY_MAX_S,
    nccl_attempts,
    nccl_is_stale,
    nccl_retry_delay_s,
    record_nccl_attempt,
    record_nccl_pass,
)
from bluevela.site import NodeClass, Site

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu(site: Site) -> NodeClass:
    return site.node_class(name="cpu")


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    # 8 ranks, 1 GB in 2.5 ms: algbw 400 GB/s, busbw = 400 * 2*7/8 = 700.
    algbw, busbw = bus_bandwidth(1_000_000_000, 0.0025, 8)
    assert algbw == pytest.approx(400.0) and busbw == pytest.approx(700.0)
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx((1.0, 1.0))  # factor 1 for 2 ranks
    assert bus_bandwidth(10**9, 1.0, 1)[1] == 0.0


def test_evaluator(cpu: NodeClass, site: Site) -> None:
    h100 = site.node_class(name="h100")
    gib = 1 << 30
    # 8x H100, 1 GiB in 4.0 ms -> busbw 469.8 GB/s >= 340.
    ok = evaluate_nccl(NCCLFacts("nccl", 8, gib, 20, time_s=0.004), h100)
    assert ok.status is Status.OK and ok.metrics["busbw_gbs"] == pytest.approx(469.76, rel=1e-3)
    assert ok.summary.startswith("busbw 470 GB/s >= 340 GB/s (nccl, 8 ranks, 1 GiB)")
    slow = evaluate_nccl(NCCLFacts("nccl", 8, gib, 20, time_s=0.01), h100)
    assert slow.status is Status.CRITICAL and "< 340 GB/s" in slow.summary
    one = evaluate_nccl(NCCLFacts("nccl", 1, gib, 20, time_s=0.01), h100)
    assert one.status is Status.OK and "not applicable: 1 rank has no bus bandwidth" in one.summary
    err = evaluate_nccl(NCCLFacts("gloo", 2, gib, 20, error="rank 1: boom"), cpu)
    assert err.status is Status.UNKNOWN and "could not run" in err.summary


def test_gpu_class_without_a_gpu_is_unknown_fast(site: Site) -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    h100 = site.node_class(name="h100")
    r = get_check("nccl").run_once(ProbeContext(h100, "h100"))
    assert r.status is Status.UNKNOWN and "/dev/nvidiactl missing" in r.summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_gloo_across_two_local_processes_reports_busbw(cpu: NodeClass) -> None:
    facts = measure("gloo", 2, 1 << 20, iters=3, warmup=1)
    assert facts.error is None, facts.error
    r = evaluate_nccl(facts, cpu)
    assert r.status is Status.OK, r
    assert r.metrics["busbw_gbs"] > 0 and r.metrics["ranks_count"] == 2
    assert set(r.metrics) >= {"busbw_gbs", "algbw_gbs", "time_s", "size_bytes"}
    assert "GB/s" in r.summary and "gloo, 2 ranks, 1 MiB" in r.summary


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_full_tier_on_the_cpu_class(site: Site, cpu: NodeClass, tmp_path: Path) -> None:
    """The site's own cpu class through the runner (what the dev cluster's healthcheck runs)."""
    ctx = ProbeContext(cpu, "cpu", state_dir=tmp_path, phase="healthcheck")
    rep = run_plan(plan_tier(site, "full", ["nccl"]), ctx)
    r = rep.checks[0]
    assert r.status is Status.OK, r
    assert r.metrics["busbw_gbs"] >= cpu.nccl.min_busbw_gbs and r.metrics["tries_count"] == 1


def test_nccl_attempts_back_off(site: Site, tmp_path: Path) -> None:
    """Issue 9 item 2: a node whose nccl cannot run is retried with back-off, not on every job
    start (old main recorded passes only: every prolog reran it). The attempt that cannot run
    here is real: the h100 class on this GPU-less machine, through the forked runner."""
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    h100 = site.node_class(name="h100")
    ctx = ProbeContext(h100, "h100", state_dir=tmp_path, phase="prolog")
    plan = plan_prolog(site, nccl_is_stale(tmp_path, site.health.nccl_freshness_h))
    assert "nccl" in plan.checks  # never passed, never tried
    rep = run_plan(plan_tier(site, "full", ["nccl"]), ctx)
    assert rep.checks[0].status is Status.UNKNOWN
    tried = nccl_attempts(tmp_path)
    assert tried is not None and tried["failures"] == 1  # one attempt, its retries included
    t = float(tried["time"])
    assert not nccl_is_stale(tmp_path, 6.0, now=t + 60)  # backing off
    assert plan_prolog(site, nccl_is_stale(tmp_path, 6.0, now=t + 60)).checks == ("gpu", "ib", "node", "versions")
    assert nccl_is_stale(tmp_path, 6.0, now=t + NCCL_RETRY_BASE_S + 1)
    # Each further attempt without a pass doubles the wait, capped at 6 h.
    for n in range(2, 9):
        record_nccl_attempt(tmp_path, now=t)
        delay = nccl_retry_delay_s(n)
        assert delay == min(NCCL_RETRY_MAX_S, NCCL_RETRY_BASE_S * 2 ** (n - 1))
        assert not nccl_is_stale(tmp_path, 6.0, now=t + delay - 1)
        assert nccl_is_stale(tmp_path, 6.0, now=t + delay + 1)
    assert nccl_retry_delay_s(8) == NCCL_RETRY_MAX_S
    # A pass resets the count; once stale again it runs at once.
    record_nccl_pass(tmp_path, {"busbw_gbs": 1.0}, now=t + 10)
    assert nccl_attempts(tmp_path)["failures"] == 0  # type: ignore[index]
    assert nccl_is_stale(tmp_path, 6.0, now=t + 10 + 6 * 3600 + 1)
