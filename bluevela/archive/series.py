"""Per-job time series: `<archive>/series/<job_id>.h5`, one file per job (docs/archive.md).

Built by ingest from the side files the epilog spools (`<spool>/<job>.<node>.series.bvts`,
format `bluevela.telemetry.format`), one node at a time, so memory stays that of one node's
window whatever the job's size. Layout (schema 1)::

    attrs: format="bluevela-job-series", schema_version=1, job_id, interval_s, t0_unix_s,
           n_samples
    /time            float64 [T]       t0 + k * interval (unix s)
    /nodes           str [N]           sorted node names
    /gpu/<metric>    float32 [N, G, T] util_pct, mem_used_bytes, power_w, temp_c, sm_clock_mhz,
                                       clocks_event_reasons, xid_count (attr `unit`)
    /gpu/uuid        bytes [N, G]
    /ib/<metric>     float32 [N, P, T] rx_bytes_per_s, tx_bytes_per_s, errors_per_s
    /ib/port         bytes [N, P]      "mlx5_0/1"
    /node/<metric>   float32 [N, T]    cpu_busy_pct, cpu_throttled_pct, mem_used_bytes,
                                       net_rx_bytes_per_s, net_tx_bytes_per_s

NaN where a node had no such GPU/port or no sample near a grid point (each sample goes to the
nearest grid point within interval/2). Chunked per node, shuffle + gzip.

A requeued job (same job id, SLURM_JOB_RESTART_COUNT k) spools one side file per node and
attempt (`<job>.<node>.r<k>.series.bvts` for k >= 1); all attempts go onto the one time grid,
a node's row holding each attempt's samples (NaN in the gap between attempts). The root
attribute `attempts` (JSON, {node: [restart, ...]}) says which attempts each row holds; a file
without it holds attempt 0 of each node.

`read_series` / `write_series` are the API the efficiency view and the fleet report use.
A re-ingest adds nothing twice (a node's attempt already in the file is kept as it is); a late
node's (or a later attempt's) side file is added by rewriting the file (temp file, fsync,
rename). An existing file that cannot be read (a reader's lock, an I/O error, damage) is never
rebuilt over: its rows are the only copy of the nodes whose side files are done, so the new
side files wait in the spool until it can be read (or an operator moves it aside).

A side file is checked against its job before anything is sized from it (`check_side_file`,
`SeriesLimits`): GPU indices within the node's class, a bounded number of IB ports, the site's
interval range, record times inside the job's archived window plus slack, a record count the
sampler could have written in that time, column names from a closed pattern, and the memory
one node's row would take. A file that fails, and a job whose build fails on its data
(MemoryError included), is quarantined; the next job is built all the same.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    import numpy as np

    from bluevela.archive.spool import SpoolDir, SpoolEntry
    from bluevela.archive.store import Writer
    from bluevela.site import Site
    from bluevela.telemetry.format import Probe, Segment

logger = logging.getLogger(__name__)

FORMAT = "bluevela-job-series"
SCHEMA_VERSION = 1
SERIES_DIR = "series"
GPU_METRICS = ("util_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz",
               "clocks_event_reasons", "xid_count")
IB_METRICS = ("rx_bytes_per_s", "tx_bytes_per_s", "errors_per_s")
NODE_METRICS = ("cpu_busy_pct", "cpu_throttled_pct", "mem_used_bytes", "net_rx_bytes_per_s",
                "net_tx_bytes_per_s")
UNITS = {"util_pct": "%", "mem_used_bytes": "B", "power_w": "W", "temp_c": "Cel",
         "sm_clock_mhz": "MHz", "clocks_event_reasons": "bitmask", "xid_count": "1",
         "rx_bytes_per_s": "B/s", "tx_bytes_per_s": "B/s", "errors_per_s": "1/s",
         "cpu_busy_pct": "%", "cpu_throttled_pct": "%", "net_rx_bytes_per_s": "B/s",
         "net_tx_bytes_per_s": "B/s"}
MAX_SAMPLES = 50_000_000  # a window longer than this is refused (a clock gone wild)
_GPU_COMPONENT = re.compile(r"^gpu([0-9]{1,4})$")
_CHUNK_T = 4096
# What a side file's columns may be named: `gpu<i>.<metric>`, `ib.<hca>/<port>.<metric>`,
# `node.<metric>` (the sampler's own names, bluevela/telemetry/sampler.py). A metric is one
# HDF5 name (no '/', no '.'), and never the datasets the layout keeps beside the metrics.
_METRIC = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
_IB_PORT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,31}/[0-9]{1,3}$")
_UNIT = re.compile(r"^[A-Za-z0-9%/._ -]{0,16}$")
_RESERVED = {"gpu": "uuid", "ib": "port", "node": ""}
MAX_GPUS = 64  # a node in no class of the site (or no site): GPU indices 0..63
MAX_PORTS = 32  # IB ports of one node (the sampler records every port in sysfs)
MAX_METRICS = 64  # distinct metrics per group (gpu, ib, node)
MIN_INTERVAL_S = 0.1  # telemetry.interval_s bounds in site.yaml (bluevela/site.py Telemetry)
MAX_INTERVAL_S = 3600.0
WINDOW_SLACK_S = 600.0  # node clocks and the epilog's cut around the job's archived window
SIDE_WAIT_S = 3600.0  # a side file ending past the job's window waits this long for its report
MAX_NODE_BYTES = 1 << 30  # one node's row while it is written (one node in memory at a time)


@dataclass
class JobSeries:
    """One job's time series, as numpy arrays (see the module docstring for shapes)."""

    job_id: int
    interval_s: float
    time: np.ndarray
    nodes: list[str]
    gpu: dict[str, np.ndarray] = field(default_factory=dict)
    ib: dict[str, np.ndarray] = field(default_factory=dict)
    node: dict[str, np.ndarray] = field(default_factory=dict)
    gpu_uuid: np.ndarray | None = None  # bytes [N, G]
    ib_port: np.ndarray | None = None  # bytes [N, P]
    units: dict[str, str] = field(default_factory=dict)

    @property
    def t0(self) -> float:
        return float(self.time[0]) if len(self.time) else math.nan


