"""The goodput ledger of one job: where its wall time (and GPU hours) went, by phase and cause
(`bv archive show JOB --goodput`; docs/resilience.md "The goodput ledger").

Input: the supervisor's events of each Slurm attempt (bluevela/launch/events.py), which the
epilog of the supervisor's node put in its report (`goodput_events`), and the archive's
prolog/epilog times of each attempt for attempts without events. Pure logic over those
(`build_ledger`), unit-tested with hand-computed numbers; `job_goodput` reads the archive.

The time line, from submission to the end of the last step, is cut at the events into
consecutive pieces, each given one phase, so the phases add up to the wall time exactly:

- queue: submission -> the first start; requeue hold: the requeue -> the next start
  (Slurm's `cred_expire` hold plus any queue wait);
- start-up: an allocation's start -> its first launch (prolog, supervisor) and a launch ->
  its first progress (srun, torchrun rendezvous, imports, loading the checkpoint);
- productive: first progress -> the end of the last checkpoint before the interruption,
  less the checkpoint saves in it (for a clean exit: up to the exit);
- checkpoint: each save's start -> end;
- re-done: the last checkpoint's end (else the first progress) -> the failure: progress
  that is lost and has to be made again (none when a checkpoint was saved on the signal);
- detection: the failure -> the supervisor acting on it;
- teardown + relaunch: acting -> the next launch in the same allocation, or -> the requeue;
- unattributed: whatever no event explains (an attempt whose supervisor's node died with
  its events, clock disorder).

Beside the phases, which are the training nodes' time, the ledger counts the hot spares'
(`idle_spare`): each launch's spare count (the allocation's nodes that are neither training
nor excluded) over every piece of the time line that launch owns, except the queue and the
requeue hold (no node is allocated then). The node-hours of the phases plus the idle spares'
are what the ledger accounts for; less the queue's they are the allocation's node-hours
(training nodes + spares, over the time the job held them).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PHASES = ("productive", "redone", "checkpoint", "detection", "teardown_relaunch", "startup",
          "queue_hold", "unattributed")
PHASE_LABELS = {
    "productive": "productive", "redone": "re-done work", "checkpoint": "checkpoint saving",
    "detection": "detection", "teardown_relaunch": "teardown + relaunch",
    "startup": "start-up to first step", "queue_hold": "queue wait + requeue hold",
    "unattributed": "unattributed",
}
IDLE_SPARE = "idle_spare"  # the spares' line beside the phases (never one of PHASES)
IDLE_SPARE_LABEL = "idle spare"
TIME_LIMIT_WINDOW_S = 300.0  # a SIGUSR1 this close to the limit is the time limit's signal
# The events are the job owner's own words: every record is clamped to what the archive
# (root's hooks) saw of the job before it is used (`bound_record`). The slack covers the
# prolog's run before its report's time stamp and the epilog's after the job, and clock skew.
CLOCK_SLACK_S = 120.0
# The one time the archive cannot check: the submission. The queue wait a record claims is
# at most this long before the attempt's first prolog.
MAX_QUEUE_S = 7 * 86400.0
_HANG_NODE = re.compile(r"^hang: rank [0-9]+ on (\S+)")


@dataclass(frozen=True)
class Allocation:
    """What root's hooks reported of a job (never the job's owner): Slurm's node count, the
    node names of its reports and nodelists, and its first prolog / last epilog times."""

    num_nodes: int
    nodes: frozenset[str]
    start: float | None
    end: float | None


def bound_record(rec: dict[str, Any], alloc: Allocation, lo: float | None, hi: float | None
                 ) -> tuple[dict[str, Any], list[str]]:
    """A validated record clamped to the job's allocation: every time within the attempt's
    first prolog (`lo`) and last epilog (`hi`) +- CLOCK_SLACK_S (the submission at most
    MAX_QUEUE_S before), node counts at most Slurm's, node names only the job's (a cause may
    name no other node), spares at most Slurm's count less the training nodes. Returns the clamped copy and a note per change.

    Raises:
        ValueError: the archive has no time of the attempt to hold the record to.
    """
    lo = lo if lo is not None else alloc.start
    hi = hi if hi is not None else alloc.end
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"restart {rec['restart']}: no prolog/epilog time in the archive to "
                         "check its goodput events against")
    lo, hi = min(lo, hi) - CLOCK_SLACK_S, max(lo, hi) + CLOCK_SLACK_S
    notes: list[str] = []
    changed: set[str] = set()

    def t(value: float | None, what: str, low: float = lo) -> float | None:
        if value is None:
            return None
        out = min(max(value, low), hi)
        if out != value:
            changed.add(what)
        return out

    def names(values: list[str], what: str) -> list[str]:
        kept = [n for n in values if n in alloc.nodes] if alloc.nodes else list(values)
        if len(kept) != len(values):
            changed.add(what)
        return kept

    cap = max(alloc.num_nodes, len(alloc.nodes), 1)
    out = dict(rec)
    out["opened"] = t(rec["opened"], "times")
    out["requeue"] = t(rec["requeue"], "times")
    if rec.get("gone") is not None:
        out["gone"] = t(rec["gone"], "times")
    slurm = dict(rec["slurm"])
    slurm["start"] = t(slurm["start"], "times")
    slurm["submit"] = t(slurm["submit"], "submit time", lo - MAX_QUEUE_S)
    if slurm["submit"] is not None:
        slurm["submit"] = min(slurm["submit"], hi)
    out["slurm"] = slurm
    launches = []
    for la in rec["launches"]:
        la = dict(la)
        la["start"] = t(la["start"], "times")
        la["first_progress"] = t(la["first_progress"], "times")
        if la["n_nodes"] > cap:
            changed.add("node count")
        la["n_nodes"] = min(la["n_nodes"], cap)
        spares = min(la["spares"], max(0, cap - la["n_nodes"]))  # spares + training <= Slurm's
        if spares != la["spares"]:
            changed.add("spare count")
        la["spares"] = spares
        la["nodes"] = names(la["nodes"], "node names")
        la["ckpts"] = [[s, t(a, "times"), t(b, "times")] for s, a, b in la["ckpts"]]
        la["ckpt_more"] = [la["ckpt_more"][0], min(la["ckpt_more"][1], hi - lo)]
        end = la["end"]
        if end is not None:
            end = dict(end)
            for k in ("failed", "detected", "gone"):
                end[k] = t(end[k], "times")
            end["nodes"] = names(end["nodes"], "cause nodes")
            m = _HANG_NODE.match(end["cause"])
            if m and alloc.nodes and m.group(1) not in alloc.nodes:
                end["cause"] = "hang (the node it named is not one of the job's)"
                changed.add("cause nodes")
            la["end"] = end
        launches.append(la)
    out["launches"] = launches
    for what in sorted(changed):
        notes.append(f"restart {rec['restart']}: goodput events clamped to the allocation "
                     f"({what} outside what the archive saw of the job)")
    return out, notes


def allocation_of(job: dict[str, Any]) -> Allocation:
    """The `Allocation` of a `query.show_job` result."""
    nodes = frozenset(str(n.get("node")) for n in job.get("nodes") or [] if n.get("node"))
    return Allocation(int(job.get("num_nodes") or 0), nodes, job.get("start_unix_s"),
                      job.get("end_unix_s"))


@dataclass(frozen=True)
class Piece:
    """One stretch of the job's time line."""

    phase: str
    start: float
    end: float
    attempt: int  # bv attempt (banner number); 0 before the first
    restart: int  # Slurm restart count

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Interruption:
    attempt: int
    restart: int
    kind: str  # lost | hang | signal | terminated | failed | no-record
    cause: str  # a short name: "node failure: node2", "time limit", "hang: rank 1 on node2"
    detail: str  # the supervisor's words
    at: float | None  # when it happened (unix s)
    nodes: list[str] = field(default_factory=list)
    redone_s: float = 0.0
    lost_s: float = 0.0  # re-done + detection + teardown + hold + start-up it caused
    evidence: list[dict[str, Any]] = field(default_factory=list)  # the nodes' reports


