"""What each hook does. Exit codes are what Slurm acts on:

- prolog: quick tier (+ nccl when its last pass is older than `health.nccl_freshness_h`).
  CRITICAL: drain this node `bv: <check>: <detail>`, spool the report, exit 1 (Slurm requeues
  the job). Exit 0 when the fleet breaker held the drain, or when Slurm could not be reached
  before a breaker slot was won (a non-zero exit would make Slurm drain the node itself,
  outside the breaker). WARNING/UNKNOWN: exit 0, recorded.
- epilog: quick tier after the job, with its exit status and per-job telemetry, spooled.
  The sampler's window of the job goes to the spool beside it (bluevela.telemetry.window).
  A node grown into a running job had its prolog under the helper job `bv-grow-JOB`: its
  window and telemetry start where the helper's epilog handed the node over (`_reading`),
  and the attempt it ends is Slurm's word (`_grown_attempt`: no prolog of the job ran there).
  The epilog that holds the goodput events keeps Slurm's record of the job beside them
  (`slurm_job`: its submit time is where the ledger's queue wait starts).
  CRITICAL: drain with the precise reason; always exit 0 (a non-zero exit would drain with
  Slurm's vague "Epilog error").
- healthcheck: full tier on an idle node; drain on CRITICAL; resume a node only when its drain
  reason is ours (`bv:`) and the check it names passes again. Operators' drains are never touched,
  nor nightly drains (the healthcheck does not re-measure what the nightly found).

Drains, resumes and the fleet breaker live in `bluevela.fleet.nodestate` (the checks never import it).

Failing open: an error of the hook itself (bad site.yaml, a bug) logs one line and exits 0 -
a broken installation must not drain the fleet; the checks themselves never raise (a check
that cannot run is UNKNOWN). A package that does not even import is the shims' to catch
(prolog_epilog/prolog: only this module's deliberate exit 1 reaches Slurm).

Every run sends one syslog line (`bluevela.hooks.log`: job, node, verdict, action, time).
Audit mode and the kill switch (`bluevela.fleet.nodestate`, the action gate): nothing is
drained, resumed or held, the line says what would have been; `off` checks nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import BluevelaError
from bluevela.hooks.env import HookContext, fixture_warning, load_hook_env

if TYPE_CHECKING:
    from bluevela.health.result import HealthReport
    from bluevela.site import Site
    from bluevela.slurm.job_record import JobRecord

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class DrainResult:
    attempted: bool = False
    drained: bool = False
    reason: str | None = None
    why_not: str | None = None  # fleet breaker, operator's drain
    error: str | None = None  # the Slurm call failed
    slot_held: bool = False  # a breaker slot was won before the Slurm call failed
    gated: str | None = None  # audit / off: the action gate kept it from draining

    @property
    def breaker(self) -> bool:
        return bool(self.why_not and self.why_not.startswith("fleet breaker"))

    def prolog_exit(self) -> int:
        """1 keeps the job off this node (Slurm drains it "Prolog error" and requeues the job),
        but only where the breaker counts the node: drained, or a slot won before a Slurm call
        failed, or already drained. A drain the breaker held, or one that failed before any
        slot was won (slurmctld unreachable or too slow), exits 0: else every prolog of a
        storm against a slow controller would be drained by Slurm, outside the breaker."""
        if not self.attempted or self.breaker or self.gated:
            return 0
        if self.error is not None and not self.slot_held:
            return 0
        return 1


@dataclass(frozen=True)
class HookOutcome:
    """What a hook did (also written to `<state>/last_run.json`)."""

    phase: str
    node: str
    job_id: int | None
    report: HealthReport
    drain: DrainResult
    resumed: bool = False
    resume_note: str | None = None
    resume_gated: str | None = None  # audit / off: it would have resumed
    spooled: str | None = None
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase, "node": self.node, "job_id": self.job_id,
            "time": time.time(), "health": self.report.to_dict(),
            "drained": self.drain.drained, "drain_reason": self.drain.reason,
            "drain_note": self.drain.why_not or self.drain.error,
            "resumed": self.resumed, "resume_note": self.resume_note,
            "spooled": self.spooled, "exit_code": self.exit_code,
        }


def _setup_logging(phase: str) -> None:
    level_name = os.environ.get("BV_HOOK_LOG_LEVEL", "INFO").upper()
    level = getattr(logging, level_name, logging.INFO)
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO,
                        format=f"bluevela {phase}: %(levelname)s: %(message)s", stream=sys.stderr)


def run_hook(phase: str) -> int:
    """Run one hook; the return value is the exit code Slurm sees. Never raises.
    Leaves exactly one syslog line (`bluevela.hooks.log`)."""
    from bluevela.hooks import log as hooklog

    started = time.monotonic()
    who: dict[str, object] = {"job": os.environ.get("SLURM_JOB_ID"),
                              "node": os.environ.get("SLURMD_NODENAME")}
    try:
        load_hook_env()
        _setup_logging(phase)
        fixtures = fixture_warning()
        if fixtures:
            logger.warning("%s", fixtures)
        hctx = HookContext.from_env(phase)
        who = {"job": hctx.job_id, "node": hctx.node}
        from bluevela.hooks.lock import hook_lock
        from bluevela.site import load_site
        from bluevela.util.actions import local_actions

        site = load_site(cwd=False)  # $BV_SITE (hook.env) or /etc/bluevela: never ./site.yaml
        actions = local_actions(site.health.actions)
        if actions.mode == "off":
            logger.info("actions off (%s): nothing checked", actions.source)
            hooklog.run_line(phase, who, started, "off", detail=f"actions off ({actions.source})")
            return 0
        with hook_lock(site.path("state"), phase, hctx.job_id) as run:
            if not run:  # a healthcheck while another hook runs: skipped (hooks/lock.py)
                hooklog.run_line(phase, who, started, "skipped", detail="another hook runs")
                return 0
            hook = {"prolog": prolog, "epilog": epilog, "healthcheck": healthcheck}[phase]
            outcome = hook(site, hctx)
        hooklog.outcome_line(outcome, started, actions.mode)
        return outcome.exit_code
    except Exception as exc:  # noqa: BLE001 - fail open: see the module docstring
        logging.getLogger(__name__).debug("hook failure", exc_info=True)
        print(f"bluevela {phase}: hook error, nothing checked, exit 0: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        hooklog.run_line(phase, who, started, "hook-error", detail=f"{type(exc).__name__}: {exc}")
        return 0


# -- shared steps -------------------------------------------------------------------------------


def _state_dir(site: Site) -> Path | None:
    from bluevela.health.state import writable_dir

    state = writable_dir(site.path("state"))
    if state is None:
        logger.warning("state dir %s not writable: no baselines, no freshness, no telemetry",
                       site.path("state"))
    return state


def _run(site: Site, hctx: HookContext, state: Path | None, plan_name: str) -> HealthReport:
    from bluevela.health.context import ProbeContext
    from bluevela.health.runner import for_jobs_here, plan_prolog, plan_tier, run_plan
    from bluevela.health.state import nccl_is_stale

    class_name = site.class_name_for(hctx.node)
    cls = site.node_classes[class_name]
    if plan_name == "prolog":
        stale = state is not None and nccl_is_stale(state, site.health.nccl_freshness_h)
        plan = plan_prolog(site, stale)
    else:
        plan = plan_tier(site, plan_name)
    pctx = ProbeContext.from_env(cls, class_name, state_dir=state, phase=hctx.phase)
    if hctx.phase == "healthcheck":  # DCGM diag at health.dcgm.healthcheck_level, if set
        from bluevela.health.dcgm_runs import with_purpose
        from bluevela.hooks.budget import healthcheck_cap_s

        # slurmd kills a HealthCheckProgram at 60 s: the run ends early enough that a drain
        # (or a resume) after it still fits (hooks/budget.py).
        limit = healthcheck_cap_s(site)
        plan, pctx = with_purpose(site, "healthcheck", plan, pctx, limit_s=limit)
        if plan.cap_s > limit:
            plan = replace(plan, cap_s=limit)
    # Never nccl or a DCGM diagnostic on GPUs a running job uses (a healthcheck at a slurmd
    # restart under jobs, another job on a shared node): health/runner.py.
    plan, _ = for_jobs_here(plan, pctx)
    return run_plan(plan, pctx)


def _dcgm_before_resume(site: Site, hctx: HookContext, state: Path | None,
                        started: float) -> tuple[int, str]:
    """The DCGM diag at health.dcgm.before_resume_level, within what is left of the
    healthcheck's 60 s once the resume's own Slurm calls are paid (a longer diag ends
    UNKNOWN: the node stays drained)."""
    from bluevela.health.context import ProbeContext
    from bluevela.health.dcgm_runs import run_diag, timeout_for
    from bluevela.hooks.budget import HEALTHCHECK_KILL_S, START_S, resume_tail_s

    class_name = site.class_name_for(hctx.node)
    pctx = ProbeContext.from_env(site.node_classes[class_name], class_name, state_dir=state,
                                 phase=hctx.phase)
    left = HEALTHCHECK_KILL_S - START_S - (time.monotonic() - started) - resume_tail_s(site)
    result = run_diag(pctx, site.health.dcgm.before_resume_level,
                      max(1.0, min(timeout_for(site, "before_resume"), left)))
    return int(result.status), result.summary


def _record(site: Site, state: Path | None, report: HealthReport, phase: str) -> None:
    """Last results, the Prometheus file, and the nccl freshness mark."""
    if state is None:
        return
    from bluevela.health.metrics import NodeFacts, merge_last_results, write_prom
    from bluevela.health.result import Status
    from bluevela.health.state import record_nccl_pass

    merged = merge_last_results(state, report, phase)
    try:  # the class _run judged against (it raised already if there is none)
        name = site.class_name_for(os.environ.get("SLURMD_NODENAME") or None)
        facts: NodeFacts | None = NodeFacts(name, site.node_classes[name].gpus)
    except BluevelaError:
        facts = None
    write_prom(site.path("metrics"), merged, facts)
    nccl = report.result("nccl")
    # A pass on the job's GPUs only (subset_gpus_count) does not make the node's nccl fresh.
    if nccl is not None and nccl.status is Status.OK and "subset_gpus_count" not in nccl.metrics:
        record_nccl_pass(state, nccl.metrics)


def _drain_if_critical(site: Site, node: str, report: HealthReport) -> DrainResult:
    detail = report.drain_detail()
    if detail is None:
        return DrainResult()
    from bluevela.fleet.nodestate import HOOK_JITTER_S, drain_node, hook_client, make_reason

    reason = make_reason(site, detail)
    try:
        # Every node of a big job runs its prolog at the same moment: the jitter spreads
        # their calls to slurmctld, and the breaker's slots hold whatever the timing.
        out = drain_node(hook_client(site), site, node, detail, jitter_s=HOOK_JITTER_S)
    except BluevelaError as exc:
        held = bool(getattr(exc, "slots", ()))
        logger.error("could not drain %s (%s): %s%s", node, reason, exc,
                     "" if held else "; no breaker slot was won: not counted, the job may "
                     "start here (the epilog and healthcheck check again)")
        return DrainResult(True, False, reason, error=str(exc), slot_held=held)
    if out.gated:
        logger.warning("%s: %s", node, out.why_not)
    elif not out.drained:
        logger.error("NOT drained %s (%s): %s", node, reason, out.why_not)
    return DrainResult(True, out.drained, out.reason, out.why_not, gated=out.gated)


def _spool(site: Site, hctx: HookContext, report: HealthReport, drain: DrainResult,
           telemetry: dict[str, float], restart: int | None = None,
           extra: dict[str, Any] | None = None) -> str | None:
    if hctx.job_id is None:
        return None
    from bluevela.archive.spool import SPOOL_WRITE_TIMEOUT_S, write_report

    body = {
        "phase": hctx.phase, "job_id": hctx.job_id, "node": hctx.node,
        "restart": hctx.restart_count if restart is None else restart, "user": hctx.user,
        "partition": hctx.partition, "num_nodes": hctx.num_nodes,
        # Slurm's own compressed expression (`gpu[001-128]`): a 10,000-node job's reports
        # stay small (the expanded list in every report made ~2 GB of spool).
        "nodelist": hctx.nodelist_expr, "time": time.time(),
        "exit_code": hctx.exit_code, "exit_signal": hctx.exit_signal,
        "derived_exit_code": hctx.derived_exit_code,
        "health": report.to_dict(), "telemetry": telemetry,
        "drained": drain.drained, "drain_reason": drain.reason if drain.attempted else None,
        **(extra or {}),
    }
    try:
        # Bounded: a hung spool (NFS server gone) must not hold the hook to PrologEpilogTimeout.
        return str(write_report(site.path("spool"), body, timeout_s=SPOOL_WRITE_TIMEOUT_S))
    except (OSError, BluevelaError) as exc:
        logger.error("could not spool the %s report of job %s: %s", hctx.phase, hctx.job_id, exc)
        return None


def _finish(state: Path | None, outcome: HookOutcome) -> HookOutcome:
    from bluevela.health.state import LAST_RUN, write_json

    if state is not None:
        write_json(state / LAST_RUN, outcome.to_dict())
    r = outcome.report
    what = f"job {outcome.job_id} " if outcome.job_id is not None else ""
    detail = r.drain_detail() or "; ".join(f"{c.name} {c.status.name}" for c in r.checks)
    action = ""
    if outcome.drain.drained:
        action = "drained"
    elif outcome.drain.attempted:
        action = f"not drained ({outcome.drain.why_not or outcome.drain.error})"
    elif outcome.resumed:
        action = "resumed"
    line = f"{what}on {outcome.node}: {r.status.name} in {r.duration_s:.2f} s: {detail}"
    logger.log(logging.WARNING if r.status.severity >= 2 else logging.INFO,
               "%s%s; exit %d", line, f"; {action}" if action else "", outcome.exit_code)
    return outcome


# -- the hooks ----------------------------------------------------------------------------------


def prolog(site: Site, hctx: HookContext) -> HookOutcome:
    from bluevela.health.state import save_job_reading
    from bluevela.hooks.telemetry import reading_of

    state = _state_dir(site)
    report = _run(site, hctx, state, "prolog")
    _record(site, state, report, "prolog")
    if state is not None and hctx.job_id is not None:
        reading = reading_of(report, time.time())
        reading["restart"] = hctx.restart_count  # this attempt, for its epilog (_attempt)
        save_job_reading(state, hctx.job_id, reading)
    drain = _drain_if_critical(site, hctx.node, report)
    if hctx.job_id is not None:  # the user's goodput events directory, in a per-user layout
        from bluevela.goodput.events_dir import prepare_for_prolog

        prepare_for_prolog()
    spooled = _spool(site, hctx, report, drain, {})
    code = drain.prolog_exit()
    return _finish(state, HookOutcome("prolog", hctx.node, hctx.job_id, report, drain,
                                      spooled=spooled, exit_code=code))


def epilog(site: Site, hctx: HookContext) -> HookOutcome:
    from bluevela.hooks.telemetry import job_telemetry

    started = time.time()  # a helper's epilog: when its node joined the job (_reading)
    state = _state_dir(site)
    report = _run(site, hctx, state, "quick")
    _record(site, state, report, "epilog")
    reading = _reading(state, hctx, started, report)
    slurm = _grown_attempt(site, hctx, reading)
    attempt = _attempt(hctx, reading)
    telemetry = job_telemetry(reading, report, time.time())
    if hctx.job_id is not None:  # the sampler's window of this job, before the report
        from bluevela.telemetry.window import spool_series

        spool_series(site, hctx.job_id, hctx.node, reading, restart=attempt)
    drain = _drain_if_critical(site, hctx.node, report)
    extra: dict[str, Any] = {}
    events = None
    if hctx.job_id is not None:  # the supervisor's goodput events, when it ran on this node
        from bluevela.goodput.events_epilog import collect_for_epilog

        events = collect_for_epilog(hctx.job_id, attempt, hctx.node)
        if events is not None:
            extra["goodput_events"] = events.record
            # Slurm's submit time beside the owner's record: the ledger's queue wait starts
            # there, never at the record's own `submit` (docs/archive.md, `slurm_job`).
            slurm = slurm or _slurm_record(site, hctx.job_id)
    if slurm is not None:
        extra["slurm_job"] = slurm.to_report()
    spooled = _spool(site, hctx, report, drain, telemetry, attempt, extra)
    if events is not None and spooled is not None:  # removed only once they are spooled
        events.remove()
    if hctx.job_id is not None:  # what the job left on the node-local checkpoint tier
        from bluevela.ckpt.epilog import clear_for_epilog

        clear_for_epilog(site, hctx.job_id, hctx.node)
    return _finish(state, HookOutcome("epilog", hctx.node, hctx.job_id, report, drain,
                                      spooled=spooled, exit_code=0))


def _reading(state: Path | None, hctx: HookContext, started: float,
             report: HealthReport) -> dict[str, Any] | None:
    """The prolog's reading of this job here, removed; else, on a node grown into the job (its
    prolog ran under the helper job `bv-grow-JOB`), the start and metrics the helper's epilog
    handed over (`health.state.take_over`: same user, a later job). Either way this epilog
    then hands its own start and its checks' metrics over to the next (`hand_over`)."""
    from bluevela.health.state import hand_over, pop_job_reading, take_over
    from bluevela.hooks.telemetry import reading_of

    if state is None or hctx.job_id is None:
        return None
    reading = pop_job_reading(state, hctx.job_id)
    if reading is None:
        reading = take_over(state, hctx.job_id, hctx.user)
        if reading is not None:
            logger.info("job %s: no prolog reading here; the node joined from job %s at %.3f "
                        "(grown): its window starts there", hctx.job_id,
                        reading["grown_via_job"], reading["time"])
    hand_over(state, hctx.job_id, hctx.user, started, reading_of(report, started)["metrics"])
    return reading


