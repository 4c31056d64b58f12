"""The fleet report's reading side (`bv report fleet`): the window's facts from the run
archive's segments and the nightly store into `FleetFacts` (numpy, h5py; only the columns the
report needs). `fleet.compute` turns them into the report.

An event is one node-level failure signal found here: a prolog or epilog report whose health
was CRITICAL (cause: the check its drain reason names, `bv: <check>: ...`, else its first
CRITICAL check), or a nightly CRITICAL verdict (cause: the failed measurement). The jobs'
node rows, attempts and goodput events go with each job (`JobFacts`).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.report.fleet_facts import CRITICAL, Attempt, Event, FleetFacts, JobFacts

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

_JOB_COLUMNS = ["job_id", "revision", "num_nodes", "start_unix_s", "end_unix_s",
                "last_report_unix_s", "exit_code", "exit_signal", "node_first", "node_count"]
# (job, node, phase) -> (time, cause, drained, drain reason) of a CRITICAL report
_Crit = dict[tuple[int, str, int], tuple[float, str, bool, str]]


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


# ------------------------------------------------------------------------- archive segments


@dataclass
class _Gathered:
    """What the segments read so far hold, before the jobs are folded."""

    since: float
    now: float
    prefix: str
    facts: FleetFacts = field(default_factory=FleetFacts)
    job_parts: list[np.ndarray] = field(default_factory=list)
    seg_parts: list[np.ndarray] = field(default_factory=list)
    jn_parts: dict[int, np.ndarray] = field(default_factory=dict)
    crit: _Crit = field(default_factory=dict)
    passing: dict[str, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))
    attempts: dict[int, dict[int, Attempt]] = field(default_factory=lambda: defaultdict(dict))
    goodput: dict[int, dict[int, dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(dict))


def _gather_segments(segs: list[tuple[Any, Path]], since: float, now: float,
                     prefix: str) -> FleetFacts:
    import numpy as np

    from bluevela.archive.store import open_h5

    g = _Gathered(since, now, prefix)
    facts = g.facts
    for seg_no, (info, path) in enumerate(segs):
        if info.time_max < since or info.time_min > now:
            continue
        facts.segments += 1
        with open_h5(path) as f:
            _read_segment(g, f, seg_no)
    facts.passing_prologs = {n: sorted(np.concatenate(p).tolist())
                             for n, p in g.passing.items()}
    if g.job_parts:
        _fold_jobs(facts, np.concatenate(g.job_parts), np.concatenate(g.seg_parts), g.jn_parts,
                   g.crit, since, now)
    for j in facts.jobs:
        if j.restarts:
            j.attempts = g.attempts.get(j.job_id, {})
        j.goodput = list(g.goodput.get(j.job_id, {}).values())
    facts.events.sort(key=lambda e: (e.time, e.node, e.source))
    return facts


def _read_segment(g: _Gathered, f: Any, seg_no: int) -> None:
    """One segment's reports (passing prologs, CRITICAL events, attempts, goodput events)
    and its jobs' rows."""
    import numpy as np

    from bluevela.archive import schema as S

    rep = f["reports"].fields(["job_id", "phase", "time_unix_s", "health_status",
                               "drained", "check_first", "check_count"])[()]
    # Segments written before the restart column: every report is attempt 0.
    has_restart = "restart" in (f["reports"].dtype.names or ())
    restart = f["reports"].fields("restart")[()] if has_restart else None
    index = f[S.NODE_INDEX].fields(["node", "report_first", "report_count"])[()]
    names = [_text(n) for n in index["node"]]
    spans = list(zip(index["report_first"].tolist(), index["report_count"].tolist(),
                     strict=True))
    node_of = np.empty(len(rep), dtype=np.int64)
    for i, (first, count) in enumerate(spans):
        node_of[first:first + count] = i
    g.facts.nodes_seen.update(names)
    times = rep["time_unix_s"]
    in_win = (times >= g.since) & (times <= g.now)
    g.facts.reports += int(in_win.sum())
    is_crit = rep["health_status"] == CRITICAL
    pro_ok = in_win & ~is_crit & (rep["phase"] == S.PHASE_CODES["prolog"])
    for i, (first, count) in enumerate(spans):
        ok = times[first:first + count][pro_ok[first:first + count]]
        if len(ok):
            g.passing[names[i]].append(ok)
    _critical_events(g, f, rep, np.flatnonzero(is_crit & in_win).tolist(), names, node_of)
    if restart is not None and bool((restart > 0).any()):
        _gather_attempts(g.attempts, rep, restart, node_of, names)
    _gather_goodput(g.goodput, f, rep, in_win, names, node_of)
    jobs = _with_restarts(f, _JOB_COLUMNS)
    g.job_parts.append(jobs)
    g.seg_parts.append(np.full(len(jobs), seg_no))
    g.jn_parts[seg_no] = f["job_nodes"].fields(["job_id", "node", "expected", "has_prolog",
                                                "has_epilog"])[()]


def _critical_events(g: _Gathered, f: Any, rep: np.ndarray, rows: list[int], names: list[str],
                     node_of: np.ndarray) -> None:
    """The CRITICAL reports at `rows` as events, each with the check that failed."""
    from bluevela.archive import schema as S

    if not rows:
        return
    reasons = f["reports"].fields("drain_reason")[rows]
    for row, reason in zip(rows, reasons, strict=True):
        r = rep[row]
        why = _text(reason)
        cause = cause_of_reason(why, g.prefix) or _first_critical_check(
            f, int(r["check_first"]), int(r["check_count"]))
        node, t, drained = names[node_of[row]], float(r["time_unix_s"]), bool(r["drained"])
        g.crit[(int(r["job_id"]), node, int(r["phase"]))] = (t, cause, drained, why)
        g.facts.events.append(Event(t, node, S.PHASE_NAMES[int(r["phase"])], cause, drained,
                                    int(r["job_id"]), why))


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
    """The goodput events (bluevela/goodput/events.py) in the window's epilog reports: only
    the rows whose extra JSON names them are decoded, and each record is checked again."""
    import json

    import numpy as np

    from bluevela.archive import schema as S
    from bluevela.goodput.events import EventsError, merge_records, validate
    from bluevela.report.goodput_bounds import slurm_submit, with_slurm_submit

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
            body = json.loads(text)
            rec = validate(body["goodput_events"])
            submit = slurm_submit(body)
        except (ValueError, KeyError, TypeError, AttributeError, EventsError) as exc:
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
            # the queue wait from Slurm's submit time, as root's epilog read it (a record
            # merged earlier keeps its own: merge_records prefers the first one's)
            out[rec["job"]][rec["restart"]] = with_slurm_submit(merge_records(have, rec),
                                                                submit)


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



# --------------------------------------------------------------------------- nightly store


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

