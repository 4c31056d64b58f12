"""Ingest of the series side files into the jobs' series files (docs/archive.md).

Built from the side files the epilog spools (`<spool>/<job>.<node>.series.bvts`, format
`bluevela.telemetry.format`), one node at a time, so memory stays that of one node's window
whatever the job's size; the file is written in the layout of `series_layout`.

A requeued job (same job id, SLURM_JOB_RESTART_COUNT k) spools one side file per node and
attempt (`<job>.<node>.r<k>.series.bvts` for k >= 1); all attempts go onto the one time grid.
A re-ingest adds nothing twice (a node's attempt already in the file is kept as it is); a late
node's (or a later attempt's) side file is added by rewriting the file (temp file, fsync,
rename). An existing file that cannot be read (a reader's lock, an I/O error, damage) is never
rebuilt over: its rows are the only copy of the nodes whose side files are done, so the new
side files wait in the spool until it can be read (or an operator moves it aside).

Each side file is checked against its job before anything is sized from it (`series_checks`).
A file that fails, and a job whose build fails on its data (MemoryError included), is
quarantined; the next job is built all the same.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bluevela.archive.series_checks import (
    JobWindow,
    SeriesLimits,
    SideFileWait,
    check_job_grid,
    check_record_times,
    check_side_file,
)
from bluevela.archive.series_layout import (
    GPU_METRICS,
    IB_METRICS,
    NODE_METRICS,
    NodeWindow,
    SeriesPlan,
    grid,
    group_columns,
    open_series,
    ordered_metrics,
    series_path,
    window_from_segment,
    write_rows,
)
from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    from bluevela.archive.spool import SpoolDir, SpoolEntry
    from bluevela.archive.store import Writer
    from bluevela.telemetry.format import Probe

logger = logging.getLogger(__name__)


@dataclass
class _Meta:
    """One node's window before it is loaded: its bounds and metrics."""

    node: str
    load: Callable[[], NodeWindow]
    t_min: float
    t_max: float
    interval_s: float
    n_gpu: int
    n_port: int
    gpu: set[str]
    ib: set[str]
    node_metrics: set[str]
    units: dict[str, str]
    restarts: tuple[int, ...] = (0,)  # the attempts this window holds
    source: str = ""  # the spool name of a new side file ("": a row of the existing file)


def _meta_of(probe: Probe, load: Callable[[], NodeWindow]) -> _Meta:
    """A node's bounds and columns from its side file's header (no record loaded).

    Raises:
        ValueError: record times not finite or not in order.
    """
    check_record_times(probe.t_first, probe.t_last)
    cols = group_columns(probe.header.columns)
    return _Meta(probe.header.node, load, probe.t_first, probe.t_last, probe.header.interval_s,
                 cols.n_gpu, len(cols.ports), set(cols.gpu), set(cols.ib), set(cols.node),
                 cols.units)


# -- the job's existing file ------------------------------------------------------------------


def _left(path: Path, exc: BaseException) -> ArchiveError:
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return ArchiveError(f"series file {path} cannot be read ({type(exc).__name__}: {why}): "
                        "left as it is")


def _old_row(path: Path, i: int) -> NodeWindow:
    """Row `i` of an existing series file as a node window (read when it is written again)."""
    try:
        with open_series(path) as sf:
            return sf.row(i)
    except ArchiveError as exc:
        raise _left(path, exc) from exc


