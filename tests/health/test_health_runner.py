"""The runner: per-check timeouts, the run's hard cap, crashes, retries, stray processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bluevela.checks_registry import check, unregister
from bluevela.errors import HealthError
from bluevela.health.context import ProbeContext
from bluevela.health.result import CheckResult, Status
from bluevela.health.runner import RunPlan, plan_prolog, plan_tier, run_checks, run_plan
from bluevela.health.state import nccl_is_stale, record_nccl_pass
from bluevela.site import Site

REPO = Path(__file__).resolve().parents[2]
# The runner stops a run at its cap minus a margin of min(0.25 s, 5 % of the cap): 50 ms for
# a 1 s cap. Killing and reaping the children after that point is scheduling work; on the
# 2-core dev machine under a parallel test load it can take longer than those 50 ms, so
# wall-clock bounds are the cap (or timeout) plus this stated tolerance, and a lower bound
# shows the runner did wait for the cap (or timeout) rather than stop early.
LOAD_TOLERANCE_S = 0.5


@pytest.fixture
def ctx(site: Site, tmp_path: Path) -> ProbeContext:
    return ProbeContext(site.node_class(name="cpu"), "cpu", root=tmp_path, state_dir=tmp_path)


@pytest.fixture
def register_tmp() -> Iterator[Callable[..., str]]:
    """Register throw-away checks for one test; all are removed afterwards."""
    names: list[str] = []

    def add(name: str, probe: Callable[[ProbeContext], Any],
            evaluate: Callable[[Any, Any], CheckResult] | None = None, noisy: bool = False) -> str:
        def default(facts: Any, cls: Any) -> CheckResult:
            return CheckResult(name, Status.OK, f"facts={facts}")

        check(name, probe=probe, noisy=noisy)(evaluate or default)
        names.append(name)
        return name

    yield add
    for n in names:
        unregister(n)


def test_hung_check_is_killed_at_its_timeout(ctx: ProbeContext, register_tmp: Callable[..., str]) -> None:
    hung = register_tmp("t_hung", lambda c: time.sleep(60))
    quick = register_tmp("t_quick", lambda c: 1)
    t0 = time.monotonic()
    rep = run_checks([hung, quick], ctx, timeout_s=0.5, cap_s=5.0)
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 0.5 + LOAD_TOLERANCE_S, elapsed
    by = {r.name: r for r in rep.checks}
    assert by[hung].status is Status.UNKNOWN and "timed out after 0.5 s" in by[hung].summary
    assert 0.5 <= by[hung].duration_s < 0.5 + LOAD_TOLERANCE_S, by[hung].duration_s
    assert by[quick].status is Status.OK
    assert rep.status is Status.UNKNOWN and [r.name for r in rep.checks] == [hung, quick]


def test_run_ends_before_its_cap(ctx: ProbeContext, register_tmp: Callable[..., str]) -> None:
    a = register_tmp("t_hang_a", lambda c: time.sleep(60))
    b = register_tmp("t_hang_b", lambda c: time.sleep(60))
    t0 = time.monotonic()
    rep = run_checks([a, b], ctx, timeout_s=30.0, cap_s=1.0)
    elapsed = time.monotonic() - t0
    # Planned end: 1 s - 0.05 s margin; the checks' own 30 s timeouts never come into it.
    assert 0.95 <= elapsed < 1.0 + LOAD_TOLERANCE_S, f"run took {elapsed:.2f} s, cap 1 s"
    assert all(r.status is Status.UNKNOWN and "killed at the run's 1 s cap" in r.summary
               for r in rep.checks), rep.checks
    assert 0.95 <= rep.duration_s < 1.0 + LOAD_TOLERANCE_S, rep.duration_s


def test_hung_checks_children_are_killed_too(ctx: ProbeContext, tmp_path: Path,
                                             register_tmp: Callable[..., str]) -> None:
    pidfile = tmp_path / "grandchild.pid"

    def spawn_and_hang(c: ProbeContext) -> None:
        proc = subprocess.Popen(["sleep", "60"])
        pidfile.write_text(str(proc.pid))
        time.sleep(60)

    name = register_tmp("t_spawner", spawn_and_hang)
    run_checks([name], ctx, timeout_s=1.0, cap_s=5.0)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the hung check's child process survived")


def test_crashing_check_is_unknown(ctx: ProbeContext, register_tmp: Callable[..., str]) -> None:
    def boom(c: ProbeContext) -> None:
        raise RuntimeError("sysfs exploded")

    def bad_eval(facts: Any, cls: Any) -> CheckResult:
        return "not a result"  # type: ignore[return-value]

    crash = register_tmp("t_crash", boom)
    wrong = register_tmp("t_wrong", lambda c: 1, bad_eval)
    dies = register_tmp("t_dies", lambda c: os.kill(os.getpid(), signal.SIGKILL))
    exits = register_tmp("t_exits", lambda c: os._exit(7))
    rep = run_checks([crash, wrong, dies, exits, "no_such_check"], ctx, timeout_s=5, cap_s=10)
    by = {r.name: r for r in rep.checks}
    assert by[crash].status is Status.UNKNOWN
    assert by[crash].summary == "crashed: RuntimeError: sysfs exploded"
    assert "returned str, not CheckResult" in by[wrong].summary
    assert by[dies].summary == f"check process died of signal {int(signal.SIGKILL)}"
    assert by[exits].summary == "check process exited 7 without a result"
    assert by["no_such_check"].status is Status.UNKNOWN
    assert all(r.status is Status.UNKNOWN for r in rep.checks)  # never CRITICAL


def test_noisy_check_passes_if_any_try_passes(ctx: ProbeContext, tmp_path: Path,
                                              register_tmp: Callable[..., str]) -> None:
    tries = tmp_path / "tries"

    def flaky(c: ProbeContext) -> int:
        n = int(tries.read_text()) + 1 if tries.exists() else 1
        tries.write_text(str(n))
        return n

    def ev(n: int, cls: Any) -> CheckResult:
        return CheckResult("t_flaky", Status.OK if n >= 3 else Status.CRITICAL, f"try {n}",
                           {"busbw_gbs": float(n)})

    name = register_tmp("t_flaky", flaky, ev, noisy=True)
    rep = run_checks([name], ctx, timeout_s=5, cap_s=10, retries=3)
    r = rep.checks[0]
    assert r.status is Status.OK and r.summary == "try 3 (try 3/3)"
    assert r.metrics == {"busbw_gbs": 3.0, "tries_count": 3.0}
    tries.unlink()
    rep = run_checks([name], ctx, timeout_s=5, cap_s=10, retries=2)
    assert rep.checks[0].status is Status.CRITICAL and rep.checks[0].metrics["tries_count"] == 2


def test_only_noisy_checks_are_retried(ctx: ProbeContext, tmp_path: Path,
                                       register_tmp: Callable[..., str]) -> None:
    count = tmp_path / "count"

    def once(c: ProbeContext) -> None:
        count.write_text(count.read_text() + "x" if count.exists() else "x")

    name = register_tmp("t_steady", once, lambda f, c: CheckResult("t_steady", Status.CRITICAL, "bad"))
    run_checks([name], ctx, timeout_s=5, cap_s=10, retries=3)
    assert count.read_text() == "x"


def test_plans_come_from_site_tiers(site: Site) -> None:
    quick = plan_tier(site, "quick")
    assert quick.checks == ("gpu", "ib", "node", "versions") and quick.cap_s == 5 and quick.timeout("ib") == 3
    assert quick.retries == site.health.retries
    extra = plan_tier(site, "quick", ["ib", "nccl"])
    assert extra.timeout("nccl") == 120 and extra.cap_s == 180 and extra.timeout("ib") == 3
    with pytest.raises(HealthError, match="no health tier 'nope'"):
        plan_tier(site, "nope")
    assert plan_prolog(site, nccl_stale=False).checks == ("gpu", "ib", "node", "versions")
    stale = plan_prolog(site, nccl_stale=True)
    assert stale.checks == ("gpu", "ib", "node", "versions", "nccl") and stale.tier == "quick+nccl"
    assert stale.timeout("gpu") == 3 and stale.timeout("nccl") == 120


def test_nccl_freshness(tmp_path: Path) -> None:
    now = 1_000_000.0
    assert nccl_is_stale(tmp_path, 6.0, now)  # never passed
    record_nccl_pass(tmp_path, {"busbw_gbs": 1.5}, now=now - 3600)
    assert not nccl_is_stale(tmp_path, 6.0, now)
    assert nccl_is_stale(tmp_path, 0.5, now)
    assert not nccl_is_stale(tmp_path, 0.0, now)  # 0 = never from the prolog
    assert nccl_is_stale(None, 6.0, now)


def test_empty_plan(ctx: ProbeContext) -> None:
    rep = run_plan(RunPlan("none", (), 1.0), ctx)
    assert rep.checks == () and rep.status is Status.OK


def test_could_not_run_is_not_retried(ctx: ProbeContext, tmp_path: Path,
                                      register_tmp: Callable[..., str]) -> None:
    count = tmp_path / "count"

    def once(c: ProbeContext) -> None:
        count.write_text(count.read_text() + "x" if count.exists() else "x")

    name = register_tmp("t_unknown_noisy", once,
                        lambda f, c: CheckResult("t_unknown_noisy", Status.UNKNOWN, "no torch"),
                        noisy=True)
    rep = run_checks([name], ctx, timeout_s=5, cap_s=10, retries=3)
    assert count.read_text() == "x" and rep.checks[0].metrics["tries_count"] == 1


def test_a_check_named_twice_runs_once(ctx: ProbeContext, register_tmp: Callable[..., str]) -> None:
    name = register_tmp("t_twice", lambda c: 2)
    rep = run_checks([name, name], ctx, timeout_s=5, cap_s=10)
    assert [r.name for r in rep.checks] == [name]


def test_on_timeout_gives_the_checks_own_verdict(ctx: ProbeContext) -> None:
    """A check may say what its timeout means (the gpu check: a hung NVML call); the others
    stay UNKNOWN."""
    def verdict(seconds: float, cls: Any) -> CheckResult:
        return CheckResult("t_says", Status.CRITICAL, f"stuck after {seconds:g} s")

    check("t_says", probe=lambda c: time.sleep(60), on_timeout=verdict)(
        lambda facts, cls: CheckResult("t_says", Status.OK, "never"))
    try:
        rep = run_checks(["t_says"], ctx, timeout_s=0.5, cap_s=3.0)
    finally:
        unregister("t_says")
    r = rep.checks[0]
    assert (r.status, r.summary) == (Status.CRITICAL, "stuck after 0.5 s")
    assert 0.4 < r.duration_s < 2.0
