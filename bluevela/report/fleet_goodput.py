"""Goodput in the fleet report (`bv report fleet`): GPU hours of the jobs that ended in the
window by how each ended, and the jobs' goodput ledgers (bluevela/report/goodput.py): ETTR per
job and by job size, hours lost by phase and by cause, the checkpoint interval and spare
advice, and the node failures a ledger saw that the hooks confirm (counted in the MTBF once
each). Pure: no I/O.

The goodput events are the job owner's file (bluevela/goodput/events.py): the fleet's figures
take Slurm's outcome and the hooks' own evidence first, never the owner's word alone
(docs/report.md, "What the fleet figures trust"):

- a job's hours count as goodput only when Slurm saw it end cleanly (exit 0, no signal): a
  ledger may split such a job's hours into productive and lost, never turn a failed job's
  into goodput;
- a ledger whose own account contradicts Slurm's (its last launch ended cleanly, Slurm saw the
  job fail) is left out of the ledger figures (`refused`);
- a node a ledger names as lost counts as a node failure only when the hooks saw it go (its
  prolog of that attempt came, its epilog never did), or through the hooks' own events.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bluevela.goodput.outcome import StepEnd
from bluevela.report.fleet_facts import (
    LEDGER_FAILURE,
    NODE_LOST,
    UNKNOWN_CLASS,
    Event,
    JobFacts,
)

if TYPE_CHECKING:
    from bluevela.report.goodput import Ledger

logger = logging.getLogger(__name__)

Built = list[tuple[JobFacts, "Ledger", int]]  # each job's ledger and its GPUs per node
SIZE_BUCKETS = (1, 2, 8, 32, 128, 512, 2048, 8192)
SAME_FAILURE_S = 3600.0  # a ledger's node failure this close to another event of the node is it
_OUTCOMES = ("completed", "signalled", "failed", "lost_node", "unknown")


def pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 2) if whole > 0 else None


# ------------------------------------------------------------------------- hours by outcome


def slurm_clean(j: JobFacts) -> bool:
    """Whether Slurm saw the job end cleanly: exit status 0 and no signal (the hooks' record
    of Slurm's SLURM_JOB_EXIT_CODE2). A node lost on the way is no contradiction of that."""
    return j.exit_code == 0 and j.exit_signal <= 0


def _outcome(j: JobFacts) -> str:
    if j.lost or (j.epilog_critical and (j.exit_code > 0 or j.exit_signal > 0)):
        return "lost_node"
    if j.exit_code < 0 and j.exit_signal < 0:
        return "unknown"
    if j.exit_code > 0:
        return "failed"
    if j.exit_signal > 0:
        return "signalled"
    return "completed"


def goodput_hours(jobs: list[JobFacts], gpus_of: Mapping[str, int], since: float,
                  now: float, ledger: Mapping[int, tuple[float, float]] | None = None
                  ) -> dict[str, Any]:
    """GPU hours by how each job ended (Slurm's outcome: the hooks' exit status and lost
    nodes). A job Slurm saw end cleanly (`slurm_clean`) that has a goodput ledger (`ledger`:
    job -> productive and allocated seconds) is split by it instead: its productive time
    counts as `completed`, the rest of its allocation as `lost_ledger` (docs/report.md).
    Any other job's hours go to its outcome whatever its ledger says."""
    ledger = ledger or {}
    kinds = _OUTCOMES + (("lost_ledger",) if ledger else ())
    split = 0
    gpu_h = dict.fromkeys(kinds, 0.0)
    node_h = dict.fromkeys(kinds, 0.0)
    count = dict.fromkeys(kinds, 0)
    no_times = 0
    for j in jobs:
        kind = _outcome(j)
        count[kind] += 1
        # Only a job Slurm saw complete may be split by its ledger: the owner's events never
        # make a failed job's hours goodput.
        if j.job_id in ledger and slurm_clean(j):
            split += 1
            productive, allocated = ledger[j.job_id]
            productive = min(productive, allocated)
            parts = [("completed", productive), ("lost_ledger", max(0.0, allocated - productive))]
        elif math.isnan(j.start) or math.isnan(j.end):
            no_times += 1
            continue
        else:
            parts = [(kind, max(0.0, min(j.end, now) - max(j.start, since)))]
        gpus = sum(gpus_of.get(n, 0) for n in j.nodes)
        for part, secs in parts:
            node_h[part] += secs * len(j.nodes) / 3600.0
            gpu_h[part] += secs * gpus / 3600.0
    total_g, total_n = sum(gpu_h.values()), sum(node_h.values())

    def share(*parts: str) -> float | None:
        # with no GPU classes (the CPU dev cluster) the percentages come from node hours
        if total_g > 0:
            return pct(sum(gpu_h[p] for p in parts), total_g)
        return pct(sum(node_h[p] for p in parts), total_n)

    return {
        "jobs": len(jobs), "jobs_by_outcome": count, "jobs_without_times": no_times,
        "jobs_with_ledger": split,
        "gpu_hours": {k: round(v, 2) for k, v in gpu_h.items()},
        "node_hours": {k: round(v, 2) for k, v in node_h.items()},
        "gpu_hours_total": round(total_g, 2), "node_hours_total": round(total_n, 2),
        "basis": "gpu_hours" if total_g > 0 else "node_hours",
        "goodput_pct": share("completed"),
        "goodput_upper_pct": share("completed", "signalled"),
        "lost_to_nodes_pct": share("lost_node"),
    }


# ---------------------------------------------------------------------------------- ledgers


def contradiction(j: JobFacts) -> str | None:
    """Why a job's goodput events contradict what Slurm saw of it (the hooks' record of its
    exit status), or None: a record whose last launch ended cleanly (`ok`) for a job Slurm
    saw fail or end by a signal, or whose end Slurm did not report. A record that agrees, or
    says nothing of the end, passes."""
    if slurm_clean(j) or not j.goodput:
        return None
    outcome = _outcome(j)
    last = max(j.goodput, key=lambda r: int(r["restart"]))
    ends = [la["end"] for la in last["launches"] if la.get("end") is not None]
    if ends and ends[-1]["kind"] == StepEnd.OK.value:
        return (f"job {j.job_id}: its goodput events end in a clean exit, Slurm saw the job "
                f"{outcome.replace('_', ' ')} (exit {j.exit_code}, signal {j.exit_signal}"
                f"{', lost ' + ','.join(j.lost) if j.lost else ''}): ledger left out")
    return None


def build_ledgers(jobs: list[JobFacts], gpus_of: Mapping[str, int],
                  refused: list[dict[str, Any]] | None = None) -> Built:
    """The goodput ledger (bluevela/report/goodput.py) of every job with supervisor events,
    with its GPUs per node. A job whose events contradict Slurm's outcome (`contradiction`)
    gets none; it is added to `refused` (job id and why) when given."""
    from bluevela.report import goodput as G
    from bluevela.report.goodput_bounds import Allocation

    out: Built = []
    for j in jobs:
        if not j.goodput:
            continue
        why = contradiction(j)
        if why is not None:
            logger.warning("%s", why)
            if refused is not None:
                refused.append({"job_id": j.job_id, "why": why})
            continue
        attempts = [{"restart": k, "first_prolog_unix_s": None if math.isnan(a.first_prolog)
                     else a.first_prolog, "last_epilog_unix_s": None if math.isnan(a.last_epilog)
                     else a.last_epilog} for k, a in sorted(j.attempts.items())]
        gpus = max((gpus_of.get(n, 0) for n in j.nodes), default=0)
        alloc = Allocation(j.num_nodes, frozenset(j.nodes),
                           None if math.isnan(j.start) else j.start,
                           None if math.isnan(j.end) else j.end)
        # restart -> nodes whose prolog came and epilog never did (a batch node among them:
        # its loss, from the copy of its events another node kept)
        lost = ({k: a.prolog_nodes - a.epilog_nodes for k, a in j.attempts.items()}
                if j.attempts else {0: set(j.lost)})
        try:
            led = G.build_ledger(j.job_id, j.goodput, attempts, gpus_per_node=gpus,
                                 alloc=alloc, lost=lost)
        except ValueError as exc:
            logger.warning("no ledger for job %d: %s", j.job_id, exc)
            continue
        out.append((j, led, gpus))
    return out


def hooks_saw_go(j: JobFacts, restart: int) -> set[str]:
    """The nodes the hooks saw leave attempt `restart` of job `j`: its prolog of that attempt
    came, its epilog never did (a job without restart counts: its `lost` nodes)."""
    if j.attempts:
        a = j.attempts.get(restart)
        return set() if a is None else a.prolog_nodes - a.epilog_nodes
    return set(j.lost) if restart == 0 else set()


def ledger_failures(built: Built, events: list[Event], passing: Mapping[str, list[float]],
                    since: float, now: float) -> list[Event]:
    """The node failures the jobs' ledgers saw (a lost node: `node failure: <node>`) that the
    hooks confirm and that no other event already counts, as events of source `ledger` (pure).

    A ledger is the job owner's account: a node it names as lost counts only when the hooks
    saw that node leave the attempt (`hooks_saw_go`); a node whose epilog of that attempt came
    (the hooks found it there after the job) is no failure of the fleet's, whatever the
    record says (a CRITICAL epilog is one already, as the hooks' own event).

    One failure is counted once: a ledger's failure of a node is the same as an event of that
    node (a drain, a CRITICAL report, the job's "node lost", another ledger's) of the same
    job's lost node, within SAME_FAILURE_S of it, or in the same incident (no passing prolog
    of the node between them).
    """
    by_node: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.node:
            by_node[e.node].append(e)
    out: list[Event] = []
    for j, led, _ in built:
        for intr in led.interruptions:
            t = intr.at if intr.at is not None else (j.end if not math.isnan(j.end) else j.start)
            if intr.kind != "lost" or math.isnan(t) or not since <= t <= now:
                continue
            gone = hooks_saw_go(j, intr.restart)
            for node in intr.nodes:
                if node not in gone:
                    continue
                if _counted(by_node[node], passing.get(node, []), j.job_id, t):
                    continue
                ev = Event(t, node, "ledger", LEDGER_FAILURE, False, j.job_id,
                           f"the goodput ledger of job {j.job_id}: {intr.cause}")
                by_node[node].append(ev)
                out.append(ev)
    return out


def _counted(node_events: list[Event], passing: list[float], job_id: int, t: float) -> bool:
    """Whether a ledger's failure of a node at `t` is one of `node_events` already."""
    ret = bisect.bisect_right(passing, t)
    return any((e.job_id == job_id and e.cause in (NODE_LOST, LEDGER_FAILURE))
               or abs(e.time - t) <= SAME_FAILURE_S
               or bisect.bisect_right(passing, e.time) == ret for e in node_events)


def _ledger_row(j: JobFacts, led: Ledger, cls: str, spare_h: float,
                advice: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": j.job_id, "nodes": led.nodes, "class": cls,
            "wall_h": round(led.wall_s / 3600.0, 4),
            "ettr_pct": pct(led.phases["productive"], led.wall_s),
            "phases_h": {k: round(v / 3600.0, 4) for k, v in led.phases.items()},
            "spares": led.spares, "idle_spare_h": round(spare_h, 4),
            "interruptions": [{"attempt": i.attempt, "cause": i.cause,
                               "nodes": i.nodes, "redone_s": round(i.redone_s, 2),
                               "lost_s": round(i.lost_s, 2)}
                              for i in led.interruptions],
            "checkpoint_cost_s": led.checkpoint_mean_s,
            "checkpoint_interval_s": led.checkpoint_interval_s,
            "advice": advice,
            "spares_advice": advice.get("spares")}


def ledger_figures(built: Built, class_of: Mapping[str, str],
                   classes_out: list[dict[str, Any]]) -> dict[str, Any]:
    """The ledgers' figures: ETTR per job and by job size, hours lost by phase and by cause,
    and the checkpoint interval / spare advice from the fleet's MTBF of the job's node class
    (which counts the ledgers' own node failures). `_hours`: job -> (productive s,
    allocated s), for `goodput_hours`."""
    from bluevela.report import goodput as G
    from bluevela.report.goodput_advice import advise

    mtbf = {r["class"]: (r["mtbf_h"], r["incidents"]) for r in classes_out}
    rows: list[dict[str, Any]] = []
    by_size: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    phase_h: dict[str, float] = dict.fromkeys((*G.PHASES, G.IDLE_SPARE), 0.0)
    cause_h: defaultdict[str, float] = defaultdict(float)
    hours: dict[int, tuple[float, float]] = {}
    for j, led, gpus in built:
        hours[j.job_id] = (led.phases["productive"], led.wall_s - led.phases["queue_hold"])
        unit = led.nodes * (gpus if gpus > 0 else 1) / 3600.0  # GPU (or node) hours per s
        for k, v in led.phases.items():
            phase_h[k] += v * unit
        spare_h = led.spare_node_s * (gpus if gpus > 0 else 1) / 3600.0
        phase_h[G.IDLE_SPARE] += spare_h
        for intr in led.interruptions:
            cause_h[intr.cause.split(" (")[0]] += intr.lost_s * unit
        cls = class_of.get(j.nodes[0], UNKNOWN_CLASS) if j.nodes else UNKNOWN_CLASS
        node_mtbf_h, incidents = mtbf.get(cls, (None, 0))
        b = by_size[_size_bucket(led.nodes)]
        b[0] += led.phases["productive"] * unit
        b[1] += led.wall_s * unit + spare_h
        b[2] += 1
        rows.append(_ledger_row(j, led, cls, spare_h, advise(led, node_mtbf_h, int(incidents))))
    total = sum(phase_h.values())
    return {
        "jobs": len(rows), "basis": "gpu_hours" if any(g > 0 for _, _, g in built)
        else "node_hours",
        "ettr_pct": pct(phase_h["productive"], total) if total else None,
        "hours_by_phase": {k: round(v, 4) for k, v in phase_h.items()},
        "hours_lost_by_cause": dict(sorted(((k, round(v, 4)) for k, v in cause_h.items()),
                                           key=lambda kv: -kv[1])),
        "by_size": [{"nodes": k, "jobs": int(v[2]), "ettr_pct": pct(v[0], v[1])}
                    for k, v in sorted(by_size.items(), key=lambda kv: _size_key(kv[0]))],
        "per_job": rows,
        "_hours": hours,
    }


def _size_bucket(n: int) -> str:
    lo = 1
    for b in SIZE_BUCKETS:
        if n <= b:
            return f"{lo}-{b}" if lo != b else str(b)
        lo = b + 1
    return f">{SIZE_BUCKETS[-1]}"


def _size_key(label: str) -> int:
    return int(label.lstrip(">").split("-")[0])