def series_path(archive_dir: Path, job_id: int) -> Path:
    return Path(archive_dir) / SERIES_DIR / f"{int(job_id)}.h5"


# -- one node's window ------------------------------------------------------------------------


@dataclass
class NodeWindow:
    """One node's samples on its own times: arrays [G_i, T_i], [P_i, T_i], [T_i]."""

    node: str
    interval_s: float
    times: np.ndarray
    gpu: dict[str, np.ndarray]
    ib: dict[str, np.ndarray]
    node_metrics: dict[str, np.ndarray]
    uuids: list[str]
    ports: list[str]
    units: dict[str, str]


def window_from_segment(seg: Segment) -> NodeWindow:
    """Split a BVTS file's columns into the gpu/ib/node groups."""
    import numpy as np

    h = seg.header
    n = len(h.columns)
    rec = np.frombuffer(seg.data, dtype=np.dtype([("t", "<f8"), ("v", "<f4", (n,))]))
    times = rec["t"].astype(np.float64)
    vals = rec["v"].reshape(len(rec), n)
    gpu_cols: dict[str, dict[int, int]] = {}
    ib_cols: dict[str, dict[str, int]] = {}
    node_cols: dict[str, int] = {}
    units: dict[str, str] = {}
    for j, c in enumerate(h.columns):
        metric = c.metric
        units.setdefault(metric, c.unit)
        m = _GPU_COMPONENT.match(c.component)
        if m:
            gpu_cols.setdefault(metric, {})[int(m.group(1))] = j
        elif c.component.startswith("ib."):
            ib_cols.setdefault(metric, {})[c.component[3:]] = j
        elif c.component == "node":
            node_cols[metric] = j
    n_gpu = 1 + max((i for cols in gpu_cols.values() for i in cols), default=-1)
    ports = sorted({p for cols in ib_cols.values() for p in cols})
    T = len(times)
    gpu = {}
    for metric, cols in gpu_cols.items():
        arr = np.full((n_gpu, T), np.nan, dtype=np.float32)
        for i, j in cols.items():
            arr[i] = vals[:, j]
        gpu[metric] = arr
    ib = {}
    for metric, pcols in ib_cols.items():
        arr = np.full((len(ports), T), np.nan, dtype=np.float32)
        for pi, p in enumerate(ports):
            if p in pcols:
                arr[pi] = vals[:, pcols[p]]
        ib[metric] = arr
    node_m = {metric: vals[:, j].astype(np.float32) for metric, j in node_cols.items()}
    uuids = [h.components.get(f"gpu{i}", {}).get("uuid", "") for i in range(n_gpu)]
    return NodeWindow(h.node, h.interval_s, times, gpu, ib, node_m, uuids, ports, units)


