"""The fleet reliability report: interruptions by cause, MTBF, worst nodes, return to service,
and goodput, computed from the run archive and the nightly store (`bv report fleet`).

Gather, then compute: `gather()` reads only the columns it needs from the archive segments
(numpy, h5py) and the nightly records into `FleetFacts`; `compute()` is a pure function of
those facts, the node classes and the time window, and returns a JSON-able dict. Every figure
and its approximations are defined in docs/report.md; in short:

- An *event* is one node-level failure signal: a prolog or epilog report whose health was
  CRITICAL (cause: the check its drain reason names, `bv: <check>: ...`, else its first
  CRITICAL check), a node lost during a job (the job's nodelist names it, its prolog passed,
  its epilog never came), or a nightly CRITICAL verdict (cause: the failed measurement).
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

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    import numpy as np

    from bluevela.report.goodput import Ledger
    from bluevela.site import Site

logger = logging.getLogger(__name__)

FORMAT = "bluevela-fleet-report"
SCHEMA_VERSION = 1
CRITICAL = 2
UNKNOWN_CLASS = "(no class)"
NODE_LOST = "node lost"
LEDGER_FAILURE = "node failure"  # a lost node only a job's goodput ledger saw
REQUEUE = "requeue"
SIGNAL_NAMES = {9: "SIGKILL", 15: "SIGTERM", 10: "SIGUSR1", 6: "SIGABRT", 11: "SIGSEGV"}


@dataclass(frozen=True)
class Event:
    """One failure signal. `node` is "" for a job-level requeue with no node cause."""

    time: float
    node: str
    source: str  # prolog | epilog | job (node lost, requeue) | nightly
    cause: str  # the check (gpu, ib, ...), nightly measurement, "node lost" or "requeue"
    drained: bool
    job_id: int = 0
    detail: str = ""


@dataclass
class JobFacts:
    """One job (its newest archived revision), as far as the report needs it."""

    job_id: int
    start: float
    end: float
    num_nodes: int
    exit_code: int
    exit_signal: int
    nodes: list[str]  # the nodes it ran on (its nodelist, less nodes whose prolog failed)
    lost: list[str]  # nodes of its nodelist whose prolog passed and whose epilog never came
    prolog_failed: list[str]  # nodes whose prolog failed for it (Slurm requeued the job)
    epilog_critical: list[str]
    expected: int  # nodes named by its nodelists over every attempt
    restarts: int = 0  # the highest restart count (SLURM_JOB_RESTART_COUNT) its reports carry
    #: restart -> its attempt's facts (only for jobs with restarts > 0)
    attempts: dict[int, Attempt] = field(default_factory=dict)
    #: the supervisor's goodput events, one validated record per attempt that has them
    goodput: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Attempt:
    """One attempt (restart count) of a requeued job, from its reports."""

    first_prolog: float = math.nan
    last_epilog: float = math.nan
    prolog_nodes: set[str] = field(default_factory=set)
    epilog_nodes: set[str] = field(default_factory=set)
    prolog_failed: bool = False  # a prolog of this attempt was CRITICAL


@dataclass
class FleetFacts:
    """What the archive and the nightly store hold about the window."""

    events: list[Event] = field(default_factory=list)
    jobs: list[JobFacts] = field(default_factory=list)
    #: node -> sorted times of its passing (not CRITICAL) prolog reports
    passing_prologs: dict[str, list[float]] = field(default_factory=dict)
    nodes_seen: set[str] = field(default_factory=set)
    reports: int = 0
    nights: list[str] = field(default_factory=list)
    segments: int = 0


# ------------------------------------------------------------------------------------ gather


def gather(archive_dir: Path, since: float, now: float, *, nightly: bool = True,
           prefix: str = "bv:") -> FleetFacts:
    """Read the window [since, now] from the archive at `archive_dir` and its nightly store.

    `prefix` is the site's drain prefix (`health.drain_prefix`): a drain reason that starts
    with it names the failed check.

    Raises:
        ArchiveError: the archive is missing or unreadable.
    """
    from bluevela.archive.store import Archive

    archive = Archive(archive_dir)
    facts = archive.read_segments(lambda segs: _gather_segments(segs, since, now, prefix))
    if nightly:
        from bluevela.bench.store import nightly_dir

        _gather_nightly(facts, nightly_dir(Path(archive_dir)), since, now)
    return facts


def _text(value: bytes | str) -> str:
    return value.rstrip(b"\0").decode("utf-8", "replace") if isinstance(value, bytes) else value


def cause_of_reason(reason: str, prefix: str = "bv:") -> str | None:
    """The check a drain reason names: 'bv: ib: mlx5_3/1 DOWN' -> 'ib' (None if not ours)."""
    if not reason.startswith(prefix):
        return None
    name, sep, _ = reason[len(prefix):].strip().partition(":")
    name = name.strip()
    return name if sep and name.isidentifier() else None


def _gather_segments(segs: list[tuple[Any, Path]], since: float, now: float,
                     prefix: str) -> FleetFacts:
    import numpy as np

    from bluevela.archive import schema as S
    from bluevela.archive.store import open_h5

    facts = FleetFacts()
    job_parts: list[np.ndarray] = []
    seg_parts: list[np.ndarray] = []
    jn_parts: dict[int, np.ndarray] = {}
    crit: dict[tuple[int, str, int], tuple[float, str, bool, str]] = {}
    passing: dict[str, list[np.ndarray]] = defaultdict(list)
    jcols = ["job_id", "revision", "num_nodes", "start_unix_s", "end_unix_s",
             "last_report_unix_s", "exit_code", "exit_signal", "node_first", "node_count"]
    attempts: dict[int, dict[int, Attempt]] = defaultdict(dict)
    goodput: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for seg_no, (info, path) in enumerate(segs):
        if info.time_max < since or info.time_min > now:
            continue
        facts.segments += 1
        with open_h5(path) as f:
            rep = f["reports"].fields(["job_id", "phase", "time_unix_s", "health_status",
                                       "drained", "check_first", "check_count"])[()]
            # Segments written before the restart column: every report is attempt 0.
            has_restart = "restart" in (f["reports"].dtype.names or ())
            restart = f["reports"].fields("restart")[()] if has_restart else None
            index = f[S.NODE_INDEX].fields(["node", "report_first", "report_count"])[()]
            names = [_text(n) for n in index["node"]]
            node_of = np.empty(len(rep), dtype=np.int64)
            for i, (first, count) in enumerate(zip(index["report_first"].tolist(),
                                                   index["report_count"].tolist(), strict=True)):
                node_of[first:first + count] = i
            facts.nodes_seen.update(names)
            in_win = (rep["time_unix_s"] >= since) & (rep["time_unix_s"] <= now)
            facts.reports += int(in_win.sum())
            is_crit = rep["health_status"] == CRITICAL
            pro_ok = in_win & ~is_crit & (rep["phase"] == S.PHASE_CODES["prolog"])
            times = rep["time_unix_s"]
            for i, (first, count) in enumerate(zip(index["report_first"].tolist(),
                                                   index["report_count"].tolist(), strict=True)):
                ok = times[first:first + count][pro_ok[first:first + count]]
                if len(ok):
                    passing[names[i]].append(ok)
            rows = np.flatnonzero(is_crit & in_win).tolist()
            if rows:
                reasons = f["reports"].fields("drain_reason")[rows]
                for row, reason in zip(rows, reasons, strict=True):
                    r = rep[row]
                    why = _text(reason)
                    cause = cause_of_reason(why, prefix) or _first_critical_check(
                        f, int(r["check_first"]), int(r["check_count"]))
                    phase = S.PHASE_NAMES[int(r["phase"])]
                    crit[(int(r["job_id"]), names[node_of[row]], int(r["phase"]))] = (
                        float(r["time_unix_s"]), cause, bool(r["drained"]), why)
                    facts.events.append(Event(float(r["time_unix_s"]), names[node_of[row]],
                                              phase, cause, bool(r["drained"]),
                                              int(r["job_id"]), why))
            if restart is not None and bool((restart > 0).any()):
                _gather_attempts(attempts, rep, restart, node_of, names)
            _gather_goodput(goodput, f, rep, in_win, names, node_of)
            jobs = _with_restarts(f, jcols)
            job_parts.append(jobs)
            seg_parts.append(np.full(len(jobs), seg_no))
            jn = f["job_nodes"].fields(["job_id", "node", "expected", "has_prolog",
                                        "has_epilog"])[()]
            jn_parts[seg_no] = jn
    facts.passing_prologs = {n: sorted(np.concatenate(p).tolist()) for n, p in passing.items()}
    if job_parts:
        _fold_jobs(facts, np.concatenate(job_parts), np.concatenate(seg_parts), jn_parts, crit,
                   since, now)
    for j in facts.jobs:
        if j.restarts:
            j.attempts = attempts.get(j.job_id, {})
        j.goodput = list(goodput.get(j.job_id, {}).values())
    facts.events.sort(key=lambda e: (e.time, e.node, e.source))
    return facts


def _with_restarts(f: Any, jcols: list[str]) -> np.ndarray:
    """The /jobs columns `jcols` plus `restarts` (0 in a file written before that column)."""
    import numpy as np

    ds = f["jobs"]
    if "restarts" in (ds.dtype.names or ()):
        return ds.fields(jcols + ["restarts"])[()]
    jobs = ds.fields(jcols)[()]
    out = np.zeros(len(jobs), dtype=jobs.dtype.descr + [("restarts", "u2")])
    for c in jcols:
        out[c] = jobs[c]
    return out


def _gather_attempts(out: dict[int, dict[int, Attempt]], rep: np.ndarray, restart: np.ndarray,
                     node_of: np.ndarray, names: list[str]) -> None:
    """Per-attempt facts of the jobs of this segment that have a report with restart > 0."""
    import numpy as np

    from bluevela.archive import schema as S

    requeued = np.unique(rep["job_id"][restart > 0])
    rows = np.flatnonzero(np.isin(rep["job_id"], requeued))
    prolog = S.PHASE_CODES["prolog"]
    for i in rows.tolist():
        r = rep[i]
        a = out[int(r["job_id"])].setdefault(int(restart[i]), Attempt())
        t, node = float(r["time_unix_s"]), names[node_of[i]]
        if int(r["phase"]) == prolog:
            a.prolog_nodes.add(node)
            a.first_prolog = t if math.isnan(a.first_prolog) else min(a.first_prolog, t)
            a.prolog_failed |= int(r["health_status"]) == CRITICAL
        else:
            a.epilog_nodes.add(node)
            a.last_epilog = t if math.isnan(a.last_epilog) else max(a.last_epilog, t)


def _gather_goodput(out: dict[int, dict[int, dict[str, Any]]], f: Any, rep: np.ndarray,
                    in_win: np.ndarray, names: list[str], node_of: np.ndarray) -> None:
    """The goodput events (bluevela/launch/events.py) in the window's epilog reports: only
    the rows whose extra JSON names them are decoded, and each record is checked again."""
    import json

    import numpy as np

    from bluevela.archive import schema as S
    from bluevela.launch.events import EventsError, merge_records, validate

    if "extra_json" not in (f["reports"].dtype.names or ()):
        return
    rows = np.flatnonzero(in_win & (rep["phase"] == S.PHASE_CODES["epilog"])).tolist()
    if not rows:
        return
    extra = f["reports"].fields("extra_json")[rows]
    for row, raw in zip(rows, extra, strict=True):
        text = raw if isinstance(raw, bytes) else str(raw).encode()
        if b"goodput_events" not in text:
            continue
        try:
            rec = validate(json.loads(text)["goodput_events"])
        except (ValueError, KeyError, TypeError, EventsError) as exc:
            logger.warning("job %s on %s: goodput events left out: %s",
                           int(rep[row]["job_id"]), names[node_of[row]], exc)
            continue
        node = names[node_of[row]]
        # a copy: another node's (the batch node's) supervisor's events, kept on this one
        if (rec["host"] != node and rec.get("copy_on") != node) \
                or rec["job"] != int(rep[row]["job_id"]):
            continue
        have = out[rec["job"]].get(rec["restart"])
        if have is None or have["host"] == rec["host"]:  # every event once
            out[rec["job"]][rec["restart"]] = merge_records(have, rec)


def _first_critical_check(f: Any, first: int, count: int) -> str:
    if not count:
        return "unknown"
    checks = f["checks"].fields(["name", "status"])[first:first + count]
    for c in checks:
        if int(c["status"]) == CRITICAL:
            return _text(c["name"])
    return "unknown"


def _fold_jobs(facts: FleetFacts, jobs: np.ndarray, segs: np.ndarray,
               jn_parts: dict[int, np.ndarray],
               crit: Mapping[tuple[int, str, int], tuple[float, str, bool, str]],
               since: float, now: float) -> None:
    """Newest revision of each job that ended in the window, with its nodes."""
    import numpy as np

    order = np.lexsort((jobs["revision"], jobs["job_id"]))
    jobs, segs = jobs[order], segs[order]
    last = np.ones(len(jobs), dtype=bool)
    last[:-1] = jobs["job_id"][1:] != jobs["job_id"][:-1]
    jobs, segs = jobs[last], segs[last]
    ended = np.where(np.isnan(jobs["end_unix_s"]), jobs["last_report_unix_s"],
                     jobs["end_unix_s"])
    keep = (ended >= since) & (ended <= now)
    jobs, segs = jobs[keep], segs[keep]
    crit_jobs = {k[0] for k in crit}
    for seg in np.unique(segs).tolist():
        jn = jn_parts[seg]
        uniq, inv = np.unique(jn["node"], return_inverse=True)
        names = [_text(n) for n in uniq]
        expected, has_epilog = jn["expected"].astype(bool), jn["has_epilog"].astype(bool)
        for row in jobs[segs == seg]:
            first, count = int(row["node_first"]), int(row["node_count"])
            sl = slice(first, first + count)
            jid = int(row["job_id"])
            exp = expected[sl]
            ran = [names[k] for k in inv[sl][exp].tolist()]
            pfail: list[str] = []
            ecrit: list[str] = []
            if jid in crit_jobs:
                every = [names[k] for k in inv[sl].tolist()]
                pfail = [n for n in every if (jid, n, 0) in crit]
                ecrit = [n for n in every if (jid, n, 1) in crit]
                ran = [n for n in ran if n not in pfail]
            lost = [names[k] for k in inv[sl][exp & ~has_epilog[sl]].tolist()]
            lost = [n for n in lost if n not in pfail]
            facts.jobs.append(JobFacts(
                jid, float(row["start_unix_s"]), float(row["end_unix_s"]),
                int(row["num_nodes"]), int(row["exit_code"]), int(row["exit_signal"]), ran,
                lost, pfail, ecrit, int(exp.sum()), int(row["restarts"])))


def _gather_nightly(facts: FleetFacts, root: Path, since: float, now: float) -> None:
    """Nightly CRITICAL verdicts in the window, as events (cause: the failed measurement)."""
    from bluevela.bench.store import list_nights, night_path

    lo = datetime.fromtimestamp(since, tz=UTC).strftime("%Y-%m-%d")
    hi = datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%d")
    for night in list_nights(root):
        if not lo <= night <= hi:
            continue
        try:
            events = _night_events(night_path(root, night), night)
        except (OSError, KeyError, ValueError) as exc:
            logger.warning("skipping the nightly record %s: %s", night, exc)
            continue
        facts.nights.append(night)
        facts.events.extend(e for e in events if since <= e.time <= now)
    facts.events.sort(key=lambda e: (e.time, e.node, e.source))


def _night_events(path: Path, night: str) -> list[Event]:
    import h5py

    with h5py.File(path, "r", locking=False) as f:
        when = _night_time(f.attrs.get("finished_utc", ""), f.attrs.get("started_utc", ""),
                           night)
        nodes = f["nodes"].fields(["node", "status", "drained", "culprit"])[()]
        bad = nodes[nodes["status"] == CRITICAL]
        if not len(bad):
            return []
        res = f["results"].fields(["scope", "node", "peer", "measurement", "status"])[()]
        reasons = f["nodes"].fields("reason")[()]
    reason_of = {_text(n): _text(r) for n, r in zip(nodes["node"], reasons, strict=True)}
    failed: dict[str, list[str]] = defaultdict(list)
    for r in res[res["status"] == CRITICAL]:
        scope, node, peer = _text(r["scope"]), _text(r["node"]), _text(r["peer"])
        m = _text(r["measurement"])
        if scope == "node":
            failed[node].append(m)
        else:
            failed.setdefault(f"pair:{node}", []).append(m)
            failed.setdefault(f"pair:{peer}", []).append(m)
    out = []
    for row in bad:
        node = _text(row["node"])
        causes = failed.get(node) or failed.get(f"pair:{node}") or ["nightly"]
        out.append(Event(when, node, "nightly", sorted(set(causes))[0], bool(row["drained"]),
                         0, reason_of.get(node, "")))
    return out


def _night_time(finished: Any, started: Any, night: str) -> float:
    for v in (finished, started):
        s = _text(v) if isinstance(v, bytes | str) else ""
        if s:
            try:
                dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
                return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()
            except ValueError:
                pass
    return datetime.fromisoformat(night).replace(tzinfo=UTC).timestamp()


# ------------------------------------------------------------------------------------ compute


@dataclass(frozen=True)
class NodeClassInfo:
    """A node class as the report needs it: its hosts and GPUs per node."""

    nodes: frozenset[str]
    gpus: int


def classes_of(site: Site | None) -> dict[str, NodeClassInfo]:
    """site.yaml's node classes (empty without a site: every node is then in no class)."""
    if site is None:
        return {}
    return {name: NodeClassInfo(frozenset(c.hostnames), int(c.gpus))
            for name, c in site.node_classes.items()}


