"""The checks on a series side file before anything is sized from it (docs/archive.md).

A side file (`<spool>/<job>.<node>[.r<k>].series.bvts`) is written on a node, so ingest treats
it as hostile: `check_side_file` reads its header and bounds only (a `Probe`, no record loaded)
and holds them against the job's archived window (`JobWindow`) and the site's bounds
(`SeriesLimits`): GPU indices within the node's class, a bounded number of IB ports, the site's
interval range, record times inside the job's window plus slack, a record count the sampler
could have written in that time, column names from a closed pattern, and the memory one
node's row would take. `check_job_grid` holds the union of a job's side files to the same
memory bound. Pure functions: no file is opened here.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bluevela.archive.series_layout import MAX_SAMPLES, RESERVED, column_place

if TYPE_CHECKING:
    from bluevela.site import Site
    from bluevela.telemetry.format import Probe

logger = logging.getLogger(__name__)

# What a side file's columns may be named: `gpu<i>.<metric>`, `ib.<hca>/<port>.<metric>`,
# `node.<metric>` (the sampler's own names, bluevela/telemetry/sampler.py). A metric is one
# HDF5 name (no '/', no '.'), and never the datasets the layout keeps beside the metrics.
_METRIC = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
_UNIT = re.compile(r"^[A-Za-z0-9%/._ -]{0,16}$")
MAX_GPUS = 64  # a node in no class of the site (or no site): GPU indices 0..63
MAX_PORTS = 32  # IB ports of one node (the sampler records every port in sysfs)
MAX_METRICS = 64  # distinct metrics per group (gpu, ib, node)
MIN_INTERVAL_S = 0.1  # telemetry.interval_s bounds in site.yaml (bluevela/site.py Telemetry)
MAX_INTERVAL_S = 3600.0
WINDOW_SLACK_S = 600.0  # node clocks and the epilog's cut around the job's archived window
SIDE_WAIT_S = 3600.0  # a side file ending past the job's window waits this long for its report
MAX_NODE_BYTES = 1 << 30  # one node's row while it is written (one node in memory at a time)


class SideFileError(ValueError):
    """A side file that does not fit its job (quarantined with this text as the reason)."""


class SideFileWait(Exception):
    """A side file that may yet fit its job once more of the job is archived (left waiting)."""


@dataclass(frozen=True)
class JobWindow:
    """What the archive knows of a job when its side files are checked."""

    start: float  # earliest of start time and first report (unix s)
    end: float  # latest of end time and last report
    restarts: int  # highest attempt archived

    @classmethod
    def of_row(cls, row: Any) -> JobWindow:
        """From a /jobs row (NaN start/end fall back to the report times)."""
        from bluevela.archive.job_index import row_restarts

        def num(key: str) -> float:
            v = float(row[key])
            return v if math.isfinite(v) else math.nan

        starts = [v for v in (num("start_unix_s"), num("first_report_unix_s"))
                  if not math.isnan(v)]
        ends = [v for v in (num("end_unix_s"), num("last_report_unix_s")) if not math.isnan(v)]
        return cls(min(starts, default=math.nan), max(ends, default=math.nan),
                   row_restarts(row))


@dataclass(frozen=True)
class SeriesLimits:
    """Bounds on a side file: per node, the GPU count of its class (`gpus`, from site.yaml;
    a node in no class gets `MAX_GPUS`); the rest as the module constants say."""

    gpus: dict[str, int] = field(default_factory=dict)
    max_ports: int = MAX_PORTS
    min_interval_s: float = MIN_INTERVAL_S
    max_interval_s: float = MAX_INTERVAL_S
    slack_s: float = WINDOW_SLACK_S
    wait_s: float = SIDE_WAIT_S
    max_node_bytes: int = MAX_NODE_BYTES

    @classmethod
    def from_site(cls, site: Site) -> SeriesLimits:
        """The GPU count of each node's class; room for a side file as large as the sampler
        keeps (`telemetry.max_mb`: its records are held about twice while a row is made)."""
        keep = int(3 * site.telemetry.max_mb * 2**20)
        return cls(gpus={h: c.gpus for c in site.node_classes.values() for h in c.hostnames},
                   max_node_bytes=max(MAX_NODE_BYTES, keep))

    @classmethod
    def configured(cls) -> SeriesLimits:
        """From the site file a root entry point reads (`$BV_SITE`, else
        /etc/bluevela/site.yaml); without a readable one no node class is known."""
        from bluevela.errors import BluevelaError
        from bluevela.site import load_site

        try:
            return cls.from_site(load_site(cwd=False))
        except (BluevelaError, OSError, ValueError) as exc:
            logger.info("side files checked without node classes: %s", exc)
            return cls()

    def gpus_of(self, node: str) -> int:
        return self.gpus.get(node, self.gpus.get(node.split(".")[0], MAX_GPUS))


@dataclass
class _Columns:
    """What `_check_columns` has seen so far."""

    max_gpus: int
    max_ports: int
    seen: set[tuple[str, str]] = field(default_factory=set)
    metrics: dict[str, set[str]] = field(
        default_factory=lambda: {"gpu": set(), "ib": set(), "node": set()})
    ports: set[str] = field(default_factory=set)
    n_gpu: int = 0

    def place(self, name: str, comp: str) -> str:
        """The group of a column of `comp`, its GPU index or port bounded.

        Raises:
            SideFileError: an unknown component, a GPU outside the class, too many ports.
        """
        place = column_place(comp)
        if place is None:
            raise SideFileError(f"column {name[:80]!r}: unknown component {comp[:40]!r}")
        group, key = place
        if group == "gpu":
            if int(key) >= self.max_gpus:  # type: ignore[arg-type]
                raise SideFileError(f"column {name!r}: GPU index {key} outside "
                                    f"the node's class ({self.max_gpus} GPU(s))")
            self.n_gpu = max(self.n_gpu, int(key) + 1)  # type: ignore[arg-type]
        elif group == "ib":
            self.ports.add(str(key))
            if len(self.ports) > self.max_ports:
                raise SideFileError(f"more than {self.max_ports} IB ports")
        return group


def _check_columns(probe: Probe, max_gpus: int, max_ports: int) -> tuple[int, int]:
    """Column names from the closed pattern, GPU indices below `max_gpus`, ports bounded;
    returns the rows the node takes in the gpu and ib arrays (1 + highest GPU index, ports).

    Raises:
        SideFileError: the first column that does not fit, named.
    """
    cols = _Columns(max_gpus, max_ports)
    for c in probe.header.columns:
        comp, name = c.component, c.name
        if len(name) > 128 or not name.startswith(comp + "."):
            raise SideFileError(f"column {name[:80]!r} is not <component>.<metric>")
        metric = name[len(comp) + 1:]
        group = cols.place(name, comp)
        if not _METRIC.match(metric) or metric == RESERVED[group]:
            raise SideFileError(f"column {name[:80]!r}: metric {metric[:40]!r} is not a "
                                f"metric name ([a-z][a-z0-9_]*)")
        if not _UNIT.match(c.unit):
            raise SideFileError(f"column {name!r}: unit {c.unit[:20]!r} is not a unit")
        if (comp, metric) in cols.seen:
            raise SideFileError(f"duplicate column {name!r}")
        cols.seen.add((comp, metric))
        cols.metrics[group].add(metric)
        if len(cols.metrics[group]) > MAX_METRICS:
            raise SideFileError(f"more than {MAX_METRICS} {group} metrics")
    return cols.n_gpu, len(cols.ports)


def check_record_times(t0: float, t1: float) -> None:
    """Raises:
        SideFileError: record times not finite and in order.
    """
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise SideFileError("record times are not finite and in order")


def _check_window(probe: Probe, job: JobWindow, restart: int, limits: SeriesLimits, *,
                  now: float, age_s: float) -> tuple[float, float]:
    """The file's records inside the job's archived window plus slack; returns that window.

    Raises:
        SideFileError, SideFileWait: as `check_side_file`.
    """
    t0, t1, interval = probe.t_first, probe.t_last, probe.header.interval_s
    young = age_s < limits.wait_s
    if restart > job.restarts:
        if young:
            raise SideFileWait(f"attempt {restart} is not archived yet")
        raise SideFileError(f"attempt {restart} was never archived (job has "
                            f"{job.restarts})")
    if not (math.isfinite(job.start) and math.isfinite(job.end)):
        raise SideFileError("the job's archived window is unknown")
    slack = max(limits.slack_s, 2 * interval)
    lo, hi = job.start - slack, job.end + slack
    if t0 < lo:
        raise SideFileError(f"records start {job.start - t0:.0f} s before the job "
                            f"(slack {slack:g} s)")
    if t1 > hi:
        if young and t1 <= now + slack:  # its node's late epilog report may follow it
            raise SideFileWait("records end after the job's archived window")
        raise SideFileError(f"records end {t1 - job.end:.0f} s after the job "
                            f"(slack {slack:g} s)")
    return lo, hi


def check_side_file(probe: Probe, job: JobWindow, restart: int, limits: SeriesLimits, *,
                    now: float, age_s: float) -> None:
    """Check a side file (header and bounds, no record loaded) against its job, before
    anything is sized from it.

    Args:
        probe: the file's header, record count and first/last record times.
        job: the job's archived window.
        restart: the attempt the file belongs to.
        limits: the site's bounds.
        now: the ingest's clock.
        age_s: seconds since the file was written (its mtime).

    Raises:
        SideFileError: it does not fit (quarantine, with this reason).
        SideFileWait: it ends after the job's archived window, or belongs to an attempt not yet
            archived, and is young enough that its reports may still come.
    """
    h = probe.header
    if not limits.min_interval_s <= h.interval_s <= limits.max_interval_s:
        raise SideFileError(f"interval_s {h.interval_s:g} outside the site's range "
                            f"{limits.min_interval_s:g}-{limits.max_interval_s:g} s")
    n_gpu, n_port = _check_columns(probe, limits.gpus_of(h.node), limits.max_ports)
    check_record_times(probe.t_first, probe.t_last)
    lo, hi = _check_window(probe, job, restart, limits, now=now, age_s=age_s)
    span = probe.t_last - probe.t_first
    if probe.n_records > 2 * span / h.interval_s + 16:
        raise SideFileError(f"{probe.n_records} records in {span:.0f} s at an interval of "
                            f"{h.interval_s:g} s")
    # The grid of the job at this interval, and the node's row while it is written: the
    # window's values [columns, records] and one [components, samples] array per metric.
    need = row_bytes((hi - lo) / h.interval_s + 1, max(n_gpu, n_port),
                     probe.n_records, len(h.columns))
    if need > limits.max_node_bytes:
        raise SideFileError(f"the node's row would take {need / 2**30:.1f} GiB "
                            f"(> {limits.max_node_bytes / 2**30:g} GiB): window too long for "
                            f"interval_s {h.interval_s:g}")


def check_job_grid(interval_s: float, t_min: float, t_max: float, components: int,
                   limits: SeriesLimits) -> None:
    """The job's grid (all nodes, the shortest interval) times its widest node, before the
    file is made: each side file fitted on its own, their union must too.

    Raises:
        SideFileError: one node's row would take more than `limits.max_node_bytes`.
    """
    samples = (t_max - t_min) / interval_s + 1
    need = row_bytes(samples, components, 0, 0)
    if samples > MAX_SAMPLES or need > limits.max_node_bytes:
        raise SideFileError(f"the job's grid of {samples:.0f} samples x {components} rows "
                            f"would take {need / 2**30:.1f} GiB per node")


def row_bytes(samples: float, components: int, records: int, columns: int) -> float:
    """About the most memory one node's row takes while written: its window's records, its
    [components, records] arrays, and the [components, samples] row of one metric at a time
    (twice: the array and h5py's copy)."""
    return 4.0 * (2 * samples * max(components, 1) + 2 * records * (columns + 2))
