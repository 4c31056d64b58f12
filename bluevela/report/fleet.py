"""The fleet reliability report: interruptions by cause, MTBF, worst nodes, return to service,
and goodput, computed from the run archive and the nightly store (`bv report fleet`).

Gather, then compute: `fleet_gather.gather()` reads only the columns it needs from the
archive segments and the nightly records into `FleetFacts` (`fleet_facts`); `compute()` here
is a pure function of those facts, the node classes and the time window, and returns a
JSON-able dict (goodput and the jobs' ledgers in `fleet_goodput`). Every figure and its
approximations are defined in docs/report.md; in short:

- An *event* is one node-level failure signal: a prolog or epilog report whose health was
  CRITICAL, a node lost during a job (the job's nodelist names it, its prolog passed, its
  epilog never came), a nightly CRITICAL verdict, or a node failure only a job's goodput
  ledger saw.
- An *incident* groups one node's consecutive events up to its next passing prolog report (the
  node ran a job again): a drain found again by the nightly is one failure, not two.
- Time to return to service of an incident that took the node out (a drain, or a lost node) runs
  from its first event to the node's next passing prolog report. The archive holds no resume
  event, so this is an upper bound: it includes the idle time before the next job landed there.
- MTBF of a node = (window hours - hours out of service) / incidents; of a class or the fleet =
  the sum of in-service hours of its nodes / the sum of their incidents.
- Goodput: GPU hours of the jobs that ended in the window, split by how they ended.

h5py and numpy are imported inside the functions (the CLI imports this module lazily anyway).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import ArchiveError
from bluevela.report.fleet_facts import (
    NODE_LOST,
    REQUEUE,
    UNKNOWN_CLASS,
    Event,
    FleetFacts,
    JobFacts,
    NodeClassInfo,
    classes_of,
)
from bluevela.report.fleet_gather import gather
from bluevela.report.fleet_goodput import (
    build_ledgers,
    goodput_hours,
    ledger_failures,
    ledger_figures,
)

if TYPE_CHECKING:
    from bluevela.site import Site

logger = logging.getLogger(__name__)

FORMAT = "bluevela-fleet-report"
SCHEMA_VERSION = 1


def iso(ts: float | None) -> str | None:
    if ts is None or math.isnan(ts):
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _h(seconds: float) -> float:
    return round(seconds / 3600.0, 3)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


# ---------------------------------------------------------------------------------- requeues


def _job_events(jobs: list[JobFacts], since: float, now: float) -> tuple[list[Event], dict[str, Any]]:
    """Lost nodes and requeues: exact from the restart counts the reports carry (a job with
    restarts > 0), else guessed from the jobs' node rows (archives and hooks without them)."""
    events: list[Event] = []
    req: dict[str, Any] = {"jobs_requeued": 0, "requeues_min": 0, "by_cause": Counter(),
                           "requeues": 0, "jobs_exact": 0, "jobs_heuristic": 0,
                           "attempts": 0, "requeue_gap_h": 0.0}
    for j in jobs:
        when = j.end if not math.isnan(j.end) else j.start
        if math.isnan(when):
            continue
        when = min(max(when, since), now)
        for n in j.lost:
            events.append(Event(when, n, "job", NODE_LOST, False, j.job_id,
                                "in the job's nodelist, prolog passed, no epilog report"))
        if j.restarts:
            _exact_requeues(j, req, events, since, now)
        elif j.prolog_failed or j.expected > j.num_nodes > 0:
            _guessed_requeue(j, req, events, since, now, when)
    req["by_cause"] = dict(sorted(req["by_cause"].items()))
    req["requeue_gap_h"] = round(req["requeue_gap_h"], 3)
    return events, req


def _guessed_requeue(j: JobFacts, req: dict[str, Any], events: list[Event], since: float,
                     now: float, when: float) -> None:
    """A job without restart counts whose prolog failed somewhere or that ran on more nodes
    than it asked for: requeued at least once."""
    req["jobs_requeued"] += 1
    req["jobs_heuristic"] += 1
    req["requeues_min"] += max(len(j.prolog_failed), 1)
    if j.prolog_failed:
        req["by_cause"]["prolog failure"] += len(j.prolog_failed)
    elif j.lost:
        req["by_cause"][NODE_LOST] += 1
    else:
        req["by_cause"]["unknown"] += 1
        start = j.start if not math.isnan(j.start) else when
        events.append(Event(min(max(start, since), now), "", "job", REQUEUE, False,
                            j.job_id, "ran on more nodes than it asked for, no node failed"))


