"""Ingest: spooled node reports -> one new archive segment, then the spool entries to done/.

Order of work, and why it survives kill -9 at any point:
  1. take the writer lock; remove what a killed writer left (temp files, unlisted segments);
  2. scan the spool; quarantine refused and malformed entries (ingest goes on);
  3. look up the archived state of the jobs seen; a report already archived (same job, node,
     phase and restart, and the same time stamp: the same hook run) is a duplicate; one whose
     key is archived with another time stamp is a conflict: quarantined with both times in
     its reason, counted (`conflicts`) and logged, never dropped as a duplicate;
  4. decide which jobs are ready, by the job's latest attempt (restart count) in the spool:
     every expected node has sent its epilog report, or `timeout_s` passed since the job's
     first epilog report (missing nodes recorded), or the job is already archived (a late
     report, or a requeued attempt's, adds a new revision);
  5. write one segment with the ready jobs' reports and job rows (temp, fsync, rename), then
     the manifest (same way): from here on the reports are durable;
  6. move their spool files (and duplicates) to `<spool>/done/`;
  7. compact (merge crowded levels).
A kill before 5 leaves the spool as it was; between 5 and 6 the next ingest finds the reports
archived and only moves them; during 7 the old segments stay live until the new manifest.

Ownership (docs/archive.md): one user ingests, the owner of the spool and the archive, which
nobody else may write. `check_ownership` says so in one line before anything is created, so a
root ingest never leaves root-owned files (`.lock`, segments) that lock the owner out, and a
spool others could write is never worked in by root.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.archive import schema as S
from bluevela.archive.job_index import Archived, archived_jobs
from bluevela.archive.job_index import find_jobs as find_jobs  # archive/query.py's name for it
from bluevela.archive.reports import load_report
from bluevela.archive.spool import (
    ReportError,
    SpoolDir,
    SpoolScan,
    mark_done,
    prune_done,
    quarantine,
    scan_spool,
)
from bluevela.archive.store import LOCK, MANIFEST, SEGMENTS, Archive, Writer
from bluevela.errors import ArchiveError
from bluevela.util.fs import owner_problem, user_name

if TYPE_CHECKING:
    from bluevela.archive.series_checks import SeriesLimits

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
PROLOG_ONLY_TIMEOUT_S = 7 * 86400.0
DONE_RETENTION_S = 7 * 86400.0
_START_KEYS = ("start_unix_s", "start_time", "job_start")
_END_KEYS = ("end_unix_s", "end_time", "job_end")


@dataclass
class IngestResult:
    """What one ingest did."""

    reports_ingested: int = 0
    jobs_archived: list[int] = field(default_factory=list)
    jobs_timed_out: list[int] = field(default_factory=list)
    duplicates: int = 0
    #: spool names (or "" without a spool) and why: a report whose key (job, node, phase,
    #: restart) is archived from another hook run; quarantined, never archived over the first
    conflicts: list[tuple[str, str]] = field(default_factory=list)
    waiting_reports: int = 0
    waiting_jobs: list[int] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    segment: str | None = None
    compactions: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quarantined"] = [{"name": n, "reason": r} for n, r in self.quarantined]
        d["conflicts"] = [{"name": n, "reason": r} for n, r in self.conflicts]
        return d


def _restart(report: dict[str, Any]) -> int:
    return int(report.get("restart") or 0)


def ingest(
    spool: Path,
    archive_dir: Path,
    *,
    job_id: int | None = None,
    wait_s: float = 0.0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    prolog_only_timeout_s: float = PROLOG_ONLY_TIMEOUT_S,
    lock_wait_s: float = 30.0,
    delete: bool = False,
    done_retention_s: float = DONE_RETENTION_S,
    compact: bool = True,
    now: float | None = None,
    series_limits: SeriesLimits | None = None,
) -> IngestResult:
    """Merge the spool's reports into the archive (idempotent, crash safe, one writer).

    Args:
        spool: the spool directory (`site.path("spool")`).
        archive_dir: the archive directory (`site.path("archive")`); must exist.
        job_id: ingest only this job's reports (the EpilogSlurmctld path).
        wait_s: with `job_id`, first wait up to this long for every node's epilog report.
        timeout_s: archive an incomplete job this long after its first epilog report.
        prolog_only_timeout_s: archive a job that has only prolog reports after this long.
        lock_wait_s: how long to wait for another ingest to finish.
        delete: delete ingested spool files instead of moving them to `<spool>/done/`.
        done_retention_s: delete files in `<spool>/done/` older than this (0: keep).
        compact: merge crowded segment levels afterwards.
        now: the current time (tests).
        series_limits: what a series side file may hold (GPUs of each node's class...);
            default `SeriesLimits.configured()`, read only when side files are spooled.

    Raises:
        ArchiveError: missing/unusable archive or spool, lock not obtained, a write failed
            (ENOSPC...). Reports not yet durable in the archive are then still in the spool.
    """
    t0 = time.perf_counter()
    archive = _usable_archive(archive_dir, spool)
    if job_id is not None and wait_s > 0:
        _wait_for_job(spool, job_id, wait_s)
    result = IngestResult()
    with archive.writer(lock_wait_s) as w, SpoolDir(spool) as sd:
        now = time.time() if now is None else now
        scan = scan_spool(sd, job_id)
        by_job = _read_reports(sd, scan, result)
        logger.debug("read %d report(s) of %d job(s) from %s", len(scan.entries), len(by_job),
                     spool)
        done_names = _archive_spooled(w, sd, by_job, result, now=now, timeout_s=timeout_s,
                                      prolog_only_timeout_s=prolog_only_timeout_s, spool=spool)
        if scan.series:  # the epilogs' sampler windows -> <archive>/series/<job>.h5
            done_names += _ingest_series(w, sd, archive_dir, scan, result, series_limits,
                                         now=now)
        mark_done(sd, done_names, delete=delete)
        logger.debug("moved %d spool file(s) out of %s", len(done_names), spool)
        if compact:
            result.compactions = _compact(w)
        if done_retention_s > 0 and not delete and job_id is None:
            prune_done(sd, done_retention_s)  # the timer's job: done/ may hold many files
    result.seconds = time.perf_counter() - t0
    return result


def _usable_archive(archive_dir: Path, spool: Path) -> Archive:
    """The archive, once the caller is known to own it and the spool, and it is whole.

    Both checks come before the lock is taken or anything is created, so a refused ingest
    leaves no file behind (a root-owned `.lock` would lock the owner out).

    Raises:
        ArchiveError: another user's (or a world-writable) archive or spool, or an archive
            that is missing or unusable.
    """
    check_ownership(archive_dir, spool)
    archive = Archive(archive_dir)
    archive.check()
    return archive


def _archive_spooled(w: Writer, sd: SpoolDir, by_job: dict[int, list[tuple[Any, dict[str, Any]]]],
                     result: IngestResult, *, now: float, timeout_s: float,
                     prolog_only_timeout_s: float, spool: Path) -> list[str]:
    """`_archive` for reports read from the spool: the spool names now done, and each report
    found in conflict with an archived one moved to quarantine (and counted there), so that
    it is neither archived over the first nor retried on every ingest."""
    conflicts_before = len(result.conflicts)
    done_names = _archive(w, by_job, result, now=now, timeout_s=timeout_s,
                          prolog_only_timeout_s=prolog_only_timeout_s, spool=spool)
    for name, reason in result.conflicts[conflicts_before:]:
        if name and quarantine(sd, name, reason) is not None:
            result.quarantined.append((name, reason))
    return done_names


def _compact(w: Writer) -> int:
    """Merge crowded segment levels; the number of merges, 0 when compaction failed.

    A failure is logged and not raised: the ingest before it is already durable, and the
    next ingest compacts again.
    """
    try:
        return w.compact()
    except ArchiveError as exc:
        logger.warning("compaction skipped (the ingest itself is durable): %s", exc)
        return 0


def _read_reports(sd: SpoolDir, scan: SpoolScan, result: IngestResult
                  ) -> dict[int, list[tuple[Any, dict[str, Any]]]]:
    """The scanned reports by job id, each with its spool entry; a refused or malformed one
    is quarantined (and counted), one gone meanwhile skipped."""
    for name, reason in scan.refused:
        quarantine(sd, name, reason)
        result.quarantined.append((name, reason))
    by_job: dict[int, list[tuple[Any, dict[str, Any]]]] = defaultdict(list)
    for entry in scan.entries:
        try:
            report = load_report(sd, entry)
        except FileNotFoundError:
            continue
        except ReportError as exc:
            quarantine(sd, entry.name, str(exc))
            result.quarantined.append((entry.name, str(exc)))
            continue
        by_job[entry.job_id].append((entry, report))
    return by_job


def _ingest_series(w: Writer, sd: SpoolDir, archive_dir: Path, scan: SpoolScan,
                   result: IngestResult, series_limits: SeriesLimits | None, *,
                   now: float) -> list[str]:
    """The spooled series side files into `<archive>/series/<job>.h5`; the spool names now
    done (the bad ones quarantined and counted)."""
    from bluevela.archive.series_checks import SeriesLimits
    from bluevela.archive.series_ingest import ingest_side_files

    limits = series_limits if series_limits is not None else SeriesLimits.configured()
    series_done, series_bad = ingest_side_files(w, sd, archive_dir, scan.series,
                                                limits=limits, now=now)
    result.quarantined += series_bad
    return series_done


def _archive(w: Writer, by_job: dict[int, list[tuple[Any, dict[str, Any]]]],
             result: IngestResult, *, now: float, timeout_s: float,
             prolog_only_timeout_s: float, spool: Path | None) -> list[str]:
    """Write the ready jobs' fresh reports as one segment; return the spool names now done
    (written or already archived). `by_job` maps job id -> [(spool entry or None, report)]."""
    archived = archived_jobs(w, sorted(by_job), keys=True)
    ready_reports: list[dict[str, Any]] = []
    job_rows: list[tuple[Any, ...]] = []
    job_nodes: list[list[tuple[Any, ...]]] = []
    done_names: list[str] = []
    written: list[str] = []
    for jid in sorted(by_job):
        old = archived.get(jid)
        stored = _stored_keys(old)
        fresh = []
        for entry, report in by_job[jid]:
            key = (report["node"], report["phase"], _restart(report))
            if key not in stored:
                fresh.append((entry, report))
            elif stored[key] == report["time"]:  # the same hook run's report, again
                result.duplicates += 1
                if entry is not None:
                    done_names.append(entry.name)
            else:
                _conflict(result, jid, key, stored[key], report, entry)
        if not fresh:
            continue
        reports = [r for _, r in fresh]
        state = _readiness(reports, old, now, timeout_s, prolog_only_timeout_s)
        if state is None:
            result.waiting_reports += len(fresh)
            result.waiting_jobs.append(jid)
            continue
        row, nodes = _job_row(jid, reports, old, now)
        job_rows.append(row)
        job_nodes.append(nodes)
        ready_reports.extend(reports)
        written.extend(e.name for e, _ in fresh if e is not None)
        result.jobs_archived.append(jid)
        if row[2] == S.COMPLETION_CODES["timeout"]:
            result.jobs_timed_out.append(jid)
    if job_rows:
        tables = _tables(ready_reports, job_rows, job_nodes)
        try:
            info = w.write_segment(tables, level=0)
            w.commit([info])
        except ArchiveError as exc:
            where = f" stay in {spool}" if spool is not None else " were not stored"
            raise ArchiveError(f"{exc}; the {len(ready_reports)} report(s){where}") from exc
        result.segment = info.file
        result.reports_ingested = len(ready_reports)
        logger.info("archived %d reports of %d jobs in %s", len(ready_reports), len(job_rows),
                    info.file)
    return done_names + written


def _conflict(result: IngestResult, job_id: int, key: tuple[str, str, int], stored_time: float,
              report: dict[str, Any], entry: Any) -> None:
    """A report whose key is archived from another hook run: never written over the first (the
    archive holds one report per key) nor dropped as a duplicate: said in the log and in the
    result, and its spool file quarantined by `ingest` (kept for a person)."""
    node, phase, restart = key
    why = (f"conflict: job {job_id} already has a {phase} report of {node} for restart "
           f"{restart} from another run (archived time {stored_time:.3f}, this one "
           f"{report['time']:.3f}); not archived, kept here")
    logger.warning("%s", why)
    result.conflicts.append((entry.name if entry is not None else "", why))


def store_reports(archive_dir: Path, reports: list[dict[str, Any]], *,
                  timeout_s: float = 0.0, lock_wait_s: float = 30.0, compact: bool = True,
                  now: float | None = None) -> IngestResult:
    """Archive already validated reports (see `reports.validate_report`) without a spool.

    The same writer path as `ingest` (dedupe, job rows, one segment, compaction): for
    importing reports kept elsewhere, and for benchmarks. With the default `timeout_s=0`
    every job is written now, incomplete ones marked with their missing nodes.
    """
    t0 = time.perf_counter()
    check_ownership(archive_dir, None)
    archive = Archive(archive_dir)
    archive.check()
    result = IngestResult()
    by_job: dict[int, list[tuple[Any, dict[str, Any]]]] = defaultdict(list)
    for r in reports:
        by_job[int(r["job_id"])].append((None, r))
    with archive.writer(lock_wait_s) as w:
        now = time.time() if now is None else now
        wait = timeout_s if timeout_s > 0 else -math.inf  # 0: every job is ready now
        _archive(w, by_job, result, now=now, timeout_s=wait, prolog_only_timeout_s=wait,
                 spool=None)
        if compact:
            result.compactions = w.compact()
    result.seconds = time.perf_counter() - t0
    return result


OWNERSHIP_HINT = ("one user ingests: the owner of the spool and the archive, which nobody else "
                  "may write (docs/archive.md, Ownership); run ingest as that user, or chown "
                  "both to the user that runs it")


def check_ownership(archive_dir: Path, spool: Path | None) -> None:
    """Refuse, in one line and before creating anything, to ingest as anyone but the owner of
    the archive and the spool, or into directories others may write.

    The archive's `.lock`, `MANIFEST.json` and `segments/` must be ours too: a root ingest in
    an archive of SlurmUser's once left a root-owned 0600 `.lock`, and every EpilogSlurmctld
    ingest failed after it. A missing directory is left to the checks that follow (they say
    "does not exist").

    Raises:
        ArchiveError: with the directory, its owner and who runs the ingest.
    """
    me = os.geteuid()
    dirs = [("archive", archive_dir)] + ([("spool", spool)] if spool is not None else [])
    for what, path in dirs:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue  # a symlink or a file: Archive.check / SpoolDir refuse it
        problem = owner_problem(st, me)
        if problem:
            raise ArchiveError(f"ingest as {user_name(me)}: the {what} {path} is {problem}; "
                               f"{OWNERSHIP_HINT}")
    for name in (LOCK, MANIFEST, SEGMENTS):
        path = archive_dir / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != me:
            raise ArchiveError(f"ingest as {user_name(me)}: {path} is owned by "
                               f"{user_name(st.st_uid)}; {OWNERSHIP_HINT}")


def _wait_for_job(spool: Path, job_id: int, wait_s: float) -> None:
    """Poll the spool until every node of `job_id` has an epilog report, or `wait_s` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        scan = scan_spool(spool, job_id)
        if not scan.entries:
            return  # nothing spooled (or a timer ingest already took it)
        expected: set[str] = set()
        num_nodes = 0
        latest = max(e.restart for e in scan.entries)  # the attempt that runs now decides
        entries = [e for e in scan.entries if e.restart == latest]
        epilogs = {e.node for e in entries if e.phase == "epilog"}
        for entry in entries[:1] + [e for e in entries if e.phase == "epilog"][:1]:
            try:
                r = load_report(spool, entry)
            except (ReportError, FileNotFoundError):
                continue
            expected |= set(r["nodelist"])
            num_nodes = max(num_nodes, r["num_nodes"] or 0)
        if epilogs and expected <= epilogs and len(epilogs) >= num_nodes:
            return
        if time.monotonic() >= deadline:
            logger.info("job %d: not every node has reported after %g s; ingesting what is "
                        "complete", job_id, wait_s)
            return
        time.sleep(0.5)


def _stored_keys(old: Archived | None) -> dict[tuple[str, str, int], float]:
    return {} if old is None else old.keys


def _expected(reports: list[dict[str, Any]], old: Archived | None) -> tuple[set[str], int]:
    expected: set[str] = set()
    # The reports of one job share one nodelist object (reports.validate_report): add each once.
    for nodelist in {id(r["nodelist"]): r["nodelist"] for r in reports}.values():
        expected.update(nodelist)
    num_nodes = max((r["num_nodes"] or 0 for r in reports), default=0)
    if old is not None:
        expected.update(bytes(n["node"]).rstrip(b"\0").decode() for n in old.nodes if n["expected"])
        num_nodes = max(num_nodes, int(old.row["num_nodes"]))
    return expected, num_nodes


def _complete(expected: set[str], num_nodes: int, epilogs: set[str], reporting: set[str]) -> bool:
    if not epilogs:
        return False
    if expected:
        return expected <= epilogs
    if num_nodes:
        return len(epilogs) >= num_nodes
    return reporting <= epilogs  # no nodelist, no count: every node that spoke has finished


def _readiness(reports: list[dict[str, Any]], old: Archived | None, now: float,
               timeout_s: float, prolog_only_timeout_s: float) -> str | None:
    """Why a job's fresh reports may be archived now, or None to leave them in the spool.

    The job's latest attempt decides: a requeued job whose first attempt has finished waits
    for the epilogs of the attempt that runs now."""
    if old is not None:
        return "late"
    latest = max(_restart(r) for r in reports)
    if latest:
        reports = [r for r in reports if _restart(r) == latest]
    expected, num_nodes = _expected(reports, None)
    epilogs = {r["node"] for r in reports if r["phase"] == "epilog"}
    if _complete(expected, num_nodes, epilogs, {r["node"] for r in reports}):
        return "complete"
    epilog_times = [r["time"] for r in reports if r["phase"] == "epilog"]
    if epilog_times:
        return "timeout" if now - min(epilog_times) >= timeout_s else None
    return "timeout" if now - min(r["time"] for r in reports) >= prolog_only_timeout_s else None


def _first_time(reports: list[dict[str, Any]], keys: tuple[str, ...]) -> float | None:
    for r in reports:
        for k in keys:
            v = r.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                return float(v)
    return None


def _nanmin(*values: float | None) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return min(vals) if vals else math.nan


def _nanmax(*values: float | None) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return max(vals) if vals else math.nan


def _job_row(job_id: int, reports: list[dict[str, Any]], old: Archived | None,
             now: float) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    """The job's new /jobs row and /job_nodes rows: the archived state plus `reports`."""
    expected, num_nodes = _expected(reports, old)
    prolog, epilog, known = _seen_nodes(reports, old)
    if not expected:
        expected = set(known)
    complete = _complete(expected, num_nodes, epilog, known)
    times = [r["time"] for r in reports]
    prolog_times = [r["time"] for r in reports if r["phase"] == "prolog"]
    epilog_reports = [r for r in reports if r["phase"] == "epilog"]
    old_restarts = old.restarts if old is not None else 0
    restarts = max([old_restarts] + [_restart(r) for r in reports])
    statuses = [r["health"]["status_code"] for r in reports
                if r.get("health") and r["health"].get("status_code") is not None]
    o = old.row if old is not None else None
    text = (lambda k: bytes(o[k]).rstrip(b"\0").decode()) if o is not None else (lambda k: "")
    user = text("user") or next((r["user"] for r in reports if r.get("user")), "")
    partition = text("partition") or next((r["partition"] for r in reports if r.get("partition")), "")
    if o is not None:
        statuses.append(int(o["health_worst"]))
    start = _nanmin(_first_time(reports, _START_KEYS), *prolog_times,
                    float(o["start_unix_s"]) if o is not None else None)
    end = _nanmax(_first_time(epilog_reports, _END_KEYS), *(r["time"] for r in epilog_reports),
                  float(o["end_unix_s"]) if o is not None else None)
    row = (
        job_id, (int(o["revision"]) + 1) if o is not None else 1,
        S.COMPLETION_CODES["all_reported" if complete else "timeout"],
        user.encode(), partition.encode(), num_nodes, len(expected),
        len(prolog & expected), len(epilog & expected), len(expected - epilog),
        _nanmin(*times, float(o["first_report_unix_s"]) if o is not None else None),
        _nanmax(*times, float(o["last_report_unix_s"]) if o is not None else None),
        start, end, now,
        *_exit_fields(epilog_reports, o, restarts, keep_old=old_restarts == restarts),
        max(statuses) if statuses else -1, restarts,
        0, 0, 0, 0,
    )
    nodes = [(job_id, n.encode(), 1 if n in expected else 0, 1 if n in prolog else 0,
              1 if n in epilog else 0) for n in sorted(expected | known)]
    return row, nodes


def _seen_nodes(reports: list[dict[str, Any]], old: Archived | None
                ) -> tuple[set[str], set[str], set[str]]:
    """The nodes with a prolog report, with an epilog report, and every node heard of: in
    `reports` and in the archived revision `old`."""
    prolog: set[str] = {r["node"] for r in reports if r["phase"] == "prolog"}
    epilog: set[str] = {r["node"] for r in reports if r["phase"] == "epilog"}
    known: set[str] = set(prolog | epilog)
    if old is not None:
        for n in old.nodes:
            node = bytes(n["node"]).rstrip(b"\0").decode()
            known.add(node)
            if n["has_prolog"]:
                prolog.add(node)
            if n["has_epilog"]:
                epilog.add(node)
    return prolog, epilog, known


def _exit_fields(epilog_reports: list[dict[str, Any]], o: Any, restarts: int, *,
                 keep_old: bool) -> tuple[int, int, int]:
    """exit_code, exit_signal and derived_exit_code: the worst of the latest attempt's
    epilogs (and of the archived row `o` while that attempt is still the latest). An earlier
    attempt's (killed by the requeue) is replaced once a later attempt's epilog is archived."""
    latest_epilogs = [r for r in epilog_reports if _restart(r) == restarts]

    def worst(key: str) -> int:
        old_value = int(o[key]) if o is not None else S.MISSING_INT
        vals = [r[key] for r in latest_epilogs if r.get(key) is not None]
        if old_value != S.MISSING_INT and keep_old:
            vals.append(old_value)
        return max(vals) if vals else S.MISSING_INT

    return worst("exit_code"), worst("exit_signal"), worst("derived_exit_code")


def _tables(reports: list[dict[str, Any]], job_rows: list[tuple[Any, ...]],
            job_nodes: list[list[tuple[Any, ...]]]) -> Any:
    import numpy as np

    from bluevela.archive.tables import from_reports

    dt = S.dtypes()
    t = from_reports(reports)
    t.jobs = np.array(job_rows, dtype=dt["jobs"])
    flat = [n for nodes in job_nodes for n in nodes]
    t.job_nodes = np.array(flat, dtype=dt["job_nodes"])
    t.job_nodes_src = np.repeat(np.arange(len(job_rows), dtype=np.int64),
                                [len(n) for n in job_nodes])
    return t