def _slurm_record(site: Site, job_id: int) -> JobRecord | None:
    """Slurm's record of the job (bluevela/slurm/job_record.py): one squeue, bounded by
    `health.drain_timeout_s` (hooks/budget.py counts it in the epilog's worst case)."""
    from bluevela.slurm import job_record

    return job_record.read(job_id, site.health.drain_timeout_s)


def _grown_attempt(site: Site, hctx: HookContext, reading: dict[str, Any] | None
                   ) -> JobRecord | None:
    """On a node grown into the job (its reading taken over from the helper's epilog), the
    attempt it served, put in the reading as a prolog's would be: no prolog of the job ran
    here to say it, and a requeue has already moved SLURM_JOB_RESTART_COUNT on. Slurm's
    record says it: its restart count, less one when it requeued the job (no end time while
    the epilogs run). Slurm's record, or None when no node was grown in here or Slurm did not
    answer (then the environment's count is used, as before, with a warning)."""
    if reading is None or "grown_via_job" not in reading or hctx.job_id is None:
        return None
    slurm = _slurm_record(site, hctx.job_id)
    if slurm is None:
        logger.warning("job %s: grown node, Slurm not answered: its epilog is filed under "
                       "restart %d (SLURM_JOB_RESTART_COUNT; the next attempt's if Slurm "
                       "requeued the job)", hctx.job_id, hctx.restart_count)
        return None
    reading["restart"] = slurm.ended_attempt(hctx.restart_count)
    return slurm


