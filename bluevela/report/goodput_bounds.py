"""The goodput events held to the allocation (bluevela/report/goodput.py's input). The events
are the job owner's own words (bluevela/goodput/events.py): before the ledger uses a record,
every time, node count and node name in it is clamped to what the archive (root's hooks)
saw of the job, and a note says what was changed (docs/resilience.md, "The goodput ledger").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bluevela.goodput.events import T_MAX, T_MIN
from bluevela.goodput.outcome import LossKind


def slurm_submit(report: Mapping[str, Any]) -> float | None:
    """Slurm's submit time of the attempt a node report ends, as root's epilog read it
    (`slurm_job.submit`: bluevela/slurm/job_record.py), or None when the report has none
    (an older report, Slurm not answered) or it is not a unix time."""
    sj = report.get("slurm_job")
    t = sj.get("submit") if isinstance(sj, Mapping) else None
    if isinstance(t, bool) or not isinstance(t, int | float):
        return None
    t = float(t)
    return t if math.isfinite(t) and T_MIN <= t <= T_MAX else None


def with_slurm_submit(rec: dict[str, Any], submit: float | None) -> dict[str, Any]:
    """`rec` with Slurm's submit time (`slurm_submit`) in place of its own, when there is one:
    the queue wait starts where Slurm says, never where the job's owner wrote (issue 33)."""
    if submit is None:
        return rec
    return {**rec, "slurm": {**rec["slurm"], "submit": submit}}


# The slack covers the prolog's run before its report's time stamp and the epilog's after
# the job, and clock skew.
CLOCK_SLACK_S = 120.0
# The submission: Slurm's, as the epilog read it, replaces the record's (`with_slurm_submit`);
# a record's own (no report has Slurm's) is at most this long before the attempt's first
# prolog.
MAX_QUEUE_S = 7 * 86400.0


@dataclass(frozen=True)
class Allocation:
    """What root's hooks reported of a job (never the job's owner): Slurm's node count, the
    node names of its reports and nodelists, and its first prolog / last epilog times."""

    num_nodes: int
    nodes: frozenset[str]
    start: float | None
    end: float | None


def allocation_of(job: dict[str, Any]) -> Allocation:
    """The `Allocation` of a `query.show_job` result."""
    nodes = frozenset(str(n.get("node")) for n in job.get("nodes") or [] if n.get("node"))
    return Allocation(int(job.get("num_nodes") or 0), nodes, job.get("start_unix_s"),
                      job.get("end_unix_s"))


@dataclass
class _Clamp:
    """One attempt's bounds: times within [lo, hi], names of the allocation's nodes, and
    what had to be changed to get there (`changed`: the kinds of field, for the notes)."""

    alloc: Allocation
    lo: float
    hi: float
    changed: set[str] = field(default_factory=set)

    def t(self, value: float | None, what: str, low: float | None = None) -> float | None:
        if value is None:
            return None
        out = min(max(value, self.lo if low is None else low), self.hi)
        if out != value:
            self.changed.add(what)
        return out

    def names(self, values: list[str], what: str) -> list[str]:
        nodes = self.alloc.nodes
        kept = [n for n in values if n in nodes] if nodes else list(values)
        if len(kept) != len(values):
            self.changed.add(what)
        return kept


def bound_record(rec: dict[str, Any], alloc: Allocation, lo: float | None, hi: float | None
                 ) -> tuple[dict[str, Any], list[str]]:
    """A validated record clamped to the job's allocation: every time within the attempt's
    first prolog (`lo`) and last epilog (`hi`) +- CLOCK_SLACK_S (the submission at most
    MAX_QUEUE_S before), node counts at most Slurm's, node names only the job's (a cause may
    name no other node), spares at most Slurm's count less the training nodes. Returns the
    clamped copy and a note per change.

    Raises:
        ValueError: the archive has no time of the attempt to hold the record to.
    """
    lo = lo if lo is not None else alloc.start
    hi = hi if hi is not None else alloc.end
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"restart {rec['restart']}: no prolog/epilog time in the archive to "
                         "check its goodput events against")
    c = _Clamp(alloc, min(lo, hi) - CLOCK_SLACK_S, max(lo, hi) + CLOCK_SLACK_S)
    out = dict(rec)
    out["opened"] = c.t(rec["opened"], "times")
    out["requeue"] = c.t(rec["requeue"], "times")
    if rec.get("gone") is not None:
        out["gone"] = c.t(rec["gone"], "times")
    slurm = dict(rec["slurm"])
    slurm["start"] = c.t(slurm["start"], "times")
    slurm["submit"] = c.t(slurm["submit"], "submit time", c.lo - MAX_QUEUE_S)
    if slurm["submit"] is not None:
        slurm["submit"] = min(slurm["submit"], c.hi)
    out["slurm"] = slurm
    out["launches"] = [_bound_launch(la, c) for la in rec["launches"]]
    notes = [f"restart {rec['restart']}: goodput events clamped to the allocation ({what} "
             "outside what the archive saw of the job)" for what in sorted(c.changed)]
    return out, notes


def _bound_launch(la: dict[str, Any], c: _Clamp) -> dict[str, Any]:
    cap = max(c.alloc.num_nodes, len(c.alloc.nodes), 1)
    la = dict(la)
    la["start"] = c.t(la["start"], "times")
    la["first_progress"] = c.t(la["first_progress"], "times")
    if la["n_nodes"] > cap:
        c.changed.add("node count")
    la["n_nodes"] = min(la["n_nodes"], cap)
    spares = min(la["spares"], max(0, cap - la["n_nodes"]))  # spares + training <= Slurm's
    if spares != la["spares"]:
        c.changed.add("spare count")
    la["spares"] = spares
    la["nodes"] = c.names(la["nodes"], "node names")
    la["ckpts"] = [[s, c.t(a, "times"), c.t(b, "times")] for s, a, b in la["ckpts"]]
    la["ckpt_more"] = [la["ckpt_more"][0], min(la["ckpt_more"][1], c.hi - c.lo)]
    if la.get("bgs"):
        la["bgs"] = [[s, c.t(a, "times"), c.t(b, "times"), *n] for s, a, b, *n in la["bgs"]]
    if la.get("bg_more"):
        la["bg_more"] = [la["bg_more"][0], min(la["bg_more"][1], c.hi - c.lo)]
    if la.get("resume") is not None:
        la["resume"] = {**la["resume"], "t0": c.t(la["resume"]["t0"], "times"),
                        "t1": c.t(la["resume"]["t1"], "times")}
    if la["end"] is not None:
        la["end"] = _bound_end(la["end"], c)
    return la


def _bound_end(end: dict[str, Any], c: _Clamp) -> dict[str, Any]:
    end = dict(end)
    for k in ("failed", "detected", "gone"):
        end[k] = c.t(end[k], "times")
    end["nodes"] = c.names(end["nodes"], "cause nodes")
    kept = c.names(list(end["loss_kinds"]), "cause nodes")
    if any(k == LossKind.HUNG.value and n not in kept for n, k in end["loss_kinds"].items()):
        end["cause"] = "hang (the node it named is not one of the job's)"
    end["loss_kinds"] = {n: end["loss_kinds"][n] for n in kept}
    return end