def _exact_requeues(j: JobFacts, req: dict[str, Any], events: list[Event], since: float,
                    now: float) -> None:
    """A job whose reports carry restart counts: `restarts` requeues, each one's cause from
    the attempt it ended (a CRITICAL prolog: prolog failure; a node whose prolog came and
    epilog did not: node lost; else requeue, e.g. an operator's or a preemption), and the gap
    from each attempt's last epilog to the next one's first prolog."""
    req["jobs_requeued"] += 1
    req["jobs_exact"] += 1
    req["requeues"] += j.restarts
    req["requeues_min"] += j.restarts
    req["attempts"] += j.restarts + 1
    for k in range(1, j.restarts + 1):
        prev, cur = j.attempts.get(k - 1), j.attempts.get(k)
        if prev is not None and prev.prolog_failed:
            req["by_cause"]["prolog failure"] += 1
        elif prev is not None and prev.prolog_nodes - prev.epilog_nodes:
            req["by_cause"][NODE_LOST] += 1
        else:
            req["by_cause"][REQUEUE] += 1
            t = math.nan if prev is None else (
                prev.last_epilog if not math.isnan(prev.last_epilog) else prev.first_prolog)
            if not math.isnan(t):
                events.append(Event(min(max(t, since), now), "", "job", REQUEUE, False,
                                    j.job_id, f"requeued after attempt {k - 1}, no node "
                                    "failed"))
        if prev is not None and cur is not None and not (
                math.isnan(prev.last_epilog) or math.isnan(cur.first_prolog)):
            req["requeue_gap_h"] += max(0.0, cur.first_prolog - prev.last_epilog) / 3600.0


# --------------------------------------------------------------------------------- incidents


@dataclass
class _Incident:
    node: str
    start: float
    events: list[Event]
    returned: float | None  # the node's next passing prolog, None: not (yet) in the window

    @property
    def out_of_service(self) -> bool:
        return any(e.drained or e.cause == NODE_LOST for e in self.events)


def _incidents(events: list[Event], passing: Mapping[str, list[float]]) -> list[_Incident]:
    by_node: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.node:
            by_node[e.node].append(e)
    out: list[_Incident] = []
    for node, evs in by_node.items():
        evs.sort(key=lambda e: e.time)
        times = passing.get(node, [])
        current: _Incident | None = None
        for e in evs:
            i = bisect.bisect_right(times, e.time)
            ret = times[i] if i < len(times) else None
            if current is not None and current.returned == ret:
                current.events.append(e)
                continue
            current = _Incident(node, e.time, [e], ret)
            out.append(current)
    return out


@dataclass
class _Service:
    """Each node's incidents, time out of service and returns, over the window."""

    per_node: dict[str, dict[str, Any]] = field(default_factory=dict)
    out_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ttrs: list[float] = field(default_factory=list)  # hours to return to service
    still_out: list[str] = field(default_factory=list)


def _service(incidents: list[_Incident], since: float, now: float) -> _Service:
    s = _Service()
    for inc in incidents:
        d = s.per_node.setdefault(inc.node, {"incidents": 0, "events": 0, "causes": Counter(),
                                             "last": 0.0, "out_now": False})
        d["incidents"] += 1
        d["events"] += len(inc.events)
        d["causes"].update(e.cause for e in inc.events)
        d["last"] = max(d["last"], inc.events[-1].time)
        if not inc.out_of_service:
            continue
        back = inc.returned if inc.returned is not None else now
        s.out_s[inc.node] += max(0.0, min(back, now) - max(inc.start, since))
        if inc.returned is None:
            d["out_now"] = True
            s.still_out.append(inc.node)
        else:
            s.ttrs.append((inc.returned - inc.start) / 3600.0)
    return s