def _grid_index(times: np.ndarray, t0: float, interval: float, T: int) -> tuple[Any, Any]:
    """Grid positions of `times` and which of them are kept (nearest point within interval/2)."""
    import numpy as np

    k = np.rint((times - t0) / interval).astype(np.int64)
    ok = (k >= 0) & (k < T) & (np.abs(times - (t0 + k * interval)) <= interval / 2 + 1e-9) \
        & np.isfinite(times)
    return k, ok


# -- the HDF5 file ----------------------------------------------------------------------------


@dataclass
class _Plan:
    job_id: int
    interval_s: float
    t0: float
    T: int
    nodes: list[str]
    G: int
    P: int
    gpu_metrics: list[str]
    ib_metrics: list[str]
    node_metrics: list[str]
    units: dict[str, str]


def _grid(t_min: float, t_max: float, interval: float) -> tuple[float, int]:
    t0 = math.floor(t_min / interval + 0.5) * interval
    T = int(round((t_max - t0) / interval)) + 1
    if T > MAX_SAMPLES:
        raise ArchiveError(f"series window of {T} samples is too long")
    return t0, max(T, 1)


def _ordered(found: Iterable[str], standard: tuple[str, ...]) -> list[str]:
    extra = sorted(set(found) - set(standard))
    return list(standard) + extra


def _create(f: Any, plan: _Plan) -> None:
    import numpy as np

    f.attrs["format"] = FORMAT
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["job_id"] = plan.job_id
    f.attrs["interval_s"] = plan.interval_s
    f.attrs["t0_unix_s"] = plan.t0
    f.attrs["n_samples"] = plan.T
    f.create_dataset("time", data=plan.t0 + np.arange(plan.T, dtype=np.float64) * plan.interval_s)
    import h5py

    f.create_dataset("nodes", data=plan.nodes, dtype=h5py.string_dtype())
    N, T = len(plan.nodes), plan.T
    tc = min(T, _CHUNK_T)

    def make(group: str, name: str, shape: tuple[int, ...], chunks: tuple[int, ...]) -> None:
        opts: dict[str, Any] = {}
        if all(shape):
            opts = {"chunks": chunks, "shuffle": True, "compression": "gzip",
                    "compression_opts": 4}
        ds = f.create_dataset(f"{group}/{name}", shape=shape, dtype="<f4",
                              fillvalue=np.float32(np.nan), **opts)
        ds.attrs["unit"] = plan.units.get(name, UNITS.get(name, ""))

    for m in plan.gpu_metrics:
        make("gpu", m, (N, plan.G, T), (1, max(plan.G, 1), tc))
    for m in plan.ib_metrics:
        make("ib", m, (N, plan.P, T), (1, max(plan.P, 1), tc))
    for m in plan.node_metrics:
        make("node", m, (N, T), (1, tc))
    f.create_dataset("gpu/uuid", shape=(N, plan.G), dtype="S64")
    f.create_dataset("ib/port", shape=(N, plan.P), dtype="S64")


# The NodeWindow attribute holding each group's metrics.
_SOURCES = {"gpu": "gpu", "ib": "ib", "node": "node_metrics"}