@dataclass
class Ledger:
    job_id: int
    start: float  # submission (or first start when unknown)
    end: float
    nodes: int  # training nodes per step
    gpus_per_node: int
    phases: dict[str, float]
    pieces: list[Piece]
    interruptions: list[Interruption]
    checkpoints: int
    checkpoint_mean_s: float | None
    checkpoint_interval_s: float | None  # mean time from one save's end to the next's start
    notes: list[str] = field(default_factory=list)
    advice: dict[str, Any] = field(default_factory=dict)
    #: node-seconds of hot spares allocated and idle (not in `phases`: its own line)
    spare_node_s: float = 0.0
    spares: int = 0  # the most spares any launch had

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def ettr(self) -> float | None:
        return self.phases["productive"] / self.wall_s if self.wall_s > 0 else None

    def node_hours(self) -> dict[str, float]:
        """Node-hours by phase (training nodes), and the idle spares' as `idle_spare`."""
        out = {k: v * self.nodes / 3600.0 for k, v in self.phases.items()}
        out[IDLE_SPARE] = self.spare_node_s / 3600.0
        return out

    def gpu_hours(self) -> dict[str, float]:
        """GPU-hours by phase, and the idle spares' as `idle_spare`."""
        return {k: v * self.gpus_per_node for k, v in self.node_hours().items()}

    def allocated_node_hours(self) -> float:
        """The node-hours the job's allocations held: every line but the queue's."""
        return sum(v for k, v in self.node_hours().items() if k != "queue_hold")

    def to_dict(self) -> dict[str, Any]:
        nh = self.node_hours()
        return {
            "job_id": self.job_id, "start_unix_s": self.start, "end_unix_s": self.end,
            "wall_s": self.wall_s, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
            "ettr": self.ettr, "phases_s": dict(self.phases), "gpu_hours": self.gpu_hours(),
            "node_hours": nh, "spares": self.spares, "spare_node_s": self.spare_node_s,
            "total_node_hours": sum(nh.values()),
            "allocated_node_hours": self.allocated_node_hours(),
            "checkpoints": self.checkpoints, "checkpoint_mean_s": self.checkpoint_mean_s,
            "checkpoint_interval_s": self.checkpoint_interval_s,
            "interruptions": [asdict(i) for i in self.interruptions],
            "pieces": [{**asdict(p), "seconds": p.seconds} for p in self.pieces],
            "notes": list(self.notes), "advice": dict(self.advice),
        }