def _attempt(hctx: HookContext, reading: dict[str, Any] | None) -> int:
    """The attempt an epilog ends: its prolog's restart count on this node (on a grown node,
    Slurm's word: `_grown_attempt`). Slurm counts a requeue before the ended attempt's epilog
    runs, so SLURM_JOB_RESTART_COUNT there is the next attempt's (seen on 22.05); it is used
    only when neither left a reading."""
    k = reading.get("restart") if reading else None
    if isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= hctx.restart_count:
        return k
    return hctx.restart_count


def healthcheck(site: Site, hctx: HookContext) -> HookOutcome:
    from bluevela.fleet.nodestate import hook_client, resume_if_passing

    started = time.monotonic()
    state = _state_dir(site)
    report = _run(site, hctx, state, "full")
    _record(site, state, report, "healthcheck")
    drain = _drain_if_critical(site, hctx.node, report)
    resumed, note, gated = False, None, None
    if not drain.attempted:
        try:
            # Resumes only our drains whose named check passes again (never a nightly's or
            # an operator's), and frees the breaker slot(s) of the node.
            check = resume_if_passing(hook_client(site), site, hctx.node,
                                      {c.name: int(c.status) for c in report.checks},
                                      lambda: _dcgm_before_resume(site, hctx, state, started))
            resumed, note, gated = check.resumed, check.note, check.gated
        except BluevelaError as exc:
            note = f"could not query/resume: {exc}"
            logger.error("%s", note)
    return _finish(state, HookOutcome("healthcheck", hctx.node, None, report, drain,
                                      resumed=resumed, resume_note=note, resume_gated=gated,
                                      exit_code=0))
