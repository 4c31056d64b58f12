"""Issue 24: the gpu check's recheck sleep is outside its NVML timeout, and the hooks' worst
case is computed from the site (bluevela/hooks/budget.py) for `bv site validate`."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.runner import run_checks
from bluevela.hooks.budget import (
    HEALTHCHECK_KILL_S,
    healthcheck_cap_s,
    hook_budget,
    problems,
    worst_case_s,
)
from bluevela.site import Site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


def test_the_recheck_sleep_is_outside_the_nvml_timeout(site: Site) -> None:
    """A hung NVML call (recorded `hang`) with a 1 s check timeout and `recheck_s` 1 s: the
    check is killed after timeout + recheck (2 s), and says NVML hung for 1 s. On 9058adc it
    was killed at 1 s: the recheck's sleep ate the NVML budget."""
    h100 = site.node_class(name="h100")
    cls = replace(h100, gpu=replace(h100.gpu, recheck_s=1.0))
    fx = FIXTURES / "h100-gpu-nvml-hang"
    ctx = ProbeContext(cls, "h100", root=fx / "root", nvml_snapshot=fx / "nvml.json")
    rep = run_checks(["gpu"], ctx, timeout_s=1.0, cap_s=1.5)
    gpu = rep.checks[0]
    assert gpu.status is Status.CRITICAL and gpu.summary == "NVML timed out after 1 s"
    assert 1.9 <= gpu.duration_s < 2.5, gpu.duration_s


def test_prolog_worst_case_by_hand(site: Site) -> None:
    """The repo's site: quick cap 5 s, full cap 180 s (nccl stale), recheck 1 s,
    drain_timeout_s 5 s, one partition, the default 65 s lock wait, one bounded spool write
    (10 s: archive/spool.py's forked writer; it was not counted before)."""
    b = hook_budget(site, "prolog", lock_wait_s=65.0)
    assert dict(b.terms) == {"start_s": 5.0, "lock_wait_s": 65.0, "run_s": 181.0,
                             "jitter_s": 2.0, "rpc_s": 30.0, "spool_s": 10.0}
    assert worst_case_s(site, lock_wait_s=65.0) == 293.0
    assert b.text() == ("prolog worst case 293 s = start 5 + lock_wait 65 + run 181 + "
                        "jitter 2 + rpc 30 + spool 10")
    # Two partitions: three more creates, 15 s more.
    assert worst_case_s(site, partitions=2, lock_wait_s=65.0) == 308.0
    # The epilog writes twice: the series side file and the report; and it may read Slurm's
    # record of the job once (issue 33: the events' node, a grown node).
    epilog = hook_budget(site, "epilog", lock_wait_s=65.0)
    assert epilog.terms["spool_s"] == 20.0 and epilog.terms["rpc_s"] == 35.0
    assert epilog.total_s == 133.0
    assert hook_budget(site, "healthcheck", lock_wait_s=65.0).terms["lock_wait_s"] == 0.0


def test_the_spool_term_is_the_spools_own_bound(site: Site) -> None:
    """The term follows archive/spool.py's bound: one write for the prolog, two for the epilog,
    none for the healthcheck (no job, no report)."""
    from bluevela.archive import spool

    for phase, writes in (("prolog", 1), ("epilog", 2), ("healthcheck", 0)):
        assert hook_budget(site, phase).terms["spool_s"] == writes * spool.SPOOL_WRITE_TIMEOUT_S


def test_problems_against_prolog_epilog_timeout(site: Site) -> None:
    assert problems(site, 300.0, lock_wait_s=65.0) == []
    [line] = problems(site, 250.0, lock_wait_s=65.0)
    assert line.startswith("prolog worst case 293 s") and line.endswith("PrologEpilogTimeout=250")
    # 283 s fitted 290 before the spool term; 293 does not.
    [line] = problems(site, 290.0, lock_wait_s=65.0)
    assert line.startswith("prolog worst case 293 s")
    assert problems(site, None) == []
    with pytest.raises(ValueError, match="unknown hook phase"):
        hook_budget(site, "nightly")


def _with_drain_timeout(site: Site, seconds: float) -> Site:
    return replace(site, health=replace(site.health, drain_timeout_s=seconds))


def test_the_healthcheck_fits_slurmds_60_s(site: Site) -> None:
    """slurmd kills a HealthCheckProgram at 60 s. Before, the run ended at 55 s and a drain
    after it could take 2 + 30 s more (87 s in all): the run's cap is now what is left of the
    60 s once start-up, the recheck sleep and the longer of a drain and a resume are paid."""
    b = hook_budget(site, "healthcheck")
    assert healthcheck_cap_s(site) == 22.0  # 60 - start 5 - recheck 1 - (jitter 2 + 6 x 5)
    assert dict(b.terms) == {"start_s": 5.0, "lock_wait_s": 0.0, "run_s": 23.0,
                             "jitter_s": 2.0, "rpc_s": 30.0, "spool_s": 0.0}
    assert b.total_s == HEALTHCHECK_KILL_S == 60.0
    assert problems(site, 300.0) == []
    # A faster drain bound leaves the checks more time.
    assert healthcheck_cap_s(_with_drain_timeout(site, 3.0)) == 34.0
    assert healthcheck_cap_s(_with_drain_timeout(site, 0.5)) == 49.0
    # A node in two partitions: three more creates do not fit the 60 s.
    [line] = problems(site, 400.0, partitions=2)
    assert line.startswith("healthcheck worst case 75 s") and "kill at 60 s" in line
    # A drain bound that leaves the checks under 10 s is named too.
    slow = _with_drain_timeout(site, 8.0)
    assert healthcheck_cap_s(slow) == 4.0  # 60 - 5 - 1 - (2 + 6 x 8)
    assert [p.split(":")[0] for p in problems(slow, None)] == ["healthcheck run cap 4 s < 10 s"]


def test_the_healthcheck_run_ends_at_its_cap(site: Site, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """The hook's own run (hooks/phases.py) on a GPU whose NVML hangs: with drain_timeout_s
    7.5 s the cap is 60 - 5 - 1 - (2 + 45) = 7 s, so the hung gpu check (timeout 40 s) is
    killed at the run's cap (the gpu check fails closed: CRITICAL), early enough for a drain to fit the 60 s. Before, the cap was
    55 s whatever the drain cost: the run went on to the check's 40 s timeout."""
    from bluevela.hooks.env import HookContext
    from bluevela.hooks.phases import _run

    tiers = dict(site.health.tiers)
    tiers["full"] = replace(tiers["full"], checks=("gpu",), check_timeout_s=40.0)
    slow = replace(site, health=replace(site.health, drain_timeout_s=7.5, tiers=tiers))
    assert healthcheck_cap_s(slow) == 7.0
    fx = FIXTURES / "h100-gpu-nvml-hang"
    monkeypatch.setenv("BV_SYSFS_ROOT", str(fx / "root"))
    monkeypatch.setenv("BV_NVML_SNAPSHOT", str(fx / "nvml.json"))
    started = time.monotonic()
    report = _run(slow, HookContext("healthcheck", "gpu001"), None, "full")
    took = time.monotonic() - started
    gpu = report.result("gpu")
    assert gpu is not None and gpu.summary.startswith("NVML timed out after 7"), gpu.summary
    assert 6.5 <= took < 10.0, took