class _Line:
    """The time line under construction: pieces in order, never overlapping."""

    def __init__(self, start: float) -> None:
        self.cursor = start
        self.pieces: list[Piece] = []

    def to(self, phase: str, until: float | None, attempt: int, restart: int) -> None:
        if until is None or not math.isfinite(until) or until <= self.cursor:
            return
        self.pieces.append(Piece(phase, self.cursor, until, attempt, restart))
        self.cursor = until


def _cause_of(kind: str, detail: str, nodes: Sequence[str], at: float | None,
              started: float | None, limit: float | None) -> str:
    if kind == "lost":
        return "node failure: " + ",".join(nodes) if nodes else "node failure"
    if kind == "hang":
        words = detail.split(" stopped first")[0]
        return words if words.startswith("hang:") else "hang"
    if kind == "signal":
        if (limit is not None and at is not None and started is not None
                and at - started >= limit - max(TIME_LIMIT_WINDOW_S, 0.1 * limit)):
            return "time limit"
        return "checkpoint signal (SIGUSR1: operator or preemption)"
    if kind == "terminated":
        return "SIGTERM (cancel, operator requeue or preemption)"
    if kind == "failed":
        return "rank failure"
    return kind


def _batch_node_end(rec: dict[str, Any], la: dict[str, Any], slurm_end: float | None
                    ) -> dict[str, Any]:
    """The end of a launch whose supervisor died with its node (the batch node), from the
    copy a second node kept: it failed when that node's keeper saw the supervisor's
    connection end (`gone`), else at the last event the copy holds; Slurm acted on it (the
    other nodes' epilogs) at the attempt's last epilog."""
    known = [la["start"], la["first_progress"], *(c[2] for c in la["ckpts"])]
    last = max(t for t in known if t is not None)
    failed = rec.get("gone") if rec.get("gone") is not None else last
    failed = max(failed, last)
    acted = max(slurm_end, failed) if slurm_end is not None else failed
    on = rec.get("copy_on")
    return {"kind": "lost", "nodes": [rec["host"]], "failed": failed, "detected": acted,
            "gone": acted,
            "cause": f"the batch node {rec['host']} died with the supervisor (its events from "
                     f"the copy on {on or 'a second node'}; the node's prolog came, its "
                     "epilog never did)"}


