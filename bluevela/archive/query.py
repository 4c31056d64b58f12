"""Reading the archive: the Python API under `bv archive ls|show|node|export|verify`.

Every function returns plain lists of dicts (JSON-able), so pandas users can write::

    import pandas as pd
    from bluevela.archive import query
    df = pd.DataFrame(query.records("/var/lib/bluevela/archive", since=query.parse_since("30d")))

Readers never take the writer lock: they open only the segments the manifest lists (immutable
files), and retry when a concurrent compaction removed one between manifest and open.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.archive import schema as S
from bluevela.archive.segment_read import open_h5, read_rows, schema_problems
from bluevela.archive.store import _SEGMENT_RE, Archive, SegmentInfo
from bluevela.archive.tables import build_reports, job_dict, rows, text
from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    import h5py
    import numpy as np

logger = logging.getLogger(__name__)

Segments = list[tuple[SegmentInfo, Path]]
_REL = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([smhdw])$")
_REL_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_BIG = 256  # above this many rows, read whole tables instead of row by row


def parse_since(value: str | None, now: float | None = None) -> float | None:
    """A `--since` value as unix seconds: ISO date/time (local time unless it has a zone),
    a unix timestamp, or an age like `90m`, `24h`, `7d`, `2w`.

    Raises:
        ArchiveError: not one of those forms.
    """
    if value is None or value == "":
        return None
    v = value.strip()
    m = _REL.match(v)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _REL_S[m.group(2)]
    try:
        return float(v)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        raise ArchiveError(f"--since {value!r}: expected a date (2025-01-31), a date and time "
                           "(2025-01-31T08:00), a unix time, or an age (24h, 7d)") from None
    return dt.timestamp()


def iso(ts: float | None) -> str | None:
    """Unix seconds as an ISO 8601 UTC string (None stays None)."""
    if ts is None or math.isnan(ts):
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------ jobs


def _job_summary(row: dict[str, Any], nodes: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    import hostlist

    d = job_dict(row, nodes)
    d["nodes"] = hostlist.collect_hostlist(d.pop("nodelist")) if nodes else ""
    d.pop("nodes_reported")
    d["start_utc"] = iso(d["start_unix_s"])
    d["end_utc"] = iso(d["end_unix_s"])
    d["archive_file"] = str(path)
    return d


def list_jobs(archive_dir: Path, *, since: float | None = None, user: str | None = None,
              node: str | None = None) -> list[dict[str, Any]]:
    """Archived jobs, newest revision of each, sorted by job id.

    Args:
        archive_dir: the archive directory.
        since: only jobs whose last report is at or after this unix time.
        user: only this user's jobs.
        node: only jobs that ran on (reported from) this node.
    """
    archive = Archive(archive_dir)

    def read(segs: Segments) -> list[dict[str, Any]]:
        newest: dict[int, tuple[int, dict[str, Any], list[dict[str, Any]], Path]] = {}
        on_node: set[int] = set()
        for _info, path in segs:
            with open_h5(path) as f:
                if node is not None:
                    on_node.update(_node_job_ids(f, node))
                jobs = read_rows(f, "jobs")
                if since is not None:
                    jobs = jobs[jobs["last_report_unix_s"] >= since]
                if user is not None:
                    jobs = jobs[jobs["user"] == user.encode()]
                if not len(jobs):
                    continue
                _fold_newest(newest, jobs, read_rows(f, "job_nodes"), path)
        out = []
        for jid in sorted(newest):
            if node is not None and jid not in on_node:
                continue
            _, row, nodes, path = newest[jid]
            out.append(_job_summary(row, nodes, path))
        return out

    return archive.read_segments(read)


def _node_job_ids(f: h5py.File, node: str) -> set[int]:
    rng = _node_range(f, node)
    if rng is None:
        return set()
    first, count = int(rng["report_first"]), int(rng["report_count"])
    return set(read_rows(f, "reports", first, count)["job_id"].tolist())


def _node_range(f: h5py.File, node: str) -> Any:
    import numpy as np

    index = read_rows(f, S.NODE_INDEX)
    key = node.encode()
    i = int(np.searchsorted(index["node"], key))
    if i < len(index) and index["node"][i] == key:
        return index[i]
    return None


def show_job(archive_dir: Path, job_id: int, spool: Path | None = None) -> dict[str, Any]:
    """One job: its summary, and each node's prolog and epilog report (of the node's latest
    attempt). A requeued job (`restarts` > 0) also has `attempts` (see `job_attempts`) and,
    per node, `earlier`: [{restart, prolog, epilog}] of its earlier attempts.

    Raises:
        ArchiveError: the job is not in the archive (the message says if the spool holds
            reports of it still waiting for the job to complete).
    """
    from bluevela.archive.ingest import find_jobs

    archive = Archive(archive_dir)

    def read(segs: Segments) -> dict[str, Any]:
        found = find_jobs(segs, [job_id])
        if job_id not in found:
            waiting = _waiting_in_spool(spool, job_id)
            hint = f"; {waiting} report(s) of it wait in the spool" if waiting else ""
            raise ArchiveError(f"job {job_id} is not in the archive {archive_dir}{hint}")
        jrow = found[job_id]
        job = job_dict(rows(jrow.row.reshape(1))[0], rows(jrow.nodes))
        reports: dict[tuple[str, str, int], dict[str, Any]] = {}
        files: list[str] = []
        job_file = ""
        for info, path in segs:
            if not info.job_id_min <= job_id <= info.job_id_max:
                continue
            with open_h5(path) as f:
                got = _job_reports(f, job_id)
                has_row = _has_job_row(f, job_id, int(jrow.row["revision"]))
            if has_row:
                job_file = str(path)
            if got:
                files.append(str(path))
            for r in got:
                r["archive_file"] = str(path)
                reports.setdefault((r["node"], r["phase"], int(r.get("restart") or 0)), r)
        nodes = _node_entries(rows(jrow.nodes), reports)
        if grown_prologs(segs, job, nodes):
            have = {n["node"] for n in nodes if n["prolog"] is not None}
            job["missing_prolog_nodes"] = [n for n in job["missing_prolog_nodes"]
                                           if n not in have]
        attempts = job_attempts(reports.values())
        job["restarts"] = max(job["restarts"], attempts[-1]["restart"] if attempts else 0)
        if job["restarts"]:
            job["attempts"] = attempts
        job["start_utc"] = iso(job["start_unix_s"])
        job["end_utc"] = iso(job["end_unix_s"])
        job["archive_file"] = job_file
        job["archive_files"] = files
        job["nodes"] = nodes
        return job

    return archive.read_segments(read)


def _node_entries(job_nodes: list[dict[str, Any]],
                  reports: dict[tuple[str, str, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each node of the job with its prolog and epilog of its latest attempt, and `earlier`:
    [{restart, prolog, epilog}] of its earlier attempts."""
    by_node: dict[str, list[int]] = {}
    for node, _, k in sorted(reports):
        if k not in by_node.setdefault(node, []):
            by_node[node].append(k)
    nodes = []
    for n in job_nodes:
        name = text(n["node"])
        ks = by_node.get(name) or [0]
        entry: dict[str, Any] = {
            "node": name, "expected": bool(n["expected"]),
            "prolog": _strip_job(reports.get((name, "prolog", ks[-1]))),
            "epilog": _strip_job(reports.get((name, "epilog", ks[-1]))),
        }
        if len(ks) > 1:
            entry["earlier"] = [{"restart": k,
                                 "prolog": _strip_job(reports.get((name, "prolog", k))),
                                 "epilog": _strip_job(reports.get((name, "epilog", k)))}
                                for k in ks[:-1]]
        nodes.append(entry)
    return nodes