def _put(f: Any, plan: _Plan, row: int, windows: NodeWindow | list[NodeWindow]) -> None:
    """Write one node's window(s) into row `row` (one node in memory at a time). Several
    windows (a requeued job's attempts, in attempt order) go onto the same row, a later one
    over an earlier one where both have a grid point."""
    import numpy as np

    ws = windows if isinstance(windows, list) else [windows]
    grid = [_grid_index(w.times, plan.t0, plan.interval_s, plan.T) for w in ws]

    def place(group: str, m: str, rows: int | None) -> None:
        # rows: the component count (GPUs, ports) of a [component, time] source; None: [time].
        out = None
        for w, (k, ok) in zip(ws, grid, strict=True):
            src = getattr(w, _SOURCES[group]).get(m)
            if src is None or (rows is not None and not src.shape[0]):
                continue
            if out is None:
                shape = (rows, plan.T) if rows is not None else (plan.T,)
                out = np.full(shape, np.nan, dtype=np.float32)
            if rows is None:
                out[k[ok]] = src[ok]
            else:
                out[:src.shape[0], k[ok]] = src[:, ok]
        if out is not None:
            f[f"{group}/{m}"][row] = out

    for m in plan.gpu_metrics:
        place("gpu", m, plan.G)
    for m in plan.ib_metrics:
        place("ib", m, plan.P)
    for m in plan.node_metrics:
        place("node", m, None)
    w = next((x for x in reversed(ws) if x.uuids or x.ports), ws[-1])
    if plan.G:
        f["gpu/uuid"][row] = np.array([u.encode()[:64] for u in w.uuids]
                                      + [b""] * (plan.G - len(w.uuids)), dtype="S64")
    if plan.P:
        f["ib/port"][row] = np.array([p.encode()[:64] for p in w.ports]
                                     + [b""] * (plan.P - len(w.ports)), dtype="S64")


def _atomic_h5(path: Path, fill: Callable[[Any], None], *, clean_stale: bool = False) -> None:
    """Write an HDF5 file through a temporary file in the same directory, fsync, rename."""
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    if clean_stale:  # ingest holds the writer lock: any other temporary is a killed writer's
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        with h5py.File(tmp, "w", libver="latest") as f:
            fill(f)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_series(path: Path, series: JobSeries) -> None:
    """Write `series` to `path` in the archive layout (atomically)."""
    import numpy as np

    N = len(series.nodes)
    G = next((a.shape[1] for a in series.gpu.values()), 0)
    P = next((a.shape[1] for a in series.ib.values()), 0)
    T = len(series.time)
    interval = float(series.interval_s)
    plan = _Plan(int(series.job_id), interval, series.t0 if T else 0.0, T,
                 list(series.nodes), G, P, _ordered(series.gpu, ()),
                 _ordered(series.ib, ()), _ordered(series.node, ()), dict(series.units))

    def fill(f: Any) -> None:
        _create(f, plan)
        f["time"][...] = np.asarray(series.time, dtype=np.float64)
        for i in range(N):
            for m, a in series.gpu.items():
                f[f"gpu/{m}"][i] = a[i]
            for m, a in series.ib.items():
                f[f"ib/{m}"][i] = a[i]
            for m, a in series.node.items():
                f[f"node/{m}"][i] = a[i]
        if series.gpu_uuid is not None and G:
            f["gpu/uuid"][...] = np.asarray(series.gpu_uuid, dtype="S64")
        if series.ib_port is not None and P:
            f["ib/port"][...] = np.asarray(series.ib_port, dtype="S64")

    _atomic_h5(Path(path), fill)


def read_series_file(path: Path) -> JobSeries:
    """Read a series file written by ingest or `write_series`.

    Raises:
        ArchiveError: not a bluevela job series file.
    """
    import h5py

    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise ArchiveError(f"{path} is not a {FORMAT} file")
            units: dict[str, str] = {}

            def group(name: str, skip: str) -> dict[str, np.ndarray]:
                out = {}
                if name in f:
                    for k, ds in f[name].items():
                        if k != skip:
                            out[k] = ds[()]
                            units[k] = str(ds.attrs.get("unit", ""))
                return out

            return JobSeries(
                job_id=int(f.attrs["job_id"]), interval_s=float(f.attrs["interval_s"]),
                time=f["time"][()],
                nodes=[n.decode() if isinstance(n, bytes) else str(n) for n in f["nodes"][()]],
                gpu=group("gpu", "uuid"), ib=group("ib", "port"), node=group("node", ""),
                gpu_uuid=f["gpu/uuid"][()] if "gpu/uuid" in f else None,
                ib_port=f["ib/port"][()] if "ib/port" in f else None,
                units=units)
    except OSError as exc:
        raise ArchiveError(f"cannot read {path}: {exc}") from exc


def read_series(archive_dir: Path, job_id: int) -> JobSeries | None:
    """The job's series from the archive, or None when it has none."""
    path = series_path(archive_dir, job_id)
    if not path.is_file():
        return None
    return read_series_file(path)


