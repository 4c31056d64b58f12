"""The goodput ledger of one job: where its wall time (and GPU hours) went, by phase and cause
(`bv archive show JOB --goodput`; docs/resilience.md "The goodput ledger").

Input: the supervisor's events of each Slurm attempt (bluevela/goodput/events.py), which the
epilog of the supervisor's node put in its report (`goodput_events`), and the archive's
prolog/epilog times of each attempt for attempts without events. Pure logic over those
(`build_ledger`), unit-tested with hand-computed numbers; `job_goodput` reads the archive.
Each record is first held to what the archive saw of the job (report/goodput_bounds.py); the
checkpoint-interval and spare advice from a ledger is report/goodput_advice.py.

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
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bluevela.goodput.events import TIERS
from bluevela.goodput.outcome import LossKind, StepEnd
from bluevela.report.goodput_bounds import Allocation, allocation_of, bound_record

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
    cause: str  # a short name: "node failure: node2", "time limit", "hang on node2"
    detail: str  # the supervisor's words
    at: float | None  # when it happened (unix s)
    nodes: list[str] = field(default_factory=list)
    redone_s: float = 0.0
    lost_s: float = 0.0  # re-done + detection + teardown + hold + start-up it caused
    evidence: list[dict[str, Any]] = field(default_factory=list)  # the nodes' reports


@dataclass
class Background:
    """The checkpoint store's background phases (node-local write, partner copy, drain to
    shared storage) as the ranks reported them: off the training path, beside the stall
    (the `checkpoint` phase). `complete`: saves whose every reporting rank's shard reached
    each tier (node-local, the partner's copy, shared storage)."""

    saves: int
    seconds: float
    complete: dict[str, int]

    @property
    def mean_s(self) -> float | None:
        return self.seconds / self.saves if self.saves else None


@dataclass
class Resume:
    """One launch's resume through the store: the step, how long it took, how many ranks read
    their shard from each tier, how many copies were skipped (torn, corrupt, missing)."""

    attempt: int
    restart: int
    step: int
    seconds: float
    tiers: dict[str, int]
    skipped: int


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
    #: False when no launch reported a step (a plain script: no bluevela.runtime.progress, no
    #: integration): start-up and training cannot be told apart, the ETTR is unknown
    steps_reported: bool = True
    #: The checkpoint store's saves (bluevela/ckpt): their background phase, off the training
    #: path and so in no phase (`Background`); None when no launch used the store
    background: Background | None = None
    #: Each launch's resume through the store: where its ranks read their shards (`Resume`)
    resumes: list[Resume] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def ettr(self) -> float | None:
        if not self.steps_reported:
            return None
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
            "steps_reported": self.steps_reported,
            "checkpoint_stall_s": self.phases["checkpoint"],
            "checkpoint_background": None if self.background is None else {
                **asdict(self.background), "mean_s": self.background.mean_s},
            "resumes": [asdict(r) for r in self.resumes],
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


def _cause_of(e: dict[str, Any], started: float | None, limit: float | None) -> str:
    """The short name of how a launch ended, from its kinds (never from its words)."""
    kind = StepEnd(e["kind"])
    if kind is StepEnd.LOST:
        return "node failure: " + ",".join(e["nodes"]) if e["nodes"] else "node failure"
    if kind is StepEnd.HANG:
        hung = [n for n, k in e["loss_kinds"].items() if k == LossKind.HUNG.value]
        return f"hang on {hung[0]}" if hung else "hang"
    if kind is StepEnd.SIGNAL:
        at = e["failed"]
        if (limit is not None and at is not None and started is not None
                and at - started >= limit - max(TIME_LIMIT_WINDOW_S, 0.1 * limit)):
            return "time limit"
        return "checkpoint signal (SIGUSR1: operator or preemption)"
    if kind is StepEnd.TERMINATED:
        return "SIGTERM (cancel, operator requeue or preemption)"
    if kind is StepEnd.FAILED:
        return "rank failure"
    return kind.value


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
    return {"kind": StepEnd.LOST.value, "nodes": [rec["host"]],
            "loss_kinds": {rec["host"]: LossKind.BATCH_NODE.value},
            "failed": failed, "detected": acted, "gone": acted,
            "cause": f"the batch node {rec['host']} died with the supervisor (its events from "
                     f"the copy on {on or 'a second node'}; the node's prolog came, its "
                     "epilog never did)"}


@dataclass
class _Attempts:
    """The Slurm attempts a ledger is built from: the event records (restart -> record), the
    archive's times of each attempt, and the nodes each attempt lost with no epilog."""

    records: dict[int, dict[str, Any]]
    times: Mapping[int, Mapping[str, Any]]
    lost: Mapping[int, Collection[str]]

    def restarts(self) -> list[int]:
        return sorted(set(self.records) | set(self.times))

    def start(self, k: int) -> float | None:
        """When attempt `k` started: its record's Slurm start or first launch, else the
        archive's first prolog."""
        rec = self.records.get(k)
        if rec is not None:
            s = rec["slurm"].get("start")
            first = rec["launches"][0]["start"] if rec["launches"] else rec["opened"]
            return min(s if s is not None else rec["opened"], first)
        t = self.times.get(k, {}).get("first_prolog_unix_s")
        return float(t) if t is not None else None

    def last_epilog(self, k: int) -> float | None:
        return self.times.get(k, {}).get("last_epilog_unix_s")


@dataclass
class _Build:
    """A ledger under construction: the time line, the bv attempt it is at, and what the
    walk gathers on the way."""

    line: _Line
    notes: list[str]
    attempt: int = 0  # bv attempt (banner number); 0 before the first
    n_train: int = 0
    interruptions: list[Interruption] = field(default_factory=list)
    cut: list[int] = field(default_factory=list)  # per interruption: its first piece's index
    ckpt_durations: list[float] = field(default_factory=list)
    ckpt_gaps: list[float] = field(default_factory=list)
    spares_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (restart, attempt)
    background: Background | None = None
    resumes: list[Resume] = field(default_factory=list)

    def to(self, phase: str, until: float | None, restart: int) -> None:
        self.line.to(phase, until, self.attempt, restart)


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
    notes: list[str] = []
    if alloc is not None:
        records, notes = _bounded(records, times, alloc)
    att = _Attempts({int(r["restart"]): r for r in records}, times, lost or {})
    restarts = att.restarts()
    if not restarts:
        raise ValueError(f"job {job_id}: no goodput events and no attempts archived")
    first = att.records.get(restarts[0])
    submit = first["slurm"].get("submit") if first is not None else None
    origin = submit if submit is not None else att.start(restarts[0])
    if origin is None:
        raise ValueError(f"job {job_id}: no start time known")
    b = _Build(_Line(origin), notes)
    if submit is None and first is not None:
        notes.append("no submit time (scontrol was not answered): the queue wait is unknown")
    for i, k in enumerate(restarts):
        s_k = att.start(k)
        rec = att.records.get(k)
        b.to("queue_hold", s_k, k)
        if rec is None:
            nxt = att.start(restarts[i + 1]) if i + 1 < len(restarts) else None
            _add_unrecorded(b, k, s_k, nxt if nxt is not None else (att.last_epilog(k) or end))
            continue
        for la in rec["launches"]:
            _add_launch(b, att, rec, la, s_k)
    if end is not None:
        b.to("unattributed", end, restarts[-1])
    _charge_interruptions(b)
    ledger = _ledger_of(job_id, b, origin, gpus_per_node)
    launches = [la for rec in att.records.values() for la in rec["launches"]]
    if launches and all(la["first_progress"] is None for la in launches):
        ledger.steps_reported = False
        ledger.notes.append(NO_STEPS_NOTE)
    return ledger


NO_STEPS_NOTE = (
    "no step was reported (the script calls no bluevela.runtime.progress and runs under no "
    "framework integration): bv cannot tell start-up from training, so 'start-up to first "
    "step' holds both and the ETTR is unknown, not 0 %. Report steps with `from bluevela "
    "import runtime` and `runtime.progress(step)` in the loop (docs/resilience.md)")


def _bounded(records: Sequence[dict[str, Any]], times: Mapping[int, Mapping[str, Any]],
             alloc: Allocation) -> tuple[list[dict[str, Any]], list[str]]:
    """Each record clamped to the allocation (`bound_record`), and the notes: what was
    clamped, and the records the archive has no time for (left out)."""
    bounded, notes = [], []
    for r in records:
        att = times.get(int(r["restart"]), {})
        try:
            clamped, why = bound_record(r, alloc, att.get("first_prolog_unix_s"),
                                        att.get("last_epilog_unix_s"))
        except ValueError as exc:
            notes.append(f"goodput events left out: {exc}")
            continue
        bounded.append(clamped)
        notes.extend(why)
    return bounded, notes


def _add_unrecorded(b: _Build, k: int, started: float | None, stop: float | None) -> None:
    """A Slurm attempt without events: one bv attempt, unattributed up to `stop`."""
    b.cut.append(len(b.line.pieces))
    b.attempt += 1
    b.to("unattributed", stop, k)
    b.interruptions.append(Interruption(
        b.attempt, k, "no-record", "no supervisor record",
        "no goodput events for this Slurm attempt: its supervisor's node died with "
        "them (a batch node failure), or the job did not run bv's supervisor", started))


def _add_launch(b: _Build, att: _Attempts, rec: dict[str, Any], la: dict[str, Any],
                started: float | None) -> None:
    """One launch of a recorded attempt onto the time line: its start-up, its work and
    saves up to the failure (or the exit), and the interruption it ended with."""
    k = int(rec["restart"])
    b.attempt = la["attempt"]
    b.n_train = max(b.n_train, la["n_nodes"])
    b.spares_of[(k, b.attempt)] = la["spares"]
    last = la is rec["launches"][-1]
    _add_store(b, la, k)
    b.to("startup" if la is rec["launches"][0] else "teardown_relaunch", la["start"], k)
    e = la["end"]
    batch_lost = e is None and last and rec["host"] in att.lost.get(k, ())
    if batch_lost:
        e = _batch_node_end(rec, la, att.last_epilog(k))
    if e is None:  # the supervisor was killed mid-step (its node, or SIGKILL)
        b.to("startup", la["first_progress"], k)
        for _, t0, t1 in la["ckpts"]:
            b.to("productive", t0, k)
            b.to("checkpoint", t1, k)
        b.notes.append(f"attempt {b.attempt}: no end recorded (the supervisor was killed); "
                       "the rest of it is unattributed")
        return
    _add_ended(b, la, e, k, started, rec["slurm"].get("time_limit_s"), batch_lost)
    b.to("teardown_relaunch", e["gone"], k)
    if last and rec.get("requeue") is not None:
        b.to("teardown_relaunch", rec["requeue"], k)


def _add_store(b: _Build, la: dict[str, Any], k: int) -> None:
    """The checkpoint store's records of a launch: every save's background phase (whatever
    became of the launch: it ran off the training path), and its resume."""
    bgs, more = la.get("bgs") or [], la.get("bg_more") or [0, 0.0]
    if bgs or more[0]:
        if b.background is None:
            b.background = Background(0, 0.0, dict.fromkeys(TIERS, 0))
        bg = b.background
        bg.saves += len(bgs) + int(more[0])
        bg.seconds += sum(t1 - t0 for _, t0, t1, *_ in bgs) + float(more[1])
        for _, _, _, ranks, *counts in bgs:
            for tier, n in zip(TIERS, counts, strict=True):
                bg.complete[tier] += int(n >= ranks)
    r = la.get("resume")
    if r is not None:
        b.resumes.append(Resume(b.attempt, k, r["step"], r["t1"] - r["t0"],
                                {t: r[t] for t in TIERS}, r["skipped"]))


def _add_ended(b: _Build, la: dict[str, Any], e: dict[str, Any], k: int,
               started: float | None, limit: float | None, batch_lost: bool) -> None:
    """A launch with an end: start-up to its first progress, work and saves up to the
    failure, then re-done work and detection (an `Interruption`), or work to the exit."""
    p = la["first_progress"]
    work_end = _work_end(e, p, la["ckpts"])
    b.to("startup", p if p is not None else work_end, k)
    prev_end: float | None = None
    for _, t0, t1 in (c for c in la["ckpts"] if c[2] <= work_end + 1e-6):
        b.to("productive", t0, k)
        b.to("checkpoint", t1, k)
        b.ckpt_durations.append(t1 - t0)
        if prev_end is not None:
            b.ckpt_gaps.append(t0 - prev_end)
        prev_end = t1
    if e["kind"] == StepEnd.OK:
        b.to("productive", work_end, k)
        return
    redone_from = b.line.cursor
    b.to("redone", work_end, k)
    redone = max(0.0, work_end - redone_from) if p is not None else 0.0
    cause = _cause_of(e, started, limit)
    if batch_lost:
        cause += " (the batch node: the supervisor died with it)"
    b.interruptions.append(Interruption(b.attempt, k, e["kind"], cause, e["cause"],
                                        e["failed"], list(e["nodes"]), redone))
    b.cut.append(len(b.line.pieces) - (1 if redone > 0 else 0))
    b.to("detection", e["detected"], k)


def _work_end(e: dict[str, Any], progress: float | None, ckpts: list[list[float]]) -> float:
    """Where a launch's work ends: the exit for a clean one; else the failure (the end of a
    save made on the signal, which loses nothing); the failure for one that never made
    progress."""
    failed, gone = e["failed"], e["gone"]
    if progress is None:
        return failed or gone
    if e["kind"] == StepEnd.OK:
        return gone
    work_end = failed if failed is not None else gone
    if StepEnd(e["kind"]).by_signal:
        after = [c[2] for c in ckpts if c[2] >= work_end]
        if after:  # saved on the signal: nothing is lost
            work_end = max(after)
    return work_end


def _charge_interruptions(b: _Build) -> None:
    """What each interruption cost: its re-done work and every piece after it that is not
    work (detection, teardown, hold, start-up) until work goes on again."""
    for intr, at in zip(b.interruptions, b.cut, strict=True):
        if at < 0:
            continue
        for piece in b.line.pieces[at:]:
            if piece.phase in ("productive", "checkpoint"):
                break
            intr.lost_s += piece.seconds


def _ledger_of(job_id: int, b: _Build, origin: float, gpus_per_node: int) -> Ledger:
    phases = dict.fromkeys(PHASES, 0.0)
    spare_s = 0.0
    for piece in b.line.pieces:
        phases[piece.phase] += piece.seconds
        if piece.phase != "queue_hold":  # no node is allocated in the queue or the hold
            spare_s += piece.seconds * b.spares_of.get((piece.restart, piece.attempt), 0)
    durations, gaps = b.ckpt_durations, b.ckpt_gaps
    return Ledger(job_id, origin, b.line.cursor, b.n_train, gpus_per_node, phases,
                  b.line.pieces, b.interruptions, len(durations),
                  sum(durations) / len(durations) if durations else None,
                  sum(gaps) / len(gaps) if gaps else None, b.notes,
                  spare_node_s=spare_s, spares=max(b.spares_of.values(), default=0),
                  background=b.background, resumes=b.resumes)


# --------------------------------------------------------------------------------------------
# Reading the archive


def records_of(job: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The validated event records in a `query.show_job` result, and a note per record that
    failed the checks (left out, never fatal). Each record's submit time is Slurm's where the
    epilog that carried it read Slurm's record (`slurm_job`), never the owner's then."""
    from bluevela.goodput.events import EventsError, merge_records, validate
    from bluevela.report.goodput_bounds import slurm_submit, with_slurm_submit

    out: dict[int, dict[str, Any]] = {}
    submits: dict[int, float] = {}
    bad: list[str] = []
    names = {str(n.get("node")) for n in job.get("nodes") or []}
    for n in job.get("nodes") or []:
        reports = [n.get("epilog")] + [e.get("epilog") for e in n.get("earlier") or []]
        for rep in reports:
            if not rep or "goodput_events" not in rep:
                continue
            submit = slurm_submit(rep)
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
            if submit is not None:  # Slurm's, as root's epilog read it
                submits[rec["restart"]] = min(submit, submits.get(rec["restart"], submit))
    return [with_slurm_submit(r, submits.get(k)) for k, r in out.items()], bad


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
    ettr = ("unknown (no step reported)" if not ledger.steps_reported
            else f"{100 * (ledger.ettr or 0):.1f}%")
    out = [f"job {ledger.job_id}: wall {fmt_s(ledger.wall_s)}, {ledger.nodes} node(s) x "
           f"{ledger.gpus_per_node} GPU(s), ETTR {ettr}"]
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
    out.extend(store_lines(ledger))
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


TIER_WORDS = {"local": "node-local", "partner": "partner", "shared": "shared"}


def fmt_fine(s: float | None) -> str:
    """`fmt_s`, in milliseconds below a second (a store's stall is tens of ms)."""
    if s is not None and math.isfinite(s) and 0 <= s < 1:
        return f"{s * 1000:.0f} ms"
    return fmt_s(s)


def store_lines(ledger: Ledger) -> list[str]:
    """The checkpoint store's lines (none for a job that did not use it): the stall (the
    training loop blocked: the `checkpoint` phase) and the background phase (off the training
    path) as separate figures, and each resume's tiers."""
    out = []
    bg = ledger.background
    if bg is not None:
        out.append("  checkpoint stall (training blocked): "
                   f"{fmt_fine(ledger.phases['checkpoint'])} in all, mean "
                   f"{fmt_fine(ledger.checkpoint_mean_s)}")
        out.append(f"  checkpoint background (off the training path): {bg.saves} save(s), "
                   f"{fmt_fine(bg.seconds)} in all, mean {fmt_fine(bg.mean_s)}; complete in "
                   + ", ".join(f"{TIER_WORDS[t]} {bg.complete[t]}" for t in TIERS))
    for r in ledger.resumes:
        where = ", ".join(f"{TIER_WORDS[t]} x{r.tiers[t]}" for t in TIERS if r.tiers[t])
        out.append(f"  resume in attempt {r.attempt} (restart {r.restart}): step {r.step} in "
                   f"{fmt_fine(r.seconds)} from {where or 'nowhere'}; "
                   f"{r.skipped} cop{'y' if r.skipped == 1 else 'ies'} skipped")
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