def _grows_of(job_id: int, nodes: list[dict[str, Any]]) -> dict[int, set[str]]:
    """Helper job id -> the nodes without a prolog that the job's goodput record says grew
    into it through that helper (`grows`, written by the job's supervisor)."""
    from bluevela.goodput.events import EventsError, validate

    names = {n["node"]: n for n in nodes}
    want: dict[int, set[str]] = {}
    for n in nodes:
        rep = n.get("epilog")
        if not rep or "goodput_events" not in rep:
            continue
        try:
            rec = validate(rep["goodput_events"])
        except EventsError:
            continue
        if rec["job"] != job_id or rec["host"] not in names:
            continue
        for g in rec.get("grows") or []:
            for node in g["nodes"]:
                if g["helper"] != job_id and node in names and names[node]["prolog"] is None:
                    want.setdefault(g["helper"], set()).add(node)
    return want


def grown_prologs(segs: Segments, job: dict[str, Any], nodes: list[dict[str, Any]]) -> int:
    """A node grown into a running job (bluevela/launch/grow.py) ran its prolog under the
    short-lived helper job's id (`bv-grow-JOB`), so the job has its epilog alone. The job's
    own goodput record names the helper and the node; the helper's prolog of that node is
    then shown as the node's, marked `grown_via_job`: only when the helper is archived and
    its user is the job's (a job of another user never lends its checks). Read here, not at
    ingest: the helper and the job are archived in either order. Returns how many."""
    from bluevela.archive.ingest import find_jobs

    want = _grows_of(int(job["job_id"]), nodes)
    if not want or not job.get("user"):
        return 0
    found = find_jobs(segs, sorted(want))
    by_name = {n["node"]: n for n in nodes}
    given = 0
    for helper, names in sorted(want.items()):
        got = found.get(helper)
        if got is None or text(got.row["user"]) != job["user"]:
            continue
        for info, path in segs:
            if not info.job_id_min <= helper <= info.job_id_max:
                continue
            with open_h5(path) as f:
                reports = _job_reports(f, helper)
            for r in reports:
                entry = by_name.get(r["node"])
                if r["phase"] == "prolog" and r["node"] in names and entry is not None \
                        and entry["prolog"] is None:
                    entry["prolog"] = {**(_strip_job(r) or {}), "grown_via_job": helper,
                                       "archive_file": str(path)}
                    given += 1
    return given