def iso(ts: float | None) -> str | None:
    if ts is None or math.isnan(ts):
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


def _h(seconds: float) -> float:
    return round(seconds / 3600.0, 3)


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 2) if whole > 0 else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


@dataclass
class _Incident:
    node: str
    start: float
    events: list[Event]
    returned: float | None  # the node's next passing prolog, None: not (yet) in the window

    @property
    def out_of_service(self) -> bool:
        return any(e.drained or e.cause == NODE_LOST for e in self.events)


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
            continue
        moved = j.expected > j.num_nodes > 0
        if not (j.prolog_failed or moved):
            continue
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
    req["by_cause"] = dict(sorted(req["by_cause"].items()))
    req["requeue_gap_h"] = round(req["requeue_gap_h"], 3)
    return events, req


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
            if prev is not None:
                t = prev.last_epilog if not math.isnan(prev.last_epilog) else prev.first_prolog
                if not math.isnan(t):
                    events.append(Event(min(max(t, since), now), "", "job", REQUEUE, False,
                                        j.job_id, f"requeued after attempt {k - 1}, no node "
                                        "failed"))
        if prev is not None and cur is not None and not (
                math.isnan(prev.last_epilog) or math.isnan(cur.first_prolog)):
            req["requeue_gap_h"] += max(0.0, cur.first_prolog - prev.last_epilog) / 3600.0


