"""Run checks, each in its own forked child process, bounded in time.

Every check runs in a child (`os.fork`) in its own process group; the checks of a run go in
parallel. A check gets its own timeout and the whole run ends before the tier's hard cap: at
its deadline a check's whole process group is SIGKILLed (threads cannot be killed; a child can)
and the check is reported UNKNOWN, unless the check says what a timeout means (`on_timeout`:
the gpu check only reads NVML, so on a class with GPUs a timeout is a hung NVML call, CRITICAL).
A check that raises, or whose child dies, is UNKNOWN too:
could-not-run is never CRITICAL. A noisy check (bandwidth) is tried up to `retries` times in its
child while it is CRITICAL, and passes if any try passes (OK or WARNING).
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.checks_registry import Check
from bluevela.errors import HealthError
from bluevela.health.checks import all_checks
from bluevela.health.context import ProbeContext
from bluevela.health.result import CheckResult, HealthReport, Status

if TYPE_CHECKING:
    from bluevela.site import Site

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class RunPlan:
    """Which checks to run, and their time bounds.

    Attributes:
        tier: a label for reports ("quick", "full", "quick+nccl", "custom").
        checks: check names, in report order.
        cap_s: hard cap on the whole run.
        timeouts: each check's own timeout.
        retries: tries of a noisy check.
    """

    tier: str
    checks: tuple[str, ...]
    cap_s: float
    timeouts: Mapping[str, float] = field(default_factory=dict)
    retries: int = 1

    def timeout(self, name: str) -> float:
        return self.timeouts.get(name, self.cap_s)


def plan_tier(site: Site, tier: str, only: Sequence[str] | None = None) -> RunPlan:
    """The plan of a site tier, optionally restricted to (or extended by) `only` checks.

    Raises:
        HealthError: unknown tier.
    """
    tiers = site.health.tiers
    if tier not in tiers:
        raise HealthError(f"no health tier {tier!r} in site.yaml (known: {', '.join(sorted(tiers))})")
    t = tiers[tier]
    names = tuple(only) if only else tuple(t.checks)
    label = tier if not only else "custom"
    # A check outside this tier (e.g. `--check nccl` with the quick tier) keeps its full-tier
    # bounds: its own timeout and the cap grow to allow it.
    timeouts = {n: t.check_timeout_s for n in names}
    cap = t.cap_s
    full = tiers.get("full")
    if full is not None:
        for n in names:
            if n not in t.checks and n in full.checks:
                timeouts[n] = max(timeouts[n], full.check_timeout_s)
                cap = max(cap, full.cap_s)
    return RunPlan(label, names, cap, timeouts, site.health.retries)


def plan_prolog(site: Site, nccl_stale: bool) -> RunPlan:
    """The quick tier, plus nccl (with the full tier's bounds) when its last pass is stale."""
    quick = site.health.tiers["quick"]
    plan = plan_tier(site, "quick")
    if not nccl_stale or "nccl" in plan.checks:
        return plan
    full = site.health.tiers["full"]
    timeouts = {**plan.timeouts, "nccl": full.check_timeout_s}
    cap = max(quick.cap_s, full.cap_s)
    return RunPlan("quick+nccl", (*plan.checks, "nccl"), cap, timeouts, plan.retries)


# Checks that take the node's GPUs (or CPUs) for seconds to minutes.
INTRUSIVE = ("nccl", "dcgm")


def for_jobs_here(plan: RunPlan, ctx: ProbeContext) -> tuple[RunPlan, str | None]:
    """The plan without the intrusive checks (nccl, the DCGM diagnostic) where they would run
    on GPUs (or CPUs) in use by a running job; (plan, what was left out and why, or None).

    nccl takes the node's GPUs (gloo: its CPUs) for seconds to a minute, a DCGM diagnostic
    longer: next to a running job they would disturb it and measure hardware the job shares
    (a false CRITICAL). So the healthcheck (which slurmd also runs at every start, jobs or
    not) leaves them out while any job runs here; a prolog or epilog leaves them out while
    another job runs here, except nccl when its own job was given GPUs (`SLURM_JOB_GPUS`):
    then nccl runs on those only (checks/nccl.py). Without the job's GPUs (none given, or a
    site without GPU gres) the GPUs in use cannot be told apart. Running jobs are read from
    `<root>/proc` (health/jobprocs.py).
    """
    drop = [n for n in INTRUSIVE if n in plan.checks]
    if not drop or ctx.phase not in ("healthcheck", "prolog", "epilog"):
        return plan, None
    from bluevela.health.jobprocs import running_jobs

    others = running_jobs(ctx.under_root("/")).others(ctx.job_id)
    if not others:
        return plan, None
    if ctx.phase in ("prolog", "epilog") and ctx.job_gpus:
        drop = [n for n in drop if n != "nccl"]
    if not drop:
        return plan, None
    shown = ", ".join(str(j) for j in sorted(others)[:4]) + (", ..." if len(others) > 4 else "")
    why = f"{' and '.join(drop)} not run: job(s) {shown} running on this node"
    logger.info("%s", why)
    return replace(plan, checks=tuple(n for n in plan.checks if n not in drop),
                   timeouts={n: t for n, t in plan.timeouts.items() if n not in drop}), why


# -- the child's side ---------------------------------------------------------------------------


def run_check_tries(chk: Check, ctx: ProbeContext, retries: int) -> CheckResult:
    """Probe + evaluate; a noisy check is tried again (up to `retries` tries in all) while it
    is CRITICAL. Exceptions become UNKNOWN."""
    tries = max(1, retries) if chk.noisy else 1
    result: CheckResult | None = None
    attempt = 0
    while attempt < tries:
        attempt += 1
        try:
            got = chk.run_once(ctx)
            if not isinstance(got, CheckResult):
                raise TypeError(f"evaluator returned {type(got).__name__}, not CheckResult")
            result = got
        except Exception as exc:  # noqa: BLE001 - a crashing check is UNKNOWN, not a crash
            logger.debug("check %s crashed", chk.name, exc_info=True)
            result = CheckResult(chk.name, Status.UNKNOWN, f"crashed: {type(exc).__name__}: {exc}")
        # Only a measurement that failed its threshold is worth another try; an UNKNOWN
        # (no torch, a single rank, no device) would fail the same way again.
        if result.status is not Status.CRITICAL:
            break
    assert result is not None
    if result.name != chk.name:
        result = CheckResult(chk.name, result.status, result.summary, result.metrics)
    if chk.noisy:
        summary = result.summary if attempt == 1 else f"{result.summary} (try {attempt}/{tries})"
        result = CheckResult(chk.name, result.status, summary,
                             {**result.metrics, "tries_count": attempt})
    return result


def _child(chk: Check, ctx: ProbeContext, retries: int, wfd: int) -> None:
    """Runs in the forked child: never returns."""
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        result = run_check_tries(chk, ctx, retries)
        payload = json.dumps(result.to_dict(components=True)).encode()
    except BaseException as exc:  # noqa: BLE001 - report anything, then _exit
        payload = json.dumps(CheckResult(chk.name, Status.UNKNOWN,
                                         f"crashed: {type(exc).__name__}: {exc}").to_dict()).encode()
        code = 1
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(wfd, view):]
    except OSError:
        code = 2
    finally:
        os._exit(code)