def job_attempts(reports: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A job's attempts (restart counts) from its reports, in order: restart, nodes (a
    hostlist), first prolog and last epilog time (unix s and UTC; None when no such report),
    and the attempt's exit status (worst over its epilogs; None when none reported)."""
    import hostlist

    by: dict[int, list[dict[str, Any]]] = {}
    for r in reports:
        by.setdefault(int(r.get("restart") or 0), []).append(r)
    out = []
    for k in sorted(by):
        reps = by[k]
        pro = [r["time"] for r in reps if r["phase"] == "prolog"]
        epi = [r for r in reps if r["phase"] == "epilog"]

        def worst(key: str, epi: list[dict[str, Any]] = epi) -> int | None:
            vals = [r[key] for r in epi if r.get(key) is not None]
            return max(vals) if vals else None

        first = min(pro) if pro else None
        last = max(r["time"] for r in epi) if epi else None
        out.append({
            "restart": k, "nodes": hostlist.collect_hostlist(sorted({r["node"] for r in reps})),
            "first_prolog_unix_s": first, "first_prolog_utc": iso(first),
            "last_epilog_unix_s": last, "last_epilog_utc": iso(last),
            "exit_code": worst("exit_code"), "exit_signal": worst("exit_signal"),
            "derived_exit_code": worst("derived_exit_code"),
        })
    return out