# -- ingest -----------------------------------------------------------------------------------


@dataclass
class _Meta:
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
        from bluevela.archive.ingest import row_restarts

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


def _check_columns(probe: Probe, max_gpus: int, max_ports: int) -> tuple[int, int]:
    """Column names from the closed pattern, GPU indices below `max_gpus`, ports bounded;
    returns the rows the node takes in the gpu and ib arrays (1 + highest GPU index, ports).

    Raises:
        SideFileError: the first column that does not fit, named.
    """
    seen: set[tuple[str, str]] = set()
    metrics: dict[str, set[str]] = {"gpu": set(), "ib": set(), "node": set()}
    ports: set[str] = set()
    n_gpu = 0
    for c in probe.header.columns:
        comp, name = c.component, c.name
        if len(name) > 128 or not name.startswith(comp + "."):
            raise SideFileError(f"column {name[:80]!r} is not <component>.<metric>")
        metric = name[len(comp) + 1:]
        m = _GPU_COMPONENT.match(comp)
        if m:
            group = "gpu"
            if int(m.group(1)) >= max_gpus:
                raise SideFileError(f"column {name!r}: GPU index {int(m.group(1))} outside "
                                    f"the node's class ({max_gpus} GPU(s))")
            n_gpu = max(n_gpu, int(m.group(1)) + 1)
        elif comp.startswith("ib.") and _IB_PORT.match(comp[3:]):
            group = "ib"
            ports.add(comp[3:])
            if len(ports) > max_ports:
                raise SideFileError(f"more than {max_ports} IB ports")
        elif comp == "node":
            group = "node"
        else:
            raise SideFileError(f"column {name[:80]!r}: unknown component {comp[:40]!r}")
        if not _METRIC.match(metric) or metric == _RESERVED[group]:
            raise SideFileError(f"column {name[:80]!r}: metric {metric[:40]!r} is not a "
                                f"metric name ([a-z][a-z0-9_]*)")
        if not _UNIT.match(c.unit):
            raise SideFileError(f"column {name!r}: unit {c.unit[:20]!r} is not a unit")
        if (comp, metric) in seen:
            raise SideFileError(f"duplicate column {name!r}")
        seen.add((comp, metric))
        metrics[group].add(metric)
        if len(metrics[group]) > MAX_METRICS:
            raise SideFileError(f"more than {MAX_METRICS} {group} metrics")
    return n_gpu, len(ports)


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
    t0, t1 = probe.t_first, probe.t_last
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise SideFileError("record times are not finite and in order")
    young = age_s < limits.wait_s
    if restart > job.restarts:
        if young:
            raise SideFileWait(f"attempt {restart} is not archived yet")
        raise SideFileError(f"attempt {restart} was never archived (job has "
                            f"{job.restarts})")
    if not (math.isfinite(job.start) and math.isfinite(job.end)):
        raise SideFileError("the job's archived window is unknown")
    slack = max(limits.slack_s, 2 * h.interval_s)
    lo, hi = job.start - slack, job.end + slack
    if t0 < lo:
        raise SideFileError(f"records start {job.start - t0:.0f} s before the job "
                            f"(slack {slack:g} s)")
    if t1 > hi:
        if young and t1 <= now + slack:  # its node's late epilog report may follow it
            raise SideFileWait("records end after the job's archived window")
        raise SideFileError(f"records end {t1 - job.end:.0f} s after the job "
                            f"(slack {slack:g} s)")
    span = t1 - t0
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


def row_bytes(samples: float, components: int, records: int, columns: int) -> float:
    """About the most memory one node's row takes while written: its window's records, its
    [components, records] arrays, and the [components, samples] row of one metric at a time
    (twice: the array and h5py's copy)."""
    return 4.0 * (2 * samples * max(components, 1) + 2 * records * (columns + 2))


