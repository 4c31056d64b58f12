"""Issue 24: the gpu check's recheck sleep is outside its NVML timeout, and the hooks' worst
case is computed from the site (bluevela/hooks/budget.py) for `bv site validate`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.runner import run_checks
from bluevela.hooks.budget import hook_budget, problems, worst_case_s
from bluevela.site import Site, load_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parent.parent
FIXTURES = materialized()


@pytest.fixture(scope="module")
def site() -> Site:
    return load_site(REPO / "site.yaml")


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
    drain_timeout_s 5 s, one partition, the default 65 s lock wait."""
    b = hook_budget(site, "prolog", lock_wait_s=65.0)
    assert dict(b.terms) == {"start_s": 5.0, "lock_wait_s": 65.0, "run_s": 181.0,
                             "jitter_s": 2.0, "rpc_s": 30.0}
    assert worst_case_s(site, lock_wait_s=65.0) == 283.0
    assert b.text() == ("prolog worst case 283 s = start 5 + lock_wait 65 + run 181 + "
                        "jitter 2 + rpc 30")
    # Two partitions: three more creates, 15 s more.
    assert worst_case_s(site, partitions=2, lock_wait_s=65.0) == 298.0
    assert hook_budget(site, "epilog", lock_wait_s=65.0).total_s == 108.0
    assert hook_budget(site, "healthcheck", lock_wait_s=65.0).terms["lock_wait_s"] == 0.0


def test_problems_against_prolog_epilog_timeout(site: Site) -> None:
    assert problems(site, 300.0, lock_wait_s=65.0) == []
    [line] = problems(site, 250.0, lock_wait_s=65.0)
    assert line.startswith("prolog worst case 283 s") and line.endswith("PrologEpilogTimeout=250")
    assert problems(site, None) == []
    with pytest.raises(ValueError, match="unknown hook phase"):
        hook_budget(site, "nightly")