def _old_metas(path: Path) -> list[_Meta]:
    """The nodes of an existing series file, each loaded only when written again (with the
    attempts its row holds).

    Raises:
        ArchiveError: the file is there but cannot be read now (a lock held by a reader, an
            I/O error, damage, not a regular file). It is left as it is: its rows are the
            only copy of the nodes whose side files are done.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _left(path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        raise ArchiveError(f"series file {path} is not a regular file: left as it is")
    try:
        with open_series(path) as sf:
            if not len(sf.time):
                return []
            t_min, t_max = float(sf.time[0]), float(sf.time[-1])
            return [_Meta(node, functools.partial(_old_row, path, i), t_min, t_max,
                          sf.interval_s, sf.n_gpus, sf.n_ports, set(sf.gpu), set(sf.ib),
                          set(sf.node), dict(sf.units), tuple(sf.attempts.get(node, (0,))))
                    for i, node in enumerate(sf.nodes)]
    except ArchiveError as exc:
        raise _left(path, exc) from exc


def build_series(path: Path, job_id: int, metas: list[_Meta]) -> int:
    """Write the series file of `job_id` from node windows (loaded one node at a time; a
    node's windows of several attempts share its row); returns N."""
    metas = sorted(metas, key=lambda m: (m.node, min(m.restarts)))
    by_node: dict[str, list[_Meta]] = {}
    for m in metas:
        by_node.setdefault(m.node, []).append(m)
    interval = min(m.interval_s for m in metas)
    t0, T = grid(min(m.t_min for m in metas), max(m.t_max for m in metas), interval)
    units: dict[str, str] = {}
    for m in metas:
        for k, v in m.units.items():
            units.setdefault(k, v)
    plan = SeriesPlan(job_id, interval, t0, T, list(by_node),
                      max(m.n_gpu for m in metas), max(m.n_port for m in metas),
                      ordered_metrics(set().union(*(m.gpu for m in metas)), GPU_METRICS),
                      ordered_metrics(set().union(*(m.ib for m in metas)), IB_METRICS),
                      ordered_metrics(set().union(*(m.node_metrics for m in metas)),
                                      NODE_METRICS), units)
    attempts = {node: sorted({k for m in ms for k in m.restarts})
                for node, ms in by_node.items()}
    rows = ([m.load() for m in ms] if len(ms) > 1 else ms[0].load() for ms in by_node.values())
    write_rows(path, plan, rows, attempts)
    return len(by_node)


def _check_plan(metas: list[_Meta], limits: SeriesLimits) -> None:
    """Raises:
        SideFileError: one node's row of the job's grid would be too large.
    """
    check_job_grid(min(m.interval_s for m in metas), min(m.t_min for m in metas),
                   max(m.t_max for m in metas), max(max(m.n_gpu, m.n_port) for m in metas),
                   limits)


# -- the ingest -------------------------------------------------------------------------------


def ingest_side_files(w: Writer, sd: SpoolDir, archive_dir: Path, entries: list[SpoolEntry],
                      *, limits: SeriesLimits | None = None, now: float | None = None
                      ) -> tuple[list[str], list[tuple[str, str]]]:
    """Add the spooled series side files of archived jobs to their series files.

    Side files of jobs not yet archived wait in the spool. A node already in the job's file is
    not added again (its side file is just done). A side file that is a symlink, has a bad
    header, a truncated record, another node's/job's header, or does not fit its job
    (`check_side_file`) is quarantined, and so is one whose records cannot be loaded. A job
    whose series cannot be built from its new side files' data (a ValueError, MemoryError)
    has them quarantined. An existing series file that cannot be read (a reader's lock, an
    I/O error, damage), an OSError (a full disk) or any other exception (a bug) leaves the
    file as it is and the side files in the spool for the next ingest: rows that cannot be
    read are never rebuilt over, and user data is quarantined only for what it holds. Either
    way the next job is built.

    Args:
        limits: the site's bounds (`SeriesLimits.from_site`); default: no node class known.
        now: the ingest's clock (tests).

    Returns:
        (spool names now done, [(quarantined name, reason)]).
    """
    import time

    from bluevela.archive.job_index import archived_jobs

    if not entries:
        return [], []
    limits = SeriesLimits() if limits is None else limits
    now = time.time() if now is None else now
    archived = archived_jobs(w, sorted({e.job_id for e in entries}))
    by_job: dict[int, list[SpoolEntry]] = {}
    for e in entries:
        if e.job_id in archived:
            by_job.setdefault(e.job_id, []).append(e)
    done: list[str] = []
    bad: list[tuple[str, str]] = []
    for job_id, job_entries in sorted(by_job.items()):
        run = _JobRun(sd, job_id, JobWindow.of_row(archived[job_id].row), limits, now)
        _ingest_or_keep(run, series_path(archive_dir, job_id), job_entries)
        done += run.done
        bad += run.bad
    return done, bad


class _BadSideFile(Exception):
    """A new side file's records could not be loaded (the file is named)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(reason)
        self.name = name
        self.reason = reason


class _BuildFailed(Exception):
    """A job's series could not be built from its new side files' data."""

    def __init__(self, names: list[str], reason: str) -> None:
        super().__init__(reason)
        self.names = names
        self.reason = reason


@dataclass
class _JobRun:
    """One job's ingest: its side files done, quarantined and new so far."""

    sd: SpoolDir
    job_id: int
    job: JobWindow
    limits: SeriesLimits
    now: float
    have: set[tuple[str, int]] = field(default_factory=set)  # (node, attempt) in the file
    done: list[str] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    new_names: list[str] = field(default_factory=list)

    def quarantine(self, name: str, reason: str) -> None:
        from bluevela.archive.spool import quarantine

        quarantine(self.sd, name, reason)
        self.bad.append((name, reason))


def _ingest_or_keep(run: _JobRun, path: Path, entries: list[SpoolEntry]) -> None:
    """`_ingest_job`, its failures sorted: bad data is quarantined, anything else leaves
    the side files in the spool for the next ingest."""
    try:
        _ingest_job(run, path, entries)
    except _BuildFailed as failed:
        reason = f"series side file: job {run.job_id} not built from it: {failed.reason}"
        logger.error("job %d: series file not written: %s", run.job_id, failed.reason)
        run.done, run.bad = [], []
        for name in failed.names:
            run.quarantine(name, reason)
    except (OSError, ArchiveError) as exc:
        # The reports are durable already; the side files stay for the next ingest.
        logger.error("job %d: series file not written: %s; its side files stay in the "
                     "spool for the next ingest", run.job_id, exc)
        run.done, run.bad = [], []
    except Exception:  # noqa: BLE001 - a bug: logged whole, no user data quarantined
        logger.exception("job %d: series file not written (a bug, not the data: its side "
                         "files stay in the spool for the next ingest)", run.job_id)
        run.done, run.bad = [], []


def _ingest_job(run: _JobRun, path: Path, entries: list[SpoolEntry]) -> None:
    """Raises:
        _BuildFailed: the build failed on the new side files' data (they are named).
        OSError, ArchiveError: the series file could not be written (nothing is quarantined).
    """
    # Never rebuild over rows that cannot be read: the side files of the nodes in the file are
    # done (and pruned from done/ after a week); its rows are their only copy.
    metas = _old_metas(path)
    run.have = {(m.node, k) for m in metas for k in m.restarts}
    for e in sorted(entries, key=lambda x: (x.node, x.restart)):
        meta = _admit(run, e)
        if meta is not None:
            metas.append(meta)
    if run.new_names:
        _build(run, path, metas)


def _admit(run: _JobRun, e: SpoolEntry) -> _Meta | None:
    """A new side file's node window (not loaded yet), or None: already in the file (done),
    gone, waiting, or quarantined."""
    from bluevela.telemetry.format import FormatError

    if (e.node, e.restart) in run.have:
        run.done.append(e.name)
        return None
    try:
        meta = _probe_side_file(run, e)
    except FileNotFoundError:
        return None
    except SideFileWait as why:
        logger.info("job %d: side file %s waits: %s", run.job_id, e.name, why)
        return None
    except (OSError, FormatError, ValueError) as exc:
        reason = f"series side file: {getattr(exc, 'strerror', None) or exc}"
        if isinstance(exc, OSError) and exc.errno == 40:  # ELOOP: a symlink
            reason = "series side file: a symlink (never followed)"
        run.quarantine(e.name, reason)
        return None
    run.done.append(e.name)
    if meta is None:  # a node named `<x>.r<k>`: its first run, in the file already
        return None
    run.have.add((meta.node, meta.restarts[0]))
    run.new_names.append(e.name)
    return meta


def _probe_side_file(run: _JobRun, e: SpoolEntry) -> _Meta | None:
    """The side file's header checked against its name, its job and the limits.

    Raises:
        OSError, FormatError, SideFileError: it does not fit (quarantine it).
        SideFileWait: it may fit once more of the job is archived.
    """
    from bluevela.telemetry.format import FormatError, probe_file

    probe = probe_file(e.name, dir_fd=run.sd.fd)
    node, restart = e.node, e.restart
    if restart and probe.header.node == f"{node}.r{restart}":
        node, restart = probe.header.node, 0  # a node named `<x>.r<k>`, first run
        if (node, 0) in run.have:
            return None
    if probe.header.node != node:
        raise FormatError(f"header node {probe.header.node!r} does not match the name")
    if probe.header.job_id is not None and probe.header.job_id != run.job_id:
        raise FormatError(f"header job_id {probe.header.job_id} does not match")
    age = run.now - os.stat(e.name, dir_fd=run.sd.fd, follow_symlinks=False).st_mtime
    check_side_file(probe, run.job, restart, run.limits, now=run.now, age_s=age)
    meta = _meta_of(probe, functools.partial(_load_side_file, run.sd, e.name))
    meta.restarts = (restart,)
    meta.source = e.name
    return meta


def _load_side_file(sd: SpoolDir, name: str) -> NodeWindow:
    """Raises:
        _BadSideFile: its records cannot be loaded (a FormatError, SideFileError).
    """
    from bluevela.telemetry.format import read_file

    try:
        return window_from_segment(read_file(name, strict=True, dir_fd=sd.fd))
    except ValueError as exc:  # FormatError, SideFileError: this file's records
        raise _BadSideFile(name, str(exc)) from exc


def _build(run: _JobRun, path: Path, metas: list[_Meta]) -> None:
    """Write the job's file with its new side files; one whose records break its load is
    quarantined alone and the others are built.

    Raises:
        _BuildFailed: the build failed on the new side files' data.
    """
    while run.new_names:
        # Only errors that say "this data is bad" quarantine: a bug (TypeError, KeyError...)
        # goes up and the side files stay for the next ingest.
        try:
            _check_plan(metas, run.limits)
            n = build_series(path, run.job_id, metas)
        except _BadSideFile as exc:  # one file's records: it alone, the others are built
            run.quarantine(exc.name, f"series side file: {exc.reason}")
            run.done.remove(exc.name)
            run.new_names.remove(exc.name)
            metas = [m for m in metas if m.source != exc.name]
            continue
        except MemoryError:
            raise _BuildFailed(run.new_names, "out of memory") from None
        except ValueError as exc:  # SideFileError, a value h5py cannot store (a UUID...)
            raise _BuildFailed(run.new_names, str(exc)) from exc
        logger.info("job %d: series of %d node(s) in %s (%d new)", run.job_id, n, path,
                    len(run.new_names))
        break