# -- the parent's side --------------------------------------------------------------------------


@dataclass
class _Child:
    name: str
    pid: int
    fd: int
    started: float
    deadline: float
    capped: bool  # the deadline is the run's cap, not the check's own timeout
    buf: bytearray = field(default_factory=bytearray)


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
            return
        except ProcessLookupError:
            continue
        except PermissionError:
            continue


def _reap(ch: _Child, settle_s: float = 1.0, kill_wait_s: float = 0.05) -> int | None:
    """Wait up to `settle_s` for the child to exit, SIGKILL its group (strays included), reap.

    Never blocks for long: a child stuck in the kernel (a hung driver call, state D) ignores
    SIGKILL until the call returns; it is then left for init to reap and None is returned.
    """
    end = time.monotonic() + settle_s
    while True:
        try:
            if os.waitid(os.P_PID, ch.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
        except ChildProcessError:
            return None
        if time.monotonic() >= end:
            break
        time.sleep(0.001)
    # The group exists while its leader is an unreaped zombie: signalling it is safe.
    _kill_group(ch.pid)
    end = time.monotonic() + kill_wait_s
    while True:
        try:
            pid, status = os.waitpid(ch.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid:
            return status
        if time.monotonic() >= end:
            logger.warning("check %s (pid %d) did not die after SIGKILL; left behind",
                           ch.name, ch.pid)
            return None
        time.sleep(0.001)


def _parse(ch: _Child, status: int | None) -> CheckResult:
    try:
        data = json.loads(bytes(ch.buf).decode())
        return CheckResult.from_dict(data)
    except (ValueError, KeyError, TypeError):
        pass
    if status is None:
        return CheckResult(ch.name, Status.UNKNOWN, "check process gave no result")
    if os.WIFSIGNALED(status):
        return CheckResult(ch.name, Status.UNKNOWN,
                           f"check process died of signal {os.WTERMSIG(status)}")
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return CheckResult(ch.name, Status.UNKNOWN, f"check process exited {code} without a result")


def _timed_out(chk: Check | None, ctx: ProbeContext, why: str, bound_s: float,
               waited_s: float) -> CheckResult:
    """The verdict on a check killed at its deadline: the check's own `on_timeout`, else
    UNKNOWN (could not run)."""
    name = chk.name if chk is not None else "?"
    if chk is not None and chk.on_timeout is not None:
        try:
            result = chk.on_timeout(bound_s, ctx.node_class)
            return CheckResult(name, result.status, result.summary, result.metrics, waited_s)
        except Exception:  # noqa: BLE001 - a broken verdict must not break the run
            logger.warning("on_timeout of check %s failed", name, exc_info=True)
    return CheckResult(name, Status.UNKNOWN, why, duration_s=waited_s)


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Slurm kills a hook that overruns PrologEpilogTimeout: take the checks down with us."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def deliberate_sleep_s(name: str, ctx: ProbeContext) -> float:
    """The seconds a check sleeps on purpose, given on top of its own timeout (and of the
    run's cap): the gpu check's second reading `gpu.recheck_s` later. Its timeout then bounds
    the NVML calls alone (a hung call is what the gpu check's timeout verdict names), not
    NVML plus the wait (with the wait inside, 3 s of budget left 2 s for two readings of 8
    GPUs)."""
    if name == "gpu" and (ctx.node_class.gpus > 0 or ctx.nvml_snapshot is not None):
        return float(ctx.node_class.gpu.recheck_s)
    return 0.0


def run_plan(plan: RunPlan, ctx: ProbeContext) -> HealthReport:
    """Run the plan's checks in parallel child processes; every result comes back in order."""
    started_at = time.time()
    start = time.monotonic()
    margin = min(0.25, plan.cap_s * 0.05)
    sleeps = {n: deliberate_sleep_s(n, ctx) for n in plan.checks}
    hard_end = start + plan.cap_s + max(sleeps.values(), default=0.0) - margin
    registry = all_checks()
    if ctx.runner_pid is None:  # the checks' children (and theirs) are this run's own
        ctx = replace(ctx, runner_pid=os.getpid())
    results: dict[str, CheckResult] = {}
    children: list[_Child] = []
    sel = selectors.DefaultSelector()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with _sigterm_raises():
            for name in dict.fromkeys(plan.checks):  # each check once, in order
                chk = registry.get(name)
                if chk is None:
                    results[name] = CheckResult(name, Status.UNKNOWN, f"no such check {name!r}")
                    continue
                ch = _start(chk, name, plan, ctx, sleeps.get(name, 0.0), hard_end)
                children.append(ch)
                sel.register(ch.fd, selectors.EVENT_READ, ch)
            _collect(plan, ctx, registry, children, sel, results)
    finally:
        _close(children, results, sel)
    ordered = tuple(results[n] for n in dict.fromkeys(plan.checks) if n in results)
    return HealthReport(plan.tier, ordered, time.monotonic() - start, started_at)


def _start(chk: Check, name: str, plan: RunPlan, ctx: ProbeContext, sleep_s: float,
           hard_end: float) -> _Child:
    """Fork the check's child in its own process group, its result coming back on a pipe;
    its deadline is its own timeout (plus its deliberate sleep) or the run's cap."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        _child(chk, ctx, plan.retries, wfd)
    os.close(wfd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # already did it itself, or already gone
    now = time.monotonic()
    own = now + plan.timeout(name) + sleep_s
    return _Child(name, pid, rfd, now, min(own, hard_end), own > hard_end)


def _collect(plan: RunPlan, ctx: ProbeContext, registry: Mapping[str, Check],
             children: list[_Child], sel: selectors.BaseSelector,
             results: dict[str, CheckResult]) -> None:
    """Read every child's result until its pipe closes; one past its deadline is killed
    and given its timed-out result."""
    pending = list(children)
    while pending:
        _kill_overdue(plan, ctx, registry, pending, sel, results)
        if not pending:
            break
        wait = max(0.0, min(c.deadline for c in pending) - time.monotonic())
        for key, _ in sel.select(timeout=wait):
            ch = key.data
            chunk = os.read(ch.fd, 1 << 16)
            if chunk:
                ch.buf += chunk
                continue
            pending.remove(ch)
            sel.unregister(ch.fd)
            status = _reap(ch, settle_s=min(1.0, max(0.0, ch.deadline - time.monotonic())))
            results[ch.name] = _parse(ch, status).with_duration(time.monotonic() - ch.started)


def _kill_overdue(plan: RunPlan, ctx: ProbeContext, registry: Mapping[str, Check],
                  pending: list[_Child], sel: selectors.BaseSelector,
                  results: dict[str, CheckResult]) -> None:
    """Kill each pending child past its deadline and record why (its timeout, or the cap)."""
    now = time.monotonic()
    for ch in [c for c in pending if now >= c.deadline]:
        pending.remove(ch)
        sel.unregister(ch.fd)
        _reap(ch, settle_s=0)
        waited = now - ch.started
        why = (f"killed at the run's {plan.cap_s:g} s cap" if ch.capped
               else f"timed out after {plan.timeout(ch.name):g} s, killed")
        results[ch.name] = _timed_out(registry.get(ch.name), ctx, why,
                                      round(waited, 1) if ch.capped
                                      else plan.timeout(ch.name), waited)
        logger.warning("check %s %s", ch.name, why)


def _close(children: list[_Child], results: Mapping[str, CheckResult],
           sel: selectors.BaseSelector) -> None:
    """Close every child's pipe; a child without a result (the run interrupted) is killed."""
    for ch in children:
        try:
            os.close(ch.fd)
        except OSError:
            pass
        if ch.name not in results:  # interrupted: take the check down with us
            _reap(ch, settle_s=0)
    sel.close()


def run_checks(
    names: Sequence[str],
    ctx: ProbeContext,
    *,
    timeout_s: float,
    cap_s: float,
    retries: int = 1,
    tier: str = "custom",
) -> HealthReport:
    """Run `names` with one timeout for each check and a cap on the run (for tests and tools)."""
    plan = RunPlan(tier, tuple(names), cap_s, {n: timeout_s for n in names}, retries)
    return run_plan(plan, ctx)


def default_state_dir(site: Site) -> Path | None:
    """The site's state dir when it exists and we may write there (root on a node), else None.

    Not created here: a manual run on a login node must not leave directories behind.
    """
    from bluevela.health.state import writable_dir

    return writable_dir(site.path("state"), create=False)