def _meta_of(probe: Probe, load: Callable[[], NodeWindow]) -> _Meta:
    """A node's bounds and columns from its side file's header (no record loaded).

    Raises:
        ValueError: record times not finite or not in order.
    """
    t0, t1 = probe.t_first, probe.t_last
    if not (math.isfinite(t0) and math.isfinite(t1)) or t1 < t0:
        raise ValueError("record times are not finite and in order")
    gpus: set[int] = set()
    gpu: set[str] = set()
    ib: set[str] = set()
    node: set[str] = set()
    ports: set[str] = set()
    units: dict[str, str] = {}
    for c in probe.header.columns:
        units.setdefault(c.metric, c.unit)
        m = _GPU_COMPONENT.match(c.component)
        if m:
            gpus.add(int(m.group(1)))
            gpu.add(c.metric)
        elif c.component.startswith("ib."):
            ports.add(c.component[3:])
            ib.add(c.metric)
        elif c.component == "node":
            node.add(c.metric)
    return _Meta(probe.header.node, load, t0, t1, probe.header.interval_s,
                 1 + max(gpus, default=-1), len(ports), gpu, ib, node, units)


def _old_row(path: Path, i: int) -> NodeWindow:
    """Row `i` of an existing series file as a node window."""
    import h5py

    with h5py.File(path, "r") as f:
        times = f["time"][()]
        interval = float(f.attrs["interval_s"])
        node = f["nodes"][i]
        node = node.decode() if isinstance(node, bytes) else str(node)
        gpu_names = [k for k in f["gpu"] if k != "uuid"] if "gpu" in f else []
        ib_names = [k for k in f["ib"] if k != "port"] if "ib" in f else []
        node_names = list(f["node"]) if "node" in f else []
        units = {k: str(f[f"{g}/{k}"].attrs.get("unit", "")) for g, names in
                 (("gpu", gpu_names), ("ib", ib_names), ("node", node_names)) for k in names}
        uuids = [u.decode() for u in f["gpu/uuid"][i]] if "gpu/uuid" in f else []
        ports = [p.decode() for p in f["ib/port"][i]] if "ib/port" in f else []
        ports = [p for p in ports if p]
        return NodeWindow(node, interval, times,
                          {m: f[f"gpu/{m}"][i] for m in gpu_names},
                          {m: f[f"ib/{m}"][i][:len(ports)] for m in ib_names},
                          {m: f[f"node/{m}"][i] for m in node_names},
                          uuids, ports, units)


# What h5py raises on a file that is not what it should be (a damaged superblock or chunk, a
# dataset where a group should be, ...): the file cannot be read, whatever the cause.
_UNREADABLE = (OSError, KeyError, ValueError, TypeError, AttributeError, RuntimeError)


def _old_metas(path: Path) -> list[_Meta]:
    """The nodes of an existing series file, each loaded only when written again (with the
    attempts its row holds).

    Raises:
        ArchiveError: the file is there but cannot be read now (a lock held by a reader, an
            I/O error, damage, not a regular file). It is left as it is: its rows are the
            only copy of the nodes whose side files are done.
    """
    import stat

    import h5py

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        raise ArchiveError(f"series file {path} is not a regular file: left as it is")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise ValueError("not a job series file")
            times = f["time"][()]
            interval = float(f.attrs["interval_s"])
            nodes = [n.decode() if isinstance(n, bytes) else str(n) for n in f["nodes"][()]]
            G = f["gpu/uuid"].shape[1] if "gpu/uuid" in f else 0
            P = f["ib/port"].shape[1] if "ib/port" in f else 0
            gpu = {k for k in f["gpu"] if k != "uuid"} if "gpu" in f else set()
            ib = {k for k in f["ib"] if k != "port"} if "ib" in f else set()
            nm = set(f["node"]) if "node" in f else set()
            units = {k: str(ds.attrs.get("unit", "")) for g in ("gpu", "ib", "node") if g in f
                     for k, ds in f[g].items() if k not in ("uuid", "port")}
            attempts = _attempts_attr(f)
    except _UNREADABLE as exc:
        raise _unreadable(path, exc) from exc
    if not len(times):
        return []
    out = []
    for i, node in enumerate(nodes):
        def load(i: int = i) -> NodeWindow:
            try:
                return _old_row(path, i)
            except _UNREADABLE as exc:
                raise _unreadable(path, exc) from exc

        out.append(_Meta(node, load, float(times[0]), float(times[-1]), interval, G, P,
                         gpu, ib, nm, units, tuple(attempts.get(node, (0,)))))
    return out