def build_ledger(job_id: int, records: Sequence[dict[str, Any]],
                 attempts: Sequence[dict[str, Any]] = (), *, gpus_per_node: int = 0,
                 end: float | None = None, alloc: Allocation | None = None,
                 lost: Mapping[int, Collection[str]] | None = None) -> Ledger:
    """The ledger from validated event records (one per Slurm attempt, any order) and the
    archive's attempts (`query.job_attempts`: restart, first_prolog_unix_s,
    last_epilog_unix_s) for the attempts without a record. With `alloc` (every caller that
    reads an archive), each record is first clamped to it (`bound_record`) and a record the
    archive has no time for is left out. `lost`: restart -> the nodes whose prolog came
    and whose epilog never did (`lost_nodes`); a record whose supervisor's node (its host)
    is one of them, and whose last launch has no end, lost that node: the batch node.

    Raises:
        ValueError: neither events nor attempt times to build a time line from.
    """
    times = {int(a["restart"]): a for a in attempts}
    bound_notes: list[str] = []
    if alloc is not None:
        bounded = []
        for r in records:
            att = times.get(int(r["restart"]), {})
            try:
                clamped, why = bound_record(r, alloc, att.get("first_prolog_unix_s"),
                                            att.get("last_epilog_unix_s"))
            except ValueError as exc:
                bound_notes.append(f"goodput events left out: {exc}")
                continue
            bounded.append(clamped)
            bound_notes.extend(why)
        records = bounded
    by_restart = {int(r["restart"]): r for r in records}
    restarts = sorted(set(by_restart) | set(times))
    if not restarts:
        raise ValueError(f"job {job_id}: no goodput events and no attempts archived")

    def attempt_start(k: int) -> float | None:
        rec = by_restart.get(k)
        if rec is not None:
            s = rec["slurm"].get("start")
            first = rec["launches"][0]["start"] if rec["launches"] else rec["opened"]
            return min(s if s is not None else rec["opened"], first)
        t = times.get(k, {}).get("first_prolog_unix_s")
        return float(t) if t is not None else None

    first = by_restart.get(restarts[0])
    submit = first["slurm"].get("submit") if first is not None else None
    start0 = attempt_start(restarts[0])
    origin = submit if submit is not None else start0
    if origin is None:
        raise ValueError(f"job {job_id}: no start time known")
    line = _Line(origin)
    interruptions: list[Interruption] = []
    notes: list[str] = bound_notes
    n_train = 0
    ckpt_durations: list[float] = []
    ckpt_gaps: list[float] = []
    bv_attempt = 0
    cut: list[int] = []  # per interruption: where its pieces start in line.pieces
    spares_of: dict[tuple[int, int], int] = {}  # (restart, attempt) -> its launch's spares
    if submit is None and first is not None:
        notes.append("no submit time (scontrol was not answered): the queue wait is unknown")
    for i, k in enumerate(restarts):
        s_k = attempt_start(k)
        rec = by_restart.get(k)
        line.to("queue_hold", s_k, bv_attempt, k)
        if rec is None:
            nxt = attempt_start(restarts[i + 1]) if i + 1 < len(restarts) else None
            stop = nxt if nxt is not None else (times.get(k, {}).get("last_epilog_unix_s")
                                                or end)
            cut.append(len(line.pieces))
            line.to("unattributed", stop, bv_attempt + 1, k)
            bv_attempt += 1
            interruptions.append(Interruption(
                bv_attempt, k, "no-record", "no supervisor record",
                "no goodput events for this Slurm attempt: its supervisor's node died with "
                "them (a batch node failure), or the job did not run bv's supervisor", s_k))
            continue
        limit = rec["slurm"].get("time_limit_s")
        for la in rec["launches"]:
            bv_attempt = la["attempt"]
            n_train = max(n_train, la["n_nodes"])
            spares_of[(k, bv_attempt)] = la["spares"]
            phase = "startup" if la is rec["launches"][0] else "teardown_relaunch"
            line.to(phase, la["start"], bv_attempt, k)
            p = la["first_progress"]
            e = la["end"]
            ckpts = la["ckpts"]
            batch_lost = (e is None and la is rec["launches"][-1]
                          and rec["host"] in (lost or {}).get(k, ()))
            if batch_lost:
                e = _batch_node_end(rec, la, times.get(k, {}).get("last_epilog_unix_s"))
            if e is None:  # the supervisor was killed mid-step (its node, or SIGKILL)
                line.to("startup", p, bv_attempt, k)
                for _, t0, t1 in ckpts:
                    line.to("productive", t0, bv_attempt, k)
                    line.to("checkpoint", t1, bv_attempt, k)
                notes.append(f"attempt {bv_attempt}: no end recorded (the supervisor was "
                             "killed); the rest of it is unattributed")
                continue
            kind = e["kind"]
            failed, detected, gone = e["failed"], e["detected"], e["gone"]
            if p is None:  # never made progress: all of it was start-up
                line.to("startup", failed or gone, bv_attempt, k)
                work_end = failed or gone
            else:
                line.to("startup", p, bv_attempt, k)
                if kind == "ok":
                    work_end = gone
                else:
                    work_end = failed if failed is not None else gone
                    if kind in ("signal", "terminated"):
                        after = [c for c in ckpts if c[2] >= work_end]
                        if after:  # saved on the signal: nothing is lost
                            work_end = max(c[2] for c in after)
            kept = [c for c in ckpts if c[2] <= work_end + 1e-6]
            prev_end: float | None = None
            for _, t0, t1 in kept:
                line.to("productive", t0, bv_attempt, k)
                line.to("checkpoint", t1, bv_attempt, k)
                ckpt_durations.append(t1 - t0)
                if prev_end is not None:
                    ckpt_gaps.append(t0 - prev_end)
                prev_end = t1
            if kind == "ok":
                line.to("productive", work_end, bv_attempt, k)
            else:
                redone_from = line.cursor
                line.to("redone", work_end, bv_attempt, k)
                redone = max(0.0, work_end - redone_from) if p is not None else 0.0
                nodes = e["nodes"]
                interruptions.append(Interruption(
                    bv_attempt, k, kind,
                    _cause_of(kind, e["cause"], nodes, failed, s_k, limit)
                    + (" (the batch node: the supervisor died with it)" if batch_lost else ""),
                    e["cause"], failed, list(nodes), redone))
                cut.append(len(line.pieces) - (1 if redone > 0 else 0))
                line.to("detection", detected, bv_attempt, k)
            line.to("teardown_relaunch", gone, bv_attempt, k)
            if la is rec["launches"][-1] and rec.get("requeue") is not None:
                line.to("teardown_relaunch", rec["requeue"], bv_attempt, k)
    if end is not None:
        line.to("unattributed", end, bv_attempt, restarts[-1])
    # What each interruption cost: its re-done work and every piece after it that is not
    # work (detection, teardown, hold, start-up) until work goes on again.
    for intr, at in zip(interruptions, cut, strict=True):
        if at < 0:
            continue
        for piece in line.pieces[at:]:
            if piece.phase in ("productive", "checkpoint"):
                break
            intr.lost_s += piece.seconds
    phases = dict.fromkeys(PHASES, 0.0)
    spare_s = 0.0
    for piece in line.pieces:
        phases[piece.phase] += piece.seconds
        if piece.phase != "queue_hold":  # no node is allocated in the queue or the hold
            spare_s += piece.seconds * spares_of.get((piece.restart, piece.attempt), 0)
    return Ledger(job_id, origin, line.cursor, n_train, gpus_per_node, phases, line.pieces,
                  interruptions, len(ckpt_durations),
                  sum(ckpt_durations) / len(ckpt_durations) if ckpt_durations else None,
                  sum(ckpt_gaps) / len(ckpt_gaps) if ckpt_gaps else None, notes,
                  spare_node_s=spare_s, spares=max(spares_of.values(), default=0))