def _incidents(events: list[Event], passing: Mapping[str, list[float]]) -> list[_Incident]:
    import bisect

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


def _goodput(jobs: list[JobFacts], gpus_of: Mapping[str, int], since: float,
             now: float, ledger: Mapping[int, tuple[float, float]] | None = None
             ) -> dict[str, Any]:
    """GPU hours by how each job ended. A job with a goodput ledger (`ledger`: job ->
    productive and allocated seconds) is split by it instead: its productive time counts
    as `completed`, the rest of its allocation as `lost_ledger` (docs/report.md)."""
    ledger = ledger or {}
    kinds = ("completed", "signalled", "failed", "lost_node", "unknown") \
        + (("lost_ledger",) if ledger else ())
    gpu_h = dict.fromkeys(kinds, 0.0)
    node_h = dict.fromkeys(kinds, 0.0)
    count = dict.fromkeys(kinds, 0)
    no_times = 0
    for j in jobs:
        if j.job_id in ledger:
            productive, allocated = ledger[j.job_id]
            gpus = sum(gpus_of.get(n, 0) for n in j.nodes)
            for part, secs in (("completed", productive),
                               ("lost_ledger", max(0.0, allocated - productive))):
                node_h[part] += secs * len(j.nodes) / 3600.0
                gpu_h[part] += secs * gpus / 3600.0
        if j.lost or (j.epilog_critical and (j.exit_code > 0 or j.exit_signal > 0)):
            kind = "lost_node"
        elif j.exit_code < 0 and j.exit_signal < 0:
            kind = "unknown"
        elif j.exit_code > 0:
            kind = "failed"
        elif j.exit_signal > 0:
            kind = "signalled"
        else:
            kind = "completed"
        count[kind] += 1
        if j.job_id in ledger:
            continue
        if math.isnan(j.start) or math.isnan(j.end):
            no_times += 1
            continue
        secs = max(0.0, min(j.end, now) - max(j.start, since))
        node_h[kind] += secs * len(j.nodes) / 3600.0
        gpu_h[kind] += secs * sum(gpus_of.get(n, 0) for n in j.nodes) / 3600.0
    total_g, total_n = sum(gpu_h.values()), sum(node_h.values())
    return {
        "jobs": len(jobs), "jobs_by_outcome": count, "jobs_without_times": no_times,
        "jobs_with_ledger": len([j for j in jobs if j.job_id in ledger]),
        "gpu_hours": {k: round(v, 2) for k, v in gpu_h.items()},
        "node_hours": {k: round(v, 2) for k, v in node_h.items()},
        "gpu_hours_total": round(total_g, 2), "node_hours_total": round(total_n, 2),
        # with no GPU classes (the CPU dev cluster) the percentages come from node hours
        "basis": "gpu_hours" if total_g > 0 else "node_hours",
        "goodput_pct": _pct(gpu_h["completed"], total_g) if total_g > 0
        else _pct(node_h["completed"], total_n),
        "goodput_upper_pct": _pct(gpu_h["completed"] + gpu_h["signalled"], total_g)
        if total_g > 0 else _pct(node_h["completed"] + node_h["signalled"], total_n),
        "lost_to_nodes_pct": _pct(gpu_h["lost_node"], total_g) if total_g > 0
        else _pct(node_h["lost_node"], total_n),
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
    class_of: dict[str, str] = {}
    for name, info in classes.items():
        for n in info.nodes:
            class_of[n] = name
    gpus_of = {n: classes[c].gpus for n, c in class_of.items()}
    job_events, requeues = _job_events(facts.jobs, since, now)
    events = [*facts.events, *job_events]
    built = _build_ledgers(facts.jobs, gpus_of)
    # The ledgers' node failures count in the MTBF the advice uses, once each.
    events += ledger_failures(built, events, facts.passing_prologs, since, now)
    events.sort(key=lambda e: (e.time, e.node, e.source))
    incidents = _incidents(events, facts.passing_prologs)
    fleet = set(class_of) | facts.nodes_seen | {e.node for e in events if e.node}

    per_node: dict[str, dict[str, Any]] = {}
    out_s: dict[str, float] = defaultdict(float)
    ttrs: list[float] = []
    still_out: list[str] = []
    for inc in incidents:
        d = per_node.setdefault(inc.node, {"incidents": 0, "events": 0, "causes": Counter(),
                                           "last": 0.0, "out_now": False})
        d["incidents"] += 1
        d["events"] += len(inc.events)
        d["causes"].update(e.cause for e in inc.events)
        d["last"] = max(d["last"], inc.events[-1].time)
        if not inc.out_of_service:
            continue
        back = inc.returned if inc.returned is not None else now
        out_s[inc.node] += max(0.0, min(back, now) - max(inc.start, since))
        if inc.returned is None:
            d["out_now"] = True
            still_out.append(inc.node)
        else:
            ttrs.append((inc.returned - inc.start) / 3600.0)

    def mtbf(in_service_s: float, n: int) -> float | None:
        return _h(in_service_s / n) if n else None

    nodes_out: list[dict[str, Any]] = []
    for node in sorted(per_node):
        d = per_node[node]
        in_s = max(0.0, window_s - out_s[node])
        nodes_out.append({
            "node": node, "class": class_of.get(node, UNKNOWN_CLASS),
            "incidents": d["incidents"], "events": d["events"],
            "mtbf_h": mtbf(in_s, d["incidents"]), "out_of_service_h": _h(out_s[node]),
            "causes": dict(sorted(d["causes"].items())), "last_failure_utc": iso(d["last"]),
            "out_now": d["out_now"],
        })
    worst = sorted(nodes_out, key=lambda r: (-r["incidents"], -r["out_of_service_h"], r["node"]))

    by_class: dict[str, dict[str, Any]] = {}
    for node in fleet:
        c = class_of.get(node, UNKNOWN_CLASS)
        row = by_class.setdefault(c, {"class": c, "nodes": 0, "incidents": 0,
                                      "in_service_h": 0.0, "out_of_service_h": 0.0,
                                      "nodes_failed": 0,
                                      "gpus_per_node": classes[c].gpus if c in classes else 0})
        row["nodes"] += 1
        n_inc = per_node.get(node, {}).get("incidents", 0)
        row["incidents"] += n_inc
        row["nodes_failed"] += 1 if n_inc else 0
        row["in_service_h"] += max(0.0, window_s - out_s[node]) / 3600.0
        row["out_of_service_h"] += out_s[node] / 3600.0
    classes_out = []
    for c in sorted(by_class):
        row = by_class[c]
        row["mtbf_h"] = round(row["in_service_h"] / row["incidents"], 3) if row["incidents"] \
            else None
        row["in_service_h"] = round(row["in_service_h"], 2)
        row["out_of_service_h"] = round(row["out_of_service_h"], 2)
        classes_out.append(row)
    total_in = sum(r["in_service_h"] for r in classes_out)
    total_inc = sum(r["incidents"] for r in classes_out)

    causes = Counter((e.cause, e.source) for e in events)
    ledger = _ledgers(built, class_of, classes_out)
    by_day = Counter((datetime.fromtimestamp(e.time, tz=UTC).strftime("%Y-%m-%d"), e.cause)
                     for e in events)
    return {
        "format": FORMAT, "schema_version": SCHEMA_VERSION,
        "window": {"since_unix_s": since, "now_unix_s": now, "since_utc": iso(since),
                   "now_utc": iso(now), "hours": _h(window_s)},
        "sources": {"reports": facts.reports, "jobs": len(facts.jobs),
                    "segments": facts.segments, "nights": facts.nights},
        "fleet": {"nodes": len(fleet), "nodes_failed": len(per_node),
                  "incidents": len(incidents), "events": sum(1 for e in events if e.node),
                  "mtbf_h": round(total_in / total_inc, 3) if total_inc else None,
                  "out_of_service_h": round(sum(out_s.values()) / 3600.0, 2),
                  "out_now": sorted(set(still_out))},
        "interruptions": {
            "total": len(events),
            "by_cause": [{"cause": c, "source": s, "count": n}
                         for (c, s), n in sorted(causes.items(), key=lambda kv: (-kv[1], kv[0]))],
            "by_source": dict(sorted(Counter(e.source for e in events).items())),
            "by_day": [{"day": d, "cause": c, "count": n} for (d, c), n in sorted(by_day.items())],
        },
        "requeues": requeues,
        "mtbf": {"by_class": classes_out, "nodes_without_failure": len(fleet) - len(per_node)},
        "worst_nodes": worst[:top],
        "nodes": nodes_out,
        "return_to_service": {
            "incidents_out_of_service": len(ttrs) + len(still_out), "returned": len(ttrs),
            "still_out": len(still_out), "median_h": _quantile(ttrs, 0.5),
            "p90_h": _quantile(ttrs, 0.9), "max_h": round(max(ttrs), 3) if ttrs else None,
            "hours": sorted(round(t, 3) for t in ttrs),
        },
        "goodput": _goodput(facts.jobs, gpus_of, since, now, ledger.pop("_hours")),
        "ledger": ledger,
    }


SIZE_BUCKETS = (1, 2, 8, 32, 128, 512, 2048, 8192)


def _size_bucket(n: int) -> str:
    lo = 1
    for b in SIZE_BUCKETS:
        if n <= b:
            return f"{lo}-{b}" if lo != b else str(b)
        lo = b + 1
    return f">{SIZE_BUCKETS[-1]}"


def _build_ledgers(jobs: list[JobFacts], gpus_of: Mapping[str, int]
                   ) -> list[tuple[JobFacts, Ledger, int]]:
    """The goodput ledger (bluevela/report/goodput.py) of every job with supervisor events,
    with its GPUs per node."""
    from bluevela.report import goodput as G
    from bluevela.report.goodput_bounds import Allocation

    out: list[tuple[JobFacts, Ledger, int]] = []
    for j in jobs:
        if not j.goodput:
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


SAME_FAILURE_S = 3600.0  # a ledger's node failure this close to another event of the node is it


def ledger_failures(built: list[tuple[JobFacts, Ledger, int]], events: list[Event],
                    passing: Mapping[str, list[float]], since: float, now: float
                    ) -> list[Event]:
    """The node failures the jobs' ledgers saw (a lost node: `node failure: <node>`) that no
    other event already counts, as events of source `ledger` (pure).

    One failure is counted once: a ledger's failure of a node is the same as an event of that
    node (a drain, a CRITICAL report, the job's "node lost", another ledger's) of the same
    job's lost node, within SAME_FAILURE_S of it, or in the same incident (no passing prolog
    of the node between them).
    """
    import bisect

    by_node: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.node:
            by_node[e.node].append(e)
    out: list[Event] = []
    for j, led, _ in built:
        for intr in led.interruptions:
            if intr.kind != "lost":
                continue
            t = intr.at if intr.at is not None else (j.end if not math.isnan(j.end) else j.start)
            if math.isnan(t) or not since <= t <= now:
                continue
            for node in intr.nodes:
                times = passing.get(node, [])
                ret = bisect.bisect_right(times, t)
                if any((e.job_id == j.job_id and e.cause in (NODE_LOST, LEDGER_FAILURE))
                       or abs(e.time - t) <= SAME_FAILURE_S
                       or bisect.bisect_right(times, e.time) == ret for e in by_node[node]):
                    continue
                ev = Event(t, node, "ledger", LEDGER_FAILURE, False, j.job_id,
                           f"the goodput ledger of job {j.job_id}: {intr.cause}")
                by_node[node].append(ev)
                out.append(ev)
    return out


def _ledgers(built: list[tuple[JobFacts, Ledger, int]], class_of: Mapping[str, str],
             classes_out: list[dict[str, Any]]) -> dict[str, Any]:
    """The ledgers' figures: ETTR per job and by job size, hours lost by phase and by cause,
    and the checkpoint interval / spare advice from the fleet's MTBF of the job's node class
    (which counts the ledgers' own node failures)."""
    from bluevela.report import goodput as G
    from bluevela.report.goodput_advice import advise

    mtbf = {r["class"]: (r["mtbf_h"], r["incidents"]) for r in classes_out}
    rows: list[dict[str, Any]] = []
    by_size: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    phase_h: dict[str, float] = dict.fromkeys((*G.PHASES, G.IDLE_SPARE), 0.0)
    cause_h: defaultdict[str, float] = defaultdict(float)
    hours: dict[int, tuple[float, float]] = {}  # job -> (productive s, allocated s)
    basis_gpu = False
    for j, led, gpus in built:
        basis_gpu |= gpus > 0
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
        advice = advise(led, node_mtbf_h, int(incidents))
        size = _size_bucket(led.nodes)
        b = by_size[size]
        b[0] += led.phases["productive"] * unit
        b[1] += led.wall_s * unit + spare_h
        b[2] += 1
        rows.append({"job_id": j.job_id, "nodes": led.nodes, "class": cls,
                     "wall_h": round(led.wall_s / 3600.0, 4),
                     "ettr_pct": _pct(led.phases["productive"], led.wall_s),
                     "phases_h": {k: round(v / 3600.0, 4) for k, v in led.phases.items()},
                     "spares": led.spares, "idle_spare_h": round(spare_h, 4),
                     "interruptions": [{"attempt": i.attempt, "cause": i.cause,
                                        "nodes": i.nodes, "redone_s": round(i.redone_s, 2),
                                        "lost_s": round(i.lost_s, 2)}
                                       for i in led.interruptions],
                     "checkpoint_cost_s": led.checkpoint_mean_s,
                     "checkpoint_interval_s": led.checkpoint_interval_s,
                     "advice": advice,
                     "spares_advice": advice.get("spares")})
    total = sum(phase_h.values())
    return {
        "jobs": len(rows), "basis": "gpu_hours" if basis_gpu else "node_hours",
        "ettr_pct": _pct(phase_h["productive"], total) if total else None,
        "hours_by_phase": {k: round(v, 4) for k, v in phase_h.items()},
        "hours_lost_by_cause": dict(sorted(((k, round(v, 4)) for k, v in cause_h.items()),
                                           key=lambda kv: -kv[1])),
        "by_size": [{"nodes": k, "jobs": int(v[2]), "ettr_pct": _pct(v[0], v[1])}
                    for k, v in sorted(by_size.items(), key=lambda kv: _size_key(kv[0]))],
        "per_job": rows,
        "_hours": hours,
    }


def _size_key(label: str) -> int:
    return int(label.lstrip(">").split("-")[0])


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


__all__ = ["Event", "FleetFacts", "JobFacts", "NodeClassInfo", "classes_of", "compute",
           "fleet_report", "gather"]