def _unreadable(path: Path, exc: BaseException) -> ArchiveError:
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return ArchiveError(f"series file {path} cannot be read ({type(exc).__name__}: {why}): "
                        "left as it is")


def _attempts_attr(f: Any) -> dict[str, list[int]]:
    """The file's `attempts` attribute ({node: [restart, ...]}); {} when absent or bad."""
    raw = f.attrs.get("attempts")
    if raw is None:
        return {}
    try:
        d = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        return {str(k): [int(x) for x in v] for k, v in d.items()}
    except (ValueError, TypeError, AttributeError):
        logger.warning("series file %s: unreadable attempts attribute; taken as attempt 0",
                       f.filename)
        return {}


def build_series(path: Path, job_id: int, metas: list[_Meta]) -> int:
    """Write the series file of `job_id` from node windows (loaded one node at a time; a
    node's windows of several attempts share its row); returns N."""
    metas = sorted(metas, key=lambda m: (m.node, min(m.restarts)))
    by_node: dict[str, list[_Meta]] = {}
    for m in metas:
        by_node.setdefault(m.node, []).append(m)
    interval = min(m.interval_s for m in metas)
    t0, T = _grid(min(m.t_min for m in metas), max(m.t_max for m in metas), interval)
    units: dict[str, str] = {}
    for m in metas:
        for k, v in m.units.items():
            units.setdefault(k, v)
    plan = _Plan(job_id, interval, t0, T, list(by_node),
                 max(m.n_gpu for m in metas), max(m.n_port for m in metas),
                 _ordered(set().union(*(m.gpu for m in metas)), GPU_METRICS),
                 _ordered(set().union(*(m.ib for m in metas)), IB_METRICS),
                 _ordered(set().union(*(m.node_metrics for m in metas)), NODE_METRICS), units)

    attempts = {node: sorted({k for m in ms for k in m.restarts})
                for node, ms in by_node.items()}

    def fill(f: Any) -> None:
        _create(f, plan)
        if any(a != [0] for a in attempts.values()):
            f.attrs["attempts"] = json.dumps(attempts, sort_keys=True)
        for row, ms in enumerate(by_node.values()):
            _put(f, plan, row, [m.load() for m in ms] if len(ms) > 1 else ms[0].load())

    _atomic_h5(path, fill, clean_stale=True)
    return len(by_node)


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

    from bluevela.archive.ingest import archived_jobs
    from bluevela.archive.spool import quarantine

    if not entries:
        return [], []
    limits = SeriesLimits() if limits is None else limits
    now = time.time() if now is None else now
    archived = archived_jobs(w, sorted({e.job_id for e in entries}))
    done: list[str] = []
    bad: list[tuple[str, str]] = []
    by_job: dict[int, list[SpoolEntry]] = {}
    for e in entries:
        if e.job_id in archived:
            by_job.setdefault(e.job_id, []).append(e)
    for job_id, job_entries in sorted(by_job.items()):
        job = JobWindow.of_row(archived[job_id].row)
        try:
            names, quarantined = _ingest_job(sd, archive_dir, job_id, job_entries, job,
                                             limits, now)
        except _BuildFailed as failed:
            reason = f"series side file: job {job_id} not built from it: {failed.reason}"
            logger.error("job %d: series file not written: %s", job_id, failed.reason)
            for name in failed.names:
                quarantine(sd, name, reason)
                bad.append((name, reason))
            continue
        except (OSError, ArchiveError) as exc:
            # The reports are durable already; the side files stay for the next ingest.
            logger.error("job %d: series file not written: %s; its side files stay in the "
                         "spool for the next ingest", job_id, exc)
            continue
        except Exception:  # noqa: BLE001 - a bug: logged whole, no user data quarantined
            logger.exception("job %d: series file not written (a bug, not the data: its side "
                             "files stay in the spool for the next ingest)", job_id)
            continue
        done += names
        bad += quarantined
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


