"""Where the DCGM diagnostic runs (the site's `health.dcgm`, by purpose) and one diagnostic
run alone in the runner's killable child.

Beside the runner, not in the check (bluevela/health/checks/dcgm.py): the check is one of the
checks the runner runs, so a check that called the runner would import it back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from bluevela.health.context import ProbeContext
    from bluevela.health.result import CheckResult
    from bluevela.health.runner import RunPlan
    from bluevela.site import Site

Purpose = Literal["healthcheck", "before_resume", "nightly"]


def level_for(site: Site, purpose: Purpose) -> int:
    """The `dcgmi diag` level the site runs for `purpose` (0: not run)."""
    return int(getattr(site.health.dcgm, f"{purpose}_level"))


def timeout_for(site: Site, purpose: Purpose) -> float:
    return float(getattr(site.health.dcgm, f"{purpose}_timeout_s"))


def with_level(ctx: ProbeContext, level: int) -> ProbeContext:
    """`ctx` whose dcgm probe runs `dcgmi diag -r level`."""
    cls = ctx.node_class
    return replace(ctx, node_class=replace(cls, node=replace(cls.node, dcgm_level=level)))


def with_purpose(site: Site, purpose: Purpose, plan: RunPlan, ctx: ProbeContext, *,
                 limit_s: float | None = None) -> tuple[RunPlan, ProbeContext]:
    """`plan` plus the dcgm check at the site's level for `purpose`, bounded by its timeout
    (and by `limit_s`, the caller's own bound), with a context that asks for that level.
    Unchanged when the site does not run DCGM for `purpose`."""
    level = level_for(site, purpose)
    if not level:
        return plan, ctx
    timeout = timeout_for(site, purpose)
    if limit_s is not None:
        timeout = max(1.0, min(timeout, limit_s - 1.0))
    checks = plan.checks if "dcgm" in plan.checks else (*plan.checks, "dcgm")
    plan = replace(plan, tier=plan.tier if "dcgm" in plan.checks else f"{plan.tier}+dcgm",
                   checks=checks, cap_s=max(plan.cap_s, timeout + 1.0),
                   timeouts={**plan.timeouts, "dcgm": timeout})
    return plan, with_level(ctx, level)


def run_diag(ctx: ProbeContext, level: int, timeout_s: float) -> CheckResult:
    """Only the dcgm check at `level`, in the runner's killable child, bounded by `timeout_s`."""
    from bluevela.health.runner import run_checks

    report = run_checks(["dcgm"], with_level(ctx, level), timeout_s=timeout_s,
                        cap_s=timeout_s + 1.0, tier=f"dcgm-r{level}")
    result = report.result("dcgm")
    assert result is not None
    return result