# --------------------------------------------------------------------------------------------
# Advice: the checkpoint interval and the spare count


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval between checkpoints that minimises the expected loss,
    sqrt(2 C M), for a checkpoint cost C and a mean time between failures M."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), the higher-order optimum: sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C
    for C < 2M, else M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = math.sqrt(cost_s / (2.0 * mtbf_s))
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + r / 3.0 + cost_s / (18.0 * mtbf_s)) - cost_s


def expected_waste_fraction(interval_s: float, cost_s: float, restart_s: float,
                            mtbf_s: float) -> float:
    """The first-order share of time lost: C/tau (saving) + (tau + C)/(2M) (re-done work,
    half an interval per failure on average) + R/M (detection, teardown, restart)."""
    if interval_s <= 0 or mtbf_s <= 0:
        return 1.0
    return min(1.0, cost_s / interval_s + (interval_s + cost_s) / (2.0 * mtbf_s)
               + restart_s / mtbf_s)


MIN_FAILURES = 5  # fewer failures observed: the fleet's MTBF is "too short a history to trust"


def interval_advice(cost_s: float | None, used_interval_s: float | None, node_mtbf_s: float | None,
                    failures_seen: int, nodes: int, restart_s: float, job_s: float,
                    gpus: int) -> dict[str, Any]:
    """The checkpoint interval to use for a job of `nodes` nodes: the job's MTBF is the
    node MTBF over the node count (independent failures)."""
    out: dict[str, Any] = {"model": "Young/Daly", "checkpoint_cost_s": cost_s,
                           "interval_used_s": used_interval_s, "node_mtbf_s": node_mtbf_s,
                           "failures_seen": failures_seen, "min_failures": MIN_FAILURES,
                           "nodes": nodes, "restart_s": restart_s}
    if cost_s is None:
        out["verdict"] = "no advice: the job recorded no checkpoint (its cost is unknown)"
        return out
    if node_mtbf_s is None or nodes < 1:
        out["verdict"] = ("no advice: no failure of this node class in the fleet's history "
                          "(too short to measure an MTBF)")
        return out
    job_mtbf = node_mtbf_s / nodes
    tau_y, tau_d = young_interval(cost_s, job_mtbf), daly_interval(cost_s, job_mtbf)
    out.update({"job_mtbf_s": job_mtbf, "young_interval_s": tau_y, "daly_interval_s": tau_d,
                "trust": failures_seen >= MIN_FAILURES})
    if used_interval_s:
        w_used = expected_waste_fraction(used_interval_s, cost_s, restart_s, job_mtbf)
        w_best = expected_waste_fraction(tau_d, cost_s, restart_s, job_mtbf)
        out["expected_waste_used"] = w_used
        out["expected_waste_daly"] = w_best
        out["gpu_hours_saved"] = max(0.0, (w_used - w_best) * job_s * nodes * gpus / 3600.0)
        out["node_hours_saved"] = max(0.0, (w_used - w_best) * job_s * nodes / 3600.0)
    out["verdict"] = (f"checkpoint every {tau_d:.0f} s (Daly; Young {tau_y:.0f} s)"
                      + ("" if out["trust"] else f": only {failures_seen} failure(s) in the "
                         f"fleet's history, fewer than {MIN_FAILURES}: too short to trust"))
    return out