def _node_rows(s: _Service, class_of: Mapping[str, str], window_s: float
               ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for node in sorted(s.per_node):
        d = s.per_node[node]
        in_s = max(0.0, window_s - s.out_s[node])
        rows.append({
            "node": node, "class": class_of.get(node, UNKNOWN_CLASS),
            "incidents": d["incidents"], "events": d["events"],
            "mtbf_h": _h(in_s / d["incidents"]) if d["incidents"] else None,
            "out_of_service_h": _h(s.out_s[node]),
            "causes": dict(sorted(d["causes"].items())), "last_failure_utc": iso(d["last"]),
            "out_now": d["out_now"],
        })
    return rows


def _class_rows(fleet: set[str], s: _Service, classes: Mapping[str, NodeClassInfo],
                class_of: Mapping[str, str], window_s: float) -> list[dict[str, Any]]:
    by_class: dict[str, dict[str, Any]] = {}
    for node in fleet:
        c = class_of.get(node, UNKNOWN_CLASS)
        row = by_class.setdefault(c, {"class": c, "nodes": 0, "incidents": 0,
                                      "in_service_h": 0.0, "out_of_service_h": 0.0,
                                      "nodes_failed": 0,
                                      "gpus_per_node": classes[c].gpus if c in classes else 0})
        row["nodes"] += 1
        n_inc = s.per_node.get(node, {}).get("incidents", 0)
        row["incidents"] += n_inc
        row["nodes_failed"] += 1 if n_inc else 0
        row["in_service_h"] += max(0.0, window_s - s.out_s[node]) / 3600.0
        row["out_of_service_h"] += s.out_s[node] / 3600.0
    out = []
    for c in sorted(by_class):
        row = by_class[c]
        row["mtbf_h"] = round(row["in_service_h"] / row["incidents"], 3) if row["incidents"] \
            else None
        row["in_service_h"] = round(row["in_service_h"], 2)
        row["out_of_service_h"] = round(row["out_of_service_h"], 2)
        out.append(row)
    return out


# ----------------------------------------------------------------------------------- compute


def _interruptions(events: list[Event]) -> dict[str, Any]:
    causes = Counter((e.cause, e.source) for e in events)
    by_day = Counter((datetime.fromtimestamp(e.time, tz=UTC).strftime("%Y-%m-%d"), e.cause)
                     for e in events)
    return {
        "total": len(events),
        "by_cause": [{"cause": c, "source": s, "count": n}
                     for (c, s), n in sorted(causes.items(), key=lambda kv: (-kv[1], kv[0]))],
        "by_source": dict(sorted(Counter(e.source for e in events).items())),
        "by_day": [{"day": d, "cause": c, "count": n} for (d, c), n in sorted(by_day.items())],
    }


def _return_to_service(s: _Service) -> dict[str, Any]:
    ttrs = s.ttrs
    return {
        "incidents_out_of_service": len(ttrs) + len(s.still_out), "returned": len(ttrs),
        "still_out": len(s.still_out), "median_h": _quantile(ttrs, 0.5),
        "p90_h": _quantile(ttrs, 0.9), "max_h": round(max(ttrs), 3) if ttrs else None,
        "hours": sorted(round(t, 3) for t in ttrs),
    }


def compute(facts: FleetFacts, *, since: float, now: float,
            classes: Mapping[str, NodeClassInfo], top: int = 20) -> dict[str, Any]:
    """The report (a JSON-able dict) from gathered facts. Pure: no I/O, no clock.

    Args:
        facts: what `gather` read for the window.
        since, now: the window, unix seconds.
        classes: node class name -> hosts and GPUs per node (site.yaml `node_classes`); the
            fleet is every node of every class plus every node seen in the archive.
        top: rows of the worst-nodes table.
    """
    window_s = max(0.0, now - since)
    class_of = {n: name for name, info in classes.items() for n in info.nodes}
    gpus_of = {n: classes[c].gpus for n, c in class_of.items()}
    job_events, requeues = _job_events(facts.jobs, since, now)
    events = [*facts.events, *job_events]
    refused: list[dict[str, Any]] = []
    built = build_ledgers(facts.jobs, gpus_of, refused)
    # The ledgers' node failures count in the MTBF the advice uses, once each.
    events += ledger_failures(built, events, facts.passing_prologs, since, now)
    events.sort(key=lambda e: (e.time, e.node, e.source))
    incidents = _incidents(events, facts.passing_prologs)
    fleet = set(class_of) | facts.nodes_seen | {e.node for e in events if e.node}
    s = _service(incidents, since, now)
    nodes_out = _node_rows(s, class_of, window_s)
    worst = sorted(nodes_out, key=lambda r: (-r["incidents"], -r["out_of_service_h"], r["node"]))
    classes_out = _class_rows(fleet, s, classes, class_of, window_s)
    total_in = sum(r["in_service_h"] for r in classes_out)
    total_inc = sum(r["incidents"] for r in classes_out)
    ledger = ledger_figures(built, class_of, classes_out)
    ledger["refused"] = refused
    return {
        "format": FORMAT, "schema_version": SCHEMA_VERSION,
        "window": {"since_unix_s": since, "now_unix_s": now, "since_utc": iso(since),
                   "now_utc": iso(now), "hours": _h(window_s)},
        "sources": {"reports": facts.reports, "jobs": len(facts.jobs),
                    "segments": facts.segments, "nights": facts.nights},
        "fleet": {"nodes": len(fleet), "nodes_failed": len(s.per_node),
                  "incidents": len(incidents), "events": sum(1 for e in events if e.node),
                  "mtbf_h": round(total_in / total_inc, 3) if total_inc else None,
                  "out_of_service_h": round(sum(s.out_s.values()) / 3600.0, 2),
                  "out_now": sorted(set(s.still_out))},
        "interruptions": _interruptions(events),
        "requeues": requeues,
        "mtbf": {"by_class": classes_out, "nodes_without_failure": len(fleet) - len(s.per_node)},
        "worst_nodes": worst[:top],
        "nodes": nodes_out,
        "return_to_service": _return_to_service(s),
        "goodput": goodput_hours(facts.jobs, gpus_of, since, now, ledger.pop("_hours")),
        "ledger": ledger,
    }


def fleet_report(archive_dir: Path, *, since: float, now: float | None = None,
                 site: Site | None = None, top: int = 20) -> dict[str, Any]:
    """Gather and compute the report for [since, now] (now defaults to the current time).

    Raises:
        ArchiveError: the archive is missing or unreadable, or the window is empty.
    """
    import time

    now = time.time() if now is None else now
    if since >= now:
        raise ArchiveError(f"--since {iso(since)} is not before now ({iso(now)})")
    facts = gather(archive_dir, since, now,
                   prefix=site.health.drain_prefix if site is not None else "bv:")
    return compute(facts, since=since, now=now, classes=classes_of(site), top=top)


__all__ = ["FORMAT", "compute", "fleet_report", "iso"]