def _ingest_job(sd: SpoolDir, archive_dir: Path, job_id: int, job_entries: list[SpoolEntry],
                job: JobWindow, limits: SeriesLimits, now: float
                ) -> tuple[list[str], list[tuple[str, str]]]:
    """Raises:
        _BuildFailed: the build failed on the new side files' data (they are named).
        OSError, ArchiveError: the series file could not be written (nothing is quarantined).
    """
    from bluevela.archive.spool import quarantine
    from bluevela.telemetry.format import FormatError, probe_file, read_file

    done: list[str] = []
    bad: list[tuple[str, str]] = []
    path = series_path(archive_dir, job_id)
    # Never rebuild over rows that cannot be read: the side files of the nodes in the file are
    # done (and pruned from done/ after a week); its rows are their only copy.
    metas = _old_metas(path)
    have = {(m.node, k) for m in metas for k in m.restarts}
    new_names: list[str] = []
    for e in sorted(job_entries, key=lambda x: (x.node, x.restart)):
        if (e.node, e.restart) in have:
            done.append(e.name)
            continue

        def load(e: SpoolEntry = e) -> NodeWindow:
            try:
                return window_from_segment(read_file(e.name, strict=True, dir_fd=sd.fd))
            except ValueError as exc:  # FormatError, SideFileError: this file's records
                raise _BadSideFile(e.name, str(exc)) from exc

        try:
            probe = probe_file(e.name, dir_fd=sd.fd)
            node, restart = e.node, e.restart
            if restart and probe.header.node == f"{node}.r{restart}":
                node, restart = probe.header.node, 0  # a node named `<x>.r<k>`, first run
                if (node, 0) in have:
                    done.append(e.name)
                    continue
            if probe.header.node != node:
                raise FormatError(f"header node {probe.header.node!r} does not match the name")
            if probe.header.job_id is not None and probe.header.job_id != job_id:
                raise FormatError(f"header job_id {probe.header.job_id} does not match")
            age = now - os.stat(e.name, dir_fd=sd.fd, follow_symlinks=False).st_mtime
            check_side_file(probe, job, restart, limits, now=now, age_s=age)
            meta = _meta_of(probe, load)
            meta.restarts = (restart,)
            meta.source = e.name
        except FileNotFoundError:
            continue
        except SideFileWait as why:
            logger.info("job %d: side file %s waits: %s", job_id, e.name, why)
            continue
        except (OSError, FormatError, ValueError) as exc:
            reason = f"series side file: {getattr(exc, 'strerror', None) or exc}"
            if isinstance(exc, OSError) and exc.errno == 40:  # ELOOP: a symlink
                reason = "series side file: a symlink (never followed)"
            quarantine(sd, e.name, reason)
            bad.append((e.name, reason))
            continue
        have.add((node, restart))
        done.append(e.name)
        metas.append(meta)
        new_names.append(e.name)
    while new_names:
        # Only errors that say "this data is bad" quarantine: a bug (TypeError, KeyError...)
        # goes up and the side files stay for the next ingest.
        try:
            _check_plan(metas, limits)
            n = build_series(path, job_id, metas)
        except _BadSideFile as exc:  # one file's records: it alone, the others are built
            reason = f"series side file: {exc.reason}"
            quarantine(sd, exc.name, reason)
            bad.append((exc.name, reason))
            done.remove(exc.name)
            new_names.remove(exc.name)
            metas = [m for m in metas if m.source != exc.name]
            continue
        except MemoryError:
            raise _BuildFailed(new_names, "out of memory") from None
        except ValueError as exc:  # SideFileError, a value h5py cannot store (a UUID...)
            raise _BuildFailed(new_names, str(exc)) from exc
        logger.info("job %d: series of %d node(s) in %s (%d new)", job_id, n, path,
                    len(new_names))
        break
    return done, bad


def _check_plan(metas: list[_Meta], limits: SeriesLimits) -> None:
    """The job's grid (all nodes, the shortest interval) times its widest node, before the
    file is made: each side file fitted on its own, their union must too.

    Raises:
        SideFileError: one node's row would take more than `limits.max_node_bytes`.
    """
    interval = min(m.interval_s for m in metas)
    samples = (max(m.t_max for m in metas) - min(m.t_min for m in metas)) / interval + 1
    comps = max(max(m.n_gpu, m.n_port) for m in metas)
    need = row_bytes(samples, comps, 0, 0)
    if samples > MAX_SAMPLES or need > limits.max_node_bytes:
        raise SideFileError(f"the job's grid of {samples:.0f} samples x {comps} rows would "
                            f"take {need / 2**30:.1f} GiB per node")