def spare_advice(nodes: int, node_mtbf_s: float, job_s: float, *, spare_swap_s: float = 5.0,
                 requeue_s: float = 120.0, startup_s: float = 60.0, max_spares: int = 8
                 ) -> dict[str, Any]:
    """The number of hot spares that maximises expected goodput for a job of `nodes` nodes
    and `job_s` seconds of work. The job sees K ~ Poisson(n T / M) node failures; the first
    s of them cost `spare_swap_s` each (a spare in the allocation), the rest a requeue hold
    plus start-up each; every spare is allocated (and idle) for the whole run:

        E[loss(s)] = E[min(K, s)] * swap + E[max(K - s, 0)] * (requeue + start-up)
        G(s) = (T n) / ((T + E[loss(s)]) (n + s))

    (the useful node-seconds over the node-seconds allocated). Re-done work is the same
    with or without spares and is left out.
    """
    from math import exp, factorial

    lam = nodes * job_s / node_mtbf_s if node_mtbf_s > 0 else 0.0
    rows = []
    for s in range(max_spares + 1):
        # E[min(K, s)] and E[max(K - s, 0)] for K ~ Poisson(lam)
        p_k = [exp(-lam) * lam**k / factorial(k) for k in range(s + 1)]
        e_min = sum(k * p for k, p in enumerate(p_k)) + s * max(0.0, 1.0 - sum(p_k))
        e_over = max(0.0, lam - e_min)
        loss = e_min * spare_swap_s + e_over * (requeue_s + startup_s)
        goodput = (job_s * nodes) / ((job_s + loss) * (nodes + s))
        rows.append({"spares": s, "expected_failures_covered": e_min,
                     "expected_requeues": e_over, "expected_loss_s": loss,
                     "expected_goodput": goodput})
    best = max(rows, key=lambda r: r["expected_goodput"])
    return {"model": "Poisson failures, spare swap vs requeue", "expected_failures": lam,
            "spare_swap_s": spare_swap_s, "requeue_s": requeue_s, "startup_s": startup_s,
            "best_spares": best["spares"], "table": rows}


# --------------------------------------------------------------------------------------------
# Reading the archive