def _strip_job(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {k: v for k, v in report.items()
            if k not in ("user", "partition", "num_nodes", "nodelist", "job_id", "node")}


def _has_job_row(f: h5py.File, job_id: int, revision: int) -> bool:
    import numpy as np

    index = f[S.JOB_IDS_INDEX][()]
    i = int(np.searchsorted(index, job_id))
    return i < len(index) and int(index[i]) == job_id and \
        int(f["jobs"][i]["revision"]) == revision


def _job_reports(f: h5py.File, job_id: int) -> list[dict[str, Any]]:
    """This file's reports of one job (found through /index/job_ids and /index/job_reports)."""
    import numpy as np

    index = f[S.JOB_IDS_INDEX][()]
    i = int(np.searchsorted(index, job_id))
    if i >= len(index) or int(index[i]) != job_id:
        # A job's reports always come with a job row in the same file.
        return []
    jrow = f["jobs"][i]
    first, count = int(jrow["report_first"]), int(jrow["report_count"])
    if not count:
        return []
    report_rows = np.sort(read_rows(f, S.JOB_REPORTS_INDEX, first, count))
    return _reports_at(f, report_rows)


def _reports_at(f: h5py.File, report_rows: np.ndarray) -> list[dict[str, Any]]:
    """Rebuild the reports at sorted row numbers `report_rows` of one file."""
    if len(report_rows) > _BIG:
        full = {n: read_rows(f, n) for n in ("reports", "checks", "check_metrics", "telemetry")}
        return build_reports(full["reports"][report_rows], full["checks"],
                             full["check_metrics"], full["telemetry"])
    out = []
    for row in report_rows.tolist():
        rep = read_rows(f, "reports", row, 1)
        cf, cc = int(rep["check_first"][0]), int(rep["check_count"][0])
        checks = read_rows(f, "checks", cf, cc)
        mf = int(checks["metric_first"][0]) if cc else 0
        mc = int(checks["metric_first"][-1] + checks["metric_count"][-1]) - mf if cc else 0
        tf, tc = int(rep["telemetry_first"][0]), int(rep["telemetry_count"][0])
        out += build_reports(rep, checks, read_rows(f, "check_metrics", mf, mc),
                             read_rows(f, "telemetry", tf, tc), check_base=cf, metric_base=mf,
                             telemetry_base=tf)
    return out


def _waiting_in_spool(spool: Path | None, job_id: int) -> int:
    if spool is None:
        return 0
    from bluevela.archive.spool import scan_spool

    try:
        return len(scan_spool(spool, job_id).entries)
    except ArchiveError:
        return 0


# ------------------------------------------------------------------------------------ nodes


def node_history(archive_dir: Path, node: str, *, since: float | None = None
                 ) -> list[dict[str, Any]]:
    """Every archived report of one node (health per check, exit status, telemetry), by time.

    Uses each segment's /index/nodes: one binary search and four contiguous slice reads per
    file, so the cost grows with the node's own history and the (logarithmic) file count.
    """
    archive = Archive(archive_dir)

    def read(segs: Segments) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for info, path in segs:
            if since is not None and info.time_max < since:
                continue
            with open_h5(path) as f:
                rng = _node_range(f, node)
                if rng is None:
                    continue
                out.extend(_node_reports(f, rng, path, since))
        out.sort(key=lambda r: (r["time"], r["job_id"], r["phase"] == "epilog"))
        return out

    return archive.read_segments(read)


def _node_reports(f: h5py.File, rng: Any, path: Path, since: float | None
                  ) -> list[dict[str, Any]]:
    def part(name: str, col: str) -> tuple[np.ndarray, int]:
        first, count = int(rng[f"{col}_first"]), int(rng[f"{col}_count"])
        return read_rows(f, name, first, count), first

    reps, _ = part("reports", "report")
    checks, c0 = part("checks", "check")
    metrics, m0 = part("check_metrics", "metric")
    tel, t0 = part("telemetry", "telemetry")
    if since is not None:
        reps = reps[reps["time_unix_s"] >= since]
    out = build_reports(reps, checks, metrics, tel, check_base=c0, metric_base=m0,
                        telemetry_base=t0)
    where = str(path)
    for d in out:
        d["time_utc"] = iso(d["time"])
        d["archive_file"] = where
    return out


# ------------------------------------------------------------------------------------ export


def iter_reports(archive_dir: Path, *, since: float | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Every archived report, with its job's user/partition/nodelist, file by file.

    Raises:
        ArchiveError: the archive is unreadable, or a compaction removed a file meanwhile
            (run again).
    """
    try:
        yield from _iter_reports(archive_dir, since)
    except FileNotFoundError as exc:
        raise ArchiveError(f"{exc.filename}: removed by a compaction while being read; "
                           "run the export again") from exc


def _iter_reports(archive_dir: Path, since: float | None) -> Iterator[dict[str, Any]]:
    archive = Archive(archive_dir)
    segs = [(s, archive.path_of(s)) for s in archive.manifest().segments]
    jobs = {j["job_id"]: j for j in _all_jobs(segs)}
    for info, path in segs:
        if since is not None and info.time_max < since:
            continue
        with open_h5(path) as f:
            full = {n: read_rows(f, n) for n in ("reports", "checks", "check_metrics",
                                                 "telemetry")}
        rep = full["reports"]
        if since is not None:
            rep = rep[rep["time_unix_s"] >= since]
        where = str(path)
        for i in range(0, len(rep), 4096):  # rebuild in batches: memory stays flat
            for d in build_reports(rep[i:i + 4096], full["checks"], full["check_metrics"],
                                   full["telemetry"], jobs=jobs):
                d["archive_file"] = where
                yield d


def _fold_newest(newest: dict[int, tuple[int, dict[str, Any], list[dict[str, Any]], Path]],
                 jobs: Any, job_nodes: Any, path: Path) -> None:
    """Fold one segment's job rows into `newest` (job id -> (revision, row, nodes, file)),
    keeping each job's highest revision (a late report adds a revision)."""
    for row in rows(jobs):
        jid, rev = int(row["job_id"]), int(row["revision"])
        if jid in newest and newest[jid][0] >= rev:
            continue
        first, count = int(row["node_first"]), int(row["node_count"])
        newest[jid] = (rev, row, rows(job_nodes[first:first + count]), path)


def _all_jobs(segs: Segments) -> list[dict[str, Any]]:
    newest: dict[int, tuple[int, dict[str, Any], list[dict[str, Any]], Path]] = {}
    for _, path in segs:
        with open_h5(path) as f:
            jobs = read_rows(f, "jobs")
            jn = read_rows(f, "job_nodes")
        _fold_newest(newest, jobs, jn, path)
    return [job_dict(row, nodes) for _, row, nodes, _ in newest.values()]


def flat_record(report: dict[str, Any]) -> dict[str, Any]:
    """One report as a flat record (one column per value): for CSV and pandas."""
    health = report.get("health") or {}
    rec: dict[str, Any] = {
        "job_id": report["job_id"], "node": report["node"], "phase": report["phase"],
        "restart": report.get("restart", 0), "user": report.get("user"), "partition": report.get("partition"),
        "time_unix_s": report["time"], "time_utc": iso(report["time"]),
        "exit_code": report.get("exit_code"), "exit_signal": report.get("exit_signal"),
        "derived_exit_code": report.get("derived_exit_code"),
        "health_status": health.get("status"), "health_tier": health.get("tier"),
        "health_duration_s": health.get("duration_s"),
        "drained": report.get("drained"), "drain_reason": report.get("drain_reason"),
    }
    for c in health.get("checks") or []:
        rec[f"check.{c['name']}.status"] = c.get("status")
        rec[f"check.{c['name']}.duration_s"] = c.get("duration_s")
        for k, v in (c.get("metrics") or {}).items():
            rec[f"check.{c['name']}.{k}"] = v
    for k, v in (report.get("telemetry") or {}).items():
        rec[f"telemetry.{k}"] = v
    return rec


def records(archive_dir: Path, *, since: float | None = None) -> list[dict[str, Any]]:
    """Every archived report as a flat record: `pandas.DataFrame(records(...))`."""
    return [flat_record(r) for r in iter_reports(archive_dir, since=since)]


def write_csv(recs: list[dict[str, Any]], out: Any) -> None:
    """Write flat records as CSV (the union of their columns; fixed columns first)."""
    import csv

    fixed = list(flat_record({"job_id": 0, "node": "", "phase": "", "time": 0.0}))
    extra = sorted({k for r in recs for k in r} - set(fixed))
    w = csv.DictWriter(out, fieldnames=fixed + extra, extrasaction="ignore")
    w.writeheader()
    for r in recs:
        w.writerow({k: "" if v is None else v for k, v in r.items()})


# ------------------------------------------------------------------------------------ verify


@dataclass
class VerifyResult:
    """What `verify` checked and found. `problems` non-empty means a damaged archive."""

    files: int = 0
    reports: int = 0
    jobs: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "files": self.files, "reports": self.reports, "jobs": self.jobs,
                "problems": self.problems, "notes": self.notes}


def verify(archive_dir: Path) -> VerifyResult:
    """Open every segment file, check its schema and indexes, and check the archive as a whole
    (manifest entries present and matching, no report stored twice across files, every
    report's job archived). Files the manifest does not list (left by a killed writer, removed
    by the next ingest) are opened too and mentioned as notes.

    Raises:
        ArchiveError: the archive directory or its manifest is missing or unreadable.
    """
    import numpy as np

    archive = Archive(archive_dir)
    manifest = archive.manifest()
    res = VerifyResult()
    live = {s.file: s for s in manifest.segments}
    try:
        on_disk = sorted(os.listdir(archive.segments_dir))
    except FileNotFoundError:
        on_disk = []
    keys: list[np.ndarray] = []
    report_jobs: list[np.ndarray] = []
    job_ids: list[np.ndarray] = []
    for name in sorted(set(on_disk) | set(live)):
        data = _verify_segment(archive.segments_dir, name, live.get(name), name in on_disk, res)
        if data is None:
            continue
        rep, jobs = data["reports"], data[S.JOB_IDS_INDEX]
        k = np.zeros(len(rep), dtype=[("node", f"S{S.NODE_LEN}"), ("job_id", "u8"),
                                      ("phase", "u1"), ("restart", "u2")])
        for c in ("node", "job_id", "phase", "restart"):
            k[c] = rep[c]
        keys.append(k)
        report_jobs.append(rep["job_id"])
        job_ids.append(jobs)
        res.reports += len(rep)
    if keys:
        _verify_across_files(archive_dir, keys, report_jobs, job_ids, res)
    return res


def _verify_segment(segments_dir: Path, name: str, info: SegmentInfo | None, on_disk: bool,
                    res: VerifyResult) -> dict[str, Any] | None:
    """One name in the segments directory or the manifest, on its own: the name, the file's
    schema and indexes, its manifest entry. Returns its datasets when it is a live segment
    that could be checked (problems and notes go to `res`)."""
    path = segments_dir / name
    if name.startswith(".") and name.endswith(".tmp"):
        res.notes.append(f"{path}: temporary file of an interrupted writer "
                         "(the next ingest removes it)")
        return None
    if not _SEGMENT_RE.match(name):
        res.notes.append(f"{path}: not a segment file name; ignored")
        return None
    if not on_disk:
        res.problems.append(f"{path}: listed in the manifest but missing")
        return None
    res.files += 1
    data: dict[str, Any] = {}
    try:
        with open_h5(path) as f:
            problems = schema_problems(f, data)
    except ArchiveError as exc:
        res.problems.append(str(exc))
        return None
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        res.problems.append(f"{path}: unreadable ({str(exc).splitlines()[0]})")
        return None
    res.problems.extend(f"{path}: {p}" for p in problems)
    if problems:
        return None
    rep, jobs = data["reports"], data[S.JOB_IDS_INDEX]
    if info is None:
        res.notes.append(f"{path}: not in the manifest (left by an interrupted writer; "
                         "the next ingest removes it)")
        return None
    if info.reports != len(rep) or info.jobs != len(jobs):
        res.problems.append(f"{path}: manifest says {info.reports} reports/{info.jobs} jobs, "
                            f"the file holds {len(rep)}/{len(jobs)}")
    return data


def _verify_across_files(archive_dir: Path, keys: list[np.ndarray],
                         report_jobs: list[np.ndarray], job_ids: list[np.ndarray],
                         res: VerifyResult) -> None:
    """The live files together: no report key in two files, every report's job archived."""
    import numpy as np

    allk = np.concatenate(keys)
    uniq = np.unique(allk)
    if len(uniq) != len(allk):
        res.problems.append(f"{archive_dir}: {len(allk) - len(uniq)} report(s) stored in "
                            "more than one file")
    jobs_all = np.unique(np.concatenate(job_ids))
    res.jobs = len(jobs_all)
    orphan = np.setdiff1d(np.unique(np.concatenate(report_jobs)), jobs_all)
    if len(orphan):
        res.problems.append(f"{archive_dir}: reports of {len(orphan)} job(s) without a job "
                            f"row (e.g. job {int(orphan[0])})")