def records_of(job: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The validated event records in a `query.show_job` result, and a note per record that
    failed the checks (left out, never fatal)."""
    from bluevela.launch.events import EventsError, merge_records, validate

    out: dict[int, dict[str, Any]] = {}
    bad: list[str] = []
    names = {str(n.get("node")) for n in job.get("nodes") or []}
    for n in job.get("nodes") or []:
        reports = [n.get("epilog")] + [e.get("epilog") for e in n.get("earlier") or []]
        for rep in reports:
            if not rep or "goodput_events" not in rep:
                continue
            try:
                rec = validate(rep["goodput_events"])
            except EventsError as exc:
                bad.append(f"{n.get('node')}: goodput events left out: {exc}")
                continue
            # a copy (another node's supervisor's events, kept here) names a node of the job
            copy_ok = rec.get("copy_on") == n.get("node") and rec["host"] in names
            if rec["host"] != n.get("node") and not copy_ok:
                bad.append(f"{n.get('node')}: goodput events of another host left out")
                continue
            have = out.get(rec["restart"])
            if have is not None and have["host"] != rec["host"]:
                bad.append(f"{n.get('node')}: goodput events of restart {rec['restart']} "
                           f"from a second supervisor ({rec['host']}) left out")
                continue
            # the batch node's own file and the copies: every event once
            out[rec["restart"]] = merge_records(have, rec)
    return list(out.values()), bad


def lost_nodes(job: dict[str, Any]) -> dict[int, set[str]]:
    """Restart -> the nodes of a `query.show_job` result whose prolog of that attempt came
    and whose epilog never did (a node that died in the attempt)."""
    out: dict[int, set[str]] = {}
    for n in job.get("nodes") or []:
        for rep in [n, *(n.get("earlier") or [])]:
            pro, epi = rep.get("prolog"), rep.get("epilog")
            if pro and not epi:
                k = rep.get("restart", pro.get("restart"))
                out.setdefault(int(k or 0), set()).add(str(n.get("node")))
    return out


def node_evidence(archive_dir: Path, node: str, at: float | None) -> list[dict[str, Any]]:
    """The failed node's reports in the archive from an hour before the failure: its health
    history (`bv archive node NODE`), with drain reasons and XIDs."""
    from bluevela.archive.query import node_history

    try:
        hist = node_history(archive_dir, node, since=(at - 3600.0) if at else None)
    except Exception as exc:  # noqa: BLE001 - evidence is a nicety; the ledger stands
        logger.debug("no history of %s: %s", node, exc)
        return []
    reports = hist.get("reports", hist) if isinstance(hist, dict) else hist
    out = []
    for r in list(reports or [])[-20:]:
        xids = [m for c in (r.get("health") or {}).get("checks") or []
                for m, v in (c.get("metrics") or {}).items() if "xid" in m and v]
        out.append({"time": r.get("time"), "phase": r.get("phase"), "job_id": r.get("job_id"),
                    "status": (r.get("health") or {}).get("status"),
                    "drained": r.get("drained"), "drain_reason": r.get("drain_reason"),
                    "xids": xids})
    return out


def job_goodput(archive_dir: Path, job_id: int, *, job: dict[str, Any] | None = None,
                gpus_per_node: int | None = None, fleet: Any = None) -> Ledger:
    """The ledger of an archived job, with each interruption's node evidence.

    Raises:
        ArchiveError: the job is not archived, or nothing of it gives a time line.
    """
    from bluevela.archive.query import show_job
    from bluevela.errors import ArchiveError

    if job is None:
        job = show_job(archive_dir, job_id)
    records, bad = records_of(job)
    attempts = job.get("attempts") or [{"restart": 0,
                                        "first_prolog_unix_s": job.get("start_unix_s"),
                                        "last_epilog_unix_s": job.get("end_unix_s")}]
    try:
        ledger = build_ledger(job_id, records, attempts,
                              gpus_per_node=gpus_per_node if gpus_per_node is not None
                              else _gpus_per_node(job), alloc=allocation_of(job),
                              lost=lost_nodes(job))
    except ValueError as exc:
        raise ArchiveError(str(exc)) from exc
    ledger.notes.extend(bad)
    if not records:
        ledger.notes.append("no goodput events archived for this job (a job not run through "
                            "bv's supervisor, or its epilog reports predate them)")
    for intr in ledger.interruptions:
        for node in intr.nodes:
            intr.evidence.append({"node": node, "history": f"bv archive node {node}",
                                  "reports": node_evidence(archive_dir, node, intr.at)})
            for r in intr.evidence[-1]["reports"]:
                # only what the node reported from the failure on names its cause
                recent = intr.at is None or (r.get("time") or 0) >= intr.at - 60
                if recent and (r.get("drain_reason") or r.get("xids")):
                    intr.cause += f" ({r.get('drain_reason') or 'XID ' + ','.join(r['xids'])})"
                    break
    return ledger


def ledger_or_none(archive_dir: Path, job: dict[str, Any]) -> dict[str, Any] | None:
    """The ledger as a dict for a page, or None when the job has no goodput events."""
    from bluevela.errors import ArchiveError

    if not records_of(job)[0]:
        return None
    try:
        return job_goodput(archive_dir, int(job["job_id"]), job=job).to_dict()
    except ArchiveError as exc:
        logger.info("no goodput ledger for job %s: %s", job.get("job_id"), exc)
        return None


ADVICE_WINDOW_S = 30 * 86400.0  # the fleet history the advice's MTBF is measured over


def advise(ledger: Ledger, node_mtbf_h: float | None, failures_seen: int) -> dict[str, Any]:
    """The checkpoint-interval and spare advice for this job (pure): its measured
    checkpoint cost, interval and interruption cost, the class's node MTBF."""
    restart_s = (sum(i.lost_s - i.redone_s for i in ledger.interruptions)
                 / len(ledger.interruptions)) if ledger.interruptions else 0.0
    out = interval_advice(ledger.checkpoint_mean_s, ledger.checkpoint_interval_s,
                          node_mtbf_h * 3600.0 if node_mtbf_h else None, failures_seen,
                          max(ledger.nodes, 1), restart_s, ledger.phases["productive"],
                          ledger.gpus_per_node)
    if node_mtbf_h:
        starts = ledger.phases["startup"] / max(1, len(ledger.interruptions) + 1)
        sp = spare_advice(max(ledger.nodes, 1), node_mtbf_h * 3600.0,
                          max(ledger.phases["productive"], 1.0), startup_s=starts)
        out["spares"] = {k: sp[k] for k in ("best_spares", "expected_failures", "model",
                                            "spare_swap_s", "requeue_s", "startup_s")}
    return out


def fleet_advice(archive_dir: Path, ledger: Ledger, job: dict[str, Any],
                 now: float | None = None) -> dict[str, Any]:
    """`advise` with the MTBF of the job's node class over the last 30 days of the fleet
    report (bluevela/report/fleet.py); no advice (said so) when that cannot be read."""
    import time as _time

    from bluevela.errors import BluevelaError
    from bluevela.report.fleet import UNKNOWN_CLASS, classes_of, fleet_report

    now = _time.time() if now is None else now
    try:
        from bluevela.site import load_site

        site = load_site()
    except Exception:  # noqa: BLE001 - without a site every node is in no class
        site = None
    try:
        rep = fleet_report(archive_dir, since=now - ADVICE_WINDOW_S, now=now, site=site)
    except BluevelaError as exc:
        return {"verdict": f"no advice: the fleet's history could not be read ({exc})"}
    first = (job.get("nodes") or [{}])[0].get("node")
    cls = next((name for name, info in classes_of(site).items() if first in info.nodes),
               UNKNOWN_CLASS)
    row = next((r for r in rep["mtbf"]["by_class"] if r["class"] == cls), None)
    out = advise(ledger, row["mtbf_h"] if row else None, int(row["incidents"]) if row else 0)
    out["node_class"] = cls
    out["history_days"] = ADVICE_WINDOW_S / 86400.0
    return out


def _gpus_per_node(job: dict[str, Any]) -> int:
    """GPUs per node from the site's node classes (0 for CPU nodes or no site)."""
    try:
        from bluevela.site import load_site

        site = load_site()
        first = (job.get("nodes") or [{}])[0].get("node")
        return int(site.node_classes[site.class_name_for(first)].gpus)
    except Exception:  # noqa: BLE001 - GPU hours are shown as 0 when the class is unknown
        return 0


def fmt_s(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "?"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def summary_lines(ledger: Ledger) -> list[str]:
    out = [f"job {ledger.job_id}: wall {fmt_s(ledger.wall_s)}, {ledger.nodes} node(s) x "
           f"{ledger.gpus_per_node} GPU(s), ETTR {100 * (ledger.ettr or 0):.1f}%"]
    gh, nh = ledger.gpu_hours(), ledger.node_hours()
    total_nh = sum(nh.values())
    for k in PHASES:
        share = 100 * ledger.phases[k] / ledger.wall_s if ledger.wall_s > 0 else 0.0
        out.append(f"  {PHASE_LABELS[k]:<26} {fmt_s(ledger.phases[k]):>10} {share:5.1f}%  "
                   f"{gh[k]:.2f} GPU-h  {nh[k]:.3f} node-h")
    out.append(f"  {IDLE_SPARE_LABEL:<26} {ledger.spares:>5} spare(s)       "
               f"{gh[IDLE_SPARE]:.2f} GPU-h  {nh[IDLE_SPARE]:.3f} node-h")
    share_sp = 100 * nh[IDLE_SPARE] / total_nh if total_nh > 0 else 0.0
    out.append(f"  in all: {total_nh:.3f} node-h ({ledger.allocated_node_hours():.3f} allocated, "
               f"the queue's aside); idle spares {share_sp:.1f}% of them")
    out.append(f"  checkpoints: {ledger.checkpoints}, mean cost "
               f"{fmt_s(ledger.checkpoint_mean_s)}, mean interval "
               f"{fmt_s(ledger.checkpoint_interval_s)}")
    for i in ledger.interruptions:
        out.append(f"  interruption in attempt {i.attempt} (restart {i.restart}): {i.cause}; "
                   f"re-done {fmt_s(i.redone_s)}, lost in all {fmt_s(i.lost_s)}")
        for ev in i.evidence:
            out.append(f"    {ev['node']}: {len(ev['reports'])} report(s), see `{ev['history']}`")
    adv = ledger.advice
    if adv.get("verdict"):
        out.append(f"  advice: {adv['verdict']}")
        out.append("    inputs: " + inputs_text(adv))
        if adv.get("spares"):
            sp = adv["spares"]
            out.append(f"    spares: {sp['best_spares']} maximise expected goodput "
                       f"({sp['expected_failures']:.2f} node failures expected; a spare swap "
                       f"{sp['spare_swap_s']:g} s vs requeue {sp['requeue_s']:g} s + start-up "
                       f"{fmt_s(sp['startup_s'])})")
    out.extend(f"  note: {n}" for n in ledger.notes)
    return out


def inputs_text(adv: dict[str, Any]) -> str:
    """The advice's inputs in one line (the page and the CLI show them with the verdict)."""
    mtbf = adv.get("node_mtbf_s")
    parts = [f"checkpoint cost {fmt_s(adv.get('checkpoint_cost_s'))}",
             f"interval used {fmt_s(adv.get('interval_used_s'))}",
             f"node MTBF {fmt_s(mtbf)} ({adv.get('failures_seen', 0)} failure(s) of class "
             f"{adv.get('node_class', '?')})", f"{adv.get('nodes', '?')} node(s)"]
    if adv.get("job_mtbf_s") is not None:
        parts.append(f"job MTBF {fmt_s(adv['job_mtbf_s'])}")
    if adv.get("gpu_hours_saved") is not None:
        parts.append(f"would have saved {adv['gpu_hours_saved']:.2f} GPU-h "
                     f"({adv.get('node_hours_saved', 0):.3f} node-h)")
    return ", ".join(parts)


def phase_totals(ledgers: Iterable[Ledger]) -> dict[str, float]:
    out = dict.fromkeys(PHASES, 0.0)
    for led in ledgers:
        for k, v in led.phases.items():
            out[k] += v
    return out
