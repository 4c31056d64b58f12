"""The job series file: `<archive>/series/<job_id>.h5`, one file per job (docs/archive.md).

The one module that knows the HDF5 layout: every reader (`open_series`, `read_series`) and
writer (`write_series`, `write_rows`) of a series file goes through it. Layout (schema 1)::

    attrs: format="bluevela-job-series", schema_version=1, job_id, interval_s, t0_unix_s,
           n_samples, [attempts]
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
nearest grid point within interval/2). Chunked per node, shuffle + gzip. A requeued job's
attempts share the one time grid, a node's row holding each attempt's samples (NaN in the gap
between attempts); the root attribute `attempts` (JSON, {node: [restart, ...]}) says which
attempts each row holds, and a file without it holds attempt 0 of each node.

A side file's column `gpu<i>.<metric>`, `ib.<hca>/<port>.<metric>` or `node.<metric>` (the
sampler's names) goes to group gpu, ib or node: `group_columns` is the one place that sorts
columns into the groups (the side-file checks, the ingest's plan and `window_from_segment`
all use it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    import numpy as np

    from bluevela.telemetry.format import Column, Segment

logger = logging.getLogger(__name__)

FORMAT = "bluevela-job-series"
SCHEMA_VERSION = 1
SERIES_DIR = "series"
GROUPS = ("gpu", "ib", "node")
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
# The datasets each group keeps beside its metrics (no metric may take these names).
RESERVED = {"gpu": "uuid", "ib": "port", "node": ""}
MAX_SAMPLES = 50_000_000  # a window longer than this is refused (a clock gone wild)
GPU_COMPONENT = re.compile(r"^gpu([0-9]{1,4})$")
IB_PORT = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,31}/[0-9]{1,3}$")
_CHUNK_T = 4096
# What h5py raises on a file that is not what it should be (a damaged superblock or chunk, a
# dataset where a group should be, ...): the file cannot be read, whatever the cause.
UNREADABLE = (OSError, KeyError, ValueError, TypeError, AttributeError, RuntimeError)


def series_path(archive_dir: Path, job_id: int) -> Path:
    return Path(archive_dir) / SERIES_DIR / f"{int(job_id)}.h5"


# -- columns into groups ----------------------------------------------------------------------


def column_place(component: str) -> tuple[str, int | str | None] | None:
    """Where a column of `component` goes: ("gpu", GPU index), ("ib", "hca/port"),
    ("node", None); None for a component no group takes."""
    m = GPU_COMPONENT.match(component)
    if m:
        return "gpu", int(m.group(1))
    if component.startswith("ib.") and IB_PORT.match(component[3:]):
        return "ib", component[3:]
    if component == "node":
        return "node", None
    return None


@dataclass
class ColumnGroups:
    """A side file's columns by group: metric -> column index, per GPU index, per IB port, or
    one for the node; `units`: metric -> the unit of its first column."""

    gpu: dict[str, dict[int, int]] = field(default_factory=dict)
    ib: dict[str, dict[str, int]] = field(default_factory=dict)
    node: dict[str, int] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)

    @property
    def n_gpu(self) -> int:
        """Rows the node takes in the gpu arrays: 1 + its highest GPU index."""
        return 1 + max((i for cols in self.gpu.values() for i in cols), default=-1)

    @property
    def ports(self) -> list[str]:
        return sorted({p for cols in self.ib.values() for p in cols})


def group_columns(columns: Iterable[Column]) -> ColumnGroups:
    """Sort columns into the gpu/ib/node groups (a column of no group is left out)."""
    out = ColumnGroups()
    for j, c in enumerate(columns):
        out.units.setdefault(c.metric, c.unit)
        place = column_place(c.component)
        if place is None:
            continue
        group, key = place
        if group == "gpu":
            out.gpu.setdefault(c.metric, {})[int(key)] = j  # type: ignore[arg-type]
        elif group == "ib":
            out.ib.setdefault(c.metric, {})[str(key)] = j
        else:
            out.node[c.metric] = j
    return out


# -- in memory --------------------------------------------------------------------------------


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

    def group(self, name: str) -> dict[str, np.ndarray]:
        return self.node_metrics if name == "node" else getattr(self, name)


def window_from_segment(seg: Segment) -> NodeWindow:
    """A BVTS file's records as one node's window, its columns in the gpu/ib/node groups."""
    import numpy as np

    h = seg.header
    n = len(h.columns)
    rec = np.frombuffer(seg.data, dtype=np.dtype([("t", "<f8"), ("v", "<f4", (n,))]))
    times = rec["t"].astype(np.float64)
    vals = rec["v"].reshape(len(rec), n)
    cols = group_columns(h.columns)
    n_gpu, ports, T = cols.n_gpu, cols.ports, len(times)
    gpu = {}
    for metric, by_gpu in cols.gpu.items():
        arr = np.full((n_gpu, T), np.nan, dtype=np.float32)
        for i, j in by_gpu.items():
            arr[i] = vals[:, j]
        gpu[metric] = arr
    ib = {}
    for metric, by_port in cols.ib.items():
        arr = np.full((len(ports), T), np.nan, dtype=np.float32)
        for pi, p in enumerate(ports):
            if p in by_port:
                arr[pi] = vals[:, by_port[p]]
        ib[metric] = arr
    node_m = {metric: vals[:, j].astype(np.float32) for metric, j in cols.node.items()}
    uuids = [h.components.get(f"gpu{i}", {}).get("uuid", "") for i in range(n_gpu)]
    return NodeWindow(h.node, h.interval_s, times, gpu, ib, node_m, uuids, ports, cols.units)


# -- writing ----------------------------------------------------------------------------------


@dataclass
class SeriesPlan:
    """The shape of a file about to be written: its grid, rows and metrics."""

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

    def metrics(self, group: str) -> list[str]:
        return {"gpu": self.gpu_metrics, "ib": self.ib_metrics, "node": self.node_metrics}[group]


def grid(t_min: float, t_max: float, interval: float) -> tuple[float, int]:
    """The time grid (t0, T) that holds samples from `t_min` to `t_max`.

    Raises:
        ArchiveError: longer than `MAX_SAMPLES`.
    """
    t0 = math.floor(t_min / interval + 0.5) * interval
    T = int(round((t_max - t0) / interval)) + 1
    if T > MAX_SAMPLES:
        raise ArchiveError(f"series window of {T} samples is too long")
    return t0, max(T, 1)


def ordered_metrics(found: Iterable[str], standard: tuple[str, ...] = ()) -> list[str]:
    """The standard metrics of a group, then any others found, sorted."""
    extra = sorted(set(found) - set(standard))
    return list(standard) + extra


def _grid_index(times: np.ndarray, t0: float, interval: float, T: int) -> tuple[Any, Any]:
    """Grid positions of `times` and which of them are kept (nearest point within interval/2)."""
    import numpy as np

    k = np.rint((times - t0) / interval).astype(np.int64)
    ok = (k >= 0) & (k < T) & (np.abs(times - (t0 + k * interval)) <= interval / 2 + 1e-9) \
        & np.isfinite(times)
    return k, ok


def _create(f: Any, plan: SeriesPlan) -> None:
    import h5py
    import numpy as np

    f.attrs["format"] = FORMAT
    f.attrs["schema_version"] = SCHEMA_VERSION
    f.attrs["job_id"] = plan.job_id
    f.attrs["interval_s"] = plan.interval_s
    f.attrs["t0_unix_s"] = plan.t0
    f.attrs["n_samples"] = plan.T
    f.create_dataset("time", data=plan.t0 + np.arange(plan.T, dtype=np.float64) * plan.interval_s)
    f.create_dataset("nodes", data=plan.nodes, dtype=h5py.string_dtype())
    N, T = len(plan.nodes), plan.T
    tc = min(T, _CHUNK_T)
    rows = {"gpu": (plan.G,), "ib": (plan.P,), "node": ()}
    for group in GROUPS:
        for m in plan.metrics(group):
            shape = (N, *rows[group], T)
            opts: dict[str, Any] = {}
            if all(shape):
                opts = {"chunks": (1, *(max(r, 1) for r in rows[group]), tc), "shuffle": True,
                        "compression": "gzip", "compression_opts": 4}
            ds = f.create_dataset(f"{group}/{m}", shape=shape, dtype="<f4",
                                  fillvalue=np.float32(np.nan), **opts)
            ds.attrs["unit"] = plan.units.get(m, UNITS.get(m, ""))
    f.create_dataset("gpu/uuid", shape=(N, plan.G), dtype="S64")
    f.create_dataset("ib/port", shape=(N, plan.P), dtype="S64")


def _labels(names: list[str], width: int) -> Any:
    import numpy as np

    return np.array([s.encode()[:64] for s in names] + [b""] * (width - len(names)), dtype="S64")


def _on_grid(at: list[tuple[NodeWindow, Any, Any]], group: str, m: str, n: int | None,
             T: int) -> np.ndarray | None:
    """One metric of a node's row from its windows and their grid positions, a later window
    over an earlier one (None: no window has it). `n`: the component count (GPUs, ports) of
    a [component, time] metric; None for a [time] one."""
    import numpy as np

    out = None
    for w, k, ok in at:
        src = w.group(group).get(m)
        if src is None or (n is not None and not src.shape[0]):
            continue
        if out is None:
            out = np.full((T,) if n is None else (n, T), np.nan, dtype=np.float32)
        if n is None:
            out[k[ok]] = src[ok]
        else:
            out[:src.shape[0], k[ok]] = src[:, ok]
    return out


def put_row(f: Any, plan: SeriesPlan, row: int, windows: NodeWindow | list[NodeWindow]) -> None:
    """Write one node's window(s) into row `row` (one node in memory at a time). Several
    windows (a requeued job's attempts, in attempt order) go onto the same row, a later one
    over an earlier one where both have a grid point."""
    ws = windows if isinstance(windows, list) else [windows]
    at = [(w, *_grid_index(w.times, plan.t0, plan.interval_s, plan.T)) for w in ws]
    rows = {"gpu": plan.G, "ib": plan.P, "node": None}
    for group in GROUPS:
        for m in plan.metrics(group):
            out = _on_grid(at, group, m, rows[group], plan.T)
            if out is not None:
                f[f"{group}/{m}"][row] = out
    w = next((x for x in reversed(ws) if x.uuids or x.ports), ws[-1])
    if plan.G:
        f["gpu/uuid"][row] = _labels(w.uuids, plan.G)
    if plan.P:
        f["ib/port"][row] = _labels(w.ports, plan.P)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync(tmp, os.O_NOFOLLOW)
        os.replace(tmp, path)
        _fsync(path.parent, os.O_DIRECTORY)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_rows(path: Path, plan: SeriesPlan, rows: Iterable[NodeWindow | list[NodeWindow]],
               attempts: dict[str, list[int]] | None = None) -> None:
    """Write a series file row by row (`rows` in `plan.nodes` order, each loaded when its
    turn comes), atomically; stale temporaries of a killed writer are removed first (the
    caller holds the archive's writer lock).

    Args:
        attempts: {node: [restart, ...]} the rows hold; stored only when some row holds
            more than attempt 0.
    """
    def fill(f: Any) -> None:
        _create(f, plan)
        if attempts and any(a != [0] for a in attempts.values()):
            f.attrs["attempts"] = json.dumps(attempts, sort_keys=True)
        for row, windows in enumerate(rows):
            put_row(f, plan, row, windows)

    _atomic_h5(Path(path), fill, clean_stale=True)


def write_series(path: Path, series: JobSeries) -> None:
    """Write `series` to `path` in the archive layout (atomically)."""
    import numpy as np

    G = next((a.shape[1] for a in series.gpu.values()), 0)
    P = next((a.shape[1] for a in series.ib.values()), 0)
    T = len(series.time)
    plan = SeriesPlan(int(series.job_id), float(series.interval_s), series.t0 if T else 0.0, T,
                      list(series.nodes), G, P, ordered_metrics(series.gpu),
                      ordered_metrics(series.ib), ordered_metrics(series.node),
                      dict(series.units))

    def fill(f: Any) -> None:
        _create(f, plan)
        f["time"][...] = np.asarray(series.time, dtype=np.float64)
        for i in range(len(series.nodes)):
            for group, arrays in (("gpu", series.gpu), ("ib", series.ib), ("node", series.node)):
                for m, a in arrays.items():
                    f[f"{group}/{m}"][i] = a[i]
        if series.gpu_uuid is not None and G:
            f["gpu/uuid"][...] = np.asarray(series.gpu_uuid, dtype="S64")
        if series.ib_port is not None and P:
            f["ib/port"][...] = np.asarray(series.ib_port, dtype="S64")

    _atomic_h5(Path(path), fill)


# -- reading ----------------------------------------------------------------------------------


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass
class SeriesFile:
    """An open series file: its attributes, times and node names read, its arrays left on disk
    (h5py datasets: slice them, e.g. `gpu["util_pct"][n0:n1]`, while the file is open).
    Shapes are checked against the layout when it is opened."""

    path: Path
    job_id: int
    interval_s: float
    time: np.ndarray  # float64 [T]
    nodes: list[str]
    gpu: dict[str, Any]  # metric -> dataset [N, G, T]
    ib: dict[str, Any]  # metric -> dataset [N, P, T]
    node: dict[str, Any]  # metric -> dataset [N, T]
    gpu_uuid: Any | None  # dataset bytes [N, G]
    ib_port: Any | None  # dataset bytes [N, P]
    units: dict[str, str]
    attempts: dict[str, list[int]]  # {node: [restart, ...]}; {}: attempt 0 of each node
    n_gpus: int
    n_ports: int

    def load(self) -> JobSeries:
        """The whole file in memory.

        Raises:
            ArchiveError: a part of it cannot be read (a damaged chunk).
        """
        try:
            return JobSeries(
                self.job_id, self.interval_s, self.time, list(self.nodes),
                {k: ds[()] for k, ds in self.gpu.items()}, {k: ds[()] for k, ds in self.ib.items()},
                {k: ds[()] for k, ds in self.node.items()},
                self.gpu_uuid[()] if self.gpu_uuid is not None else None,
                self.ib_port[()] if self.ib_port is not None else None, dict(self.units))
        except UNREADABLE as exc:
            raise ArchiveError(f"{self.path}: unreadable ({exc})") from exc

    def row(self, i: int) -> NodeWindow:
        """Row `i` (one node, all its attempts) as a node window.

        Raises:
            ArchiveError: the row cannot be read (a damaged chunk).
        """
        try:
            uuids = [_text(u) for u in self.gpu_uuid[i]] if self.gpu_uuid is not None else []
            ports = [_text(p) for p in self.ib_port[i]] if self.ib_port is not None else []
            ports = [p for p in ports if p]
            return NodeWindow(self.nodes[i], self.interval_s, self.time,
                              {m: ds[i] for m, ds in self.gpu.items()},
                              {m: ds[i][:len(ports)] for m, ds in self.ib.items()},
                              {m: ds[i] for m, ds in self.node.items()},
                              uuids, ports, dict(self.units))
        except UNREADABLE as exc:
            raise ArchiveError(f"{self.path}: unreadable ({exc})") from exc


def _members(f: Any, group: str) -> tuple[dict[str, Any], Any | None]:
    """A group's metric datasets and the dataset it keeps beside them (None when absent)."""
    import h5py

    if group not in f:
        return {}, None
    metrics, beside = {}, None
    for k, ds in f[group].items():
        if not isinstance(ds, h5py.Dataset):
            raise ValueError(f"/{group}/{k} is not a dataset")
        if k == RESERVED[group]:
            beside = ds
        else:
            metrics[k] = ds
    return metrics, beside


def _width(metrics: dict[str, Any], beside: Any | None) -> int:
    """G or P: from the labels dataset [N, G], else from the first metric [N, G, T]."""
    if beside is not None and len(beside.shape) == 2:
        return int(beside.shape[1])
    first = next(iter(metrics.values()), None)
    return int(first.shape[1]) if first is not None and len(first.shape) > 1 else 0


def _attempts_attr(f: Any) -> dict[str, list[int]]:
    """The file's `attempts` attribute ({node: [restart, ...]}); {} when absent or bad."""
    raw = f.attrs.get("attempts")
    if raw is None:
        return {}
    try:
        d = json.loads(_text(raw))
        return {str(k): [int(x) for x in v] for k, v in d.items()}
    except (ValueError, TypeError, AttributeError):
        logger.warning("series file %s: unreadable attempts attribute; taken as attempt 0",
                       f.filename)
        return {}


def _check_shapes(sf: SeriesFile) -> None:
    if sf.time.ndim != 1:
        raise ArchiveError(f"{sf.path}: /time has shape {sf.time.shape}, expected (T,)")
    N, T = len(sf.nodes), len(sf.time)
    want = [*((f"gpu/{m}", d, (N, sf.n_gpus, T)) for m, d in sf.gpu.items()),
            *((f"ib/{m}", d, (N, sf.n_ports, T)) for m, d in sf.ib.items()),
            *((f"node/{m}", d, (N, T)) for m, d in sf.node.items()),
            *((name, d, (N, w)) for name, d, w in (("gpu/uuid", sf.gpu_uuid, sf.n_gpus),
                                                   ("ib/port", sf.ib_port, sf.n_ports))
              if d is not None)]
    for name, ds, shape in want:
        if tuple(ds.shape) != shape:
            raise ArchiveError(f"{sf.path}: /{name} has shape {tuple(ds.shape)}, "
                               f"expected {shape}")
    if not (math.isfinite(sf.interval_s) and sf.interval_s > 0):
        raise ArchiveError(f"{sf.path}: interval_s {sf.interval_s} is not a positive number")


def _series_file(f: Any, path: Path) -> SeriesFile:
    import numpy as np

    if _text(f.attrs.get("format", "")) != FORMAT:
        raise ArchiveError(f"{path}: not a bluevela job series file")
    try:
        gpu, uuid = _members(f, "gpu")
        ib, port = _members(f, "ib")
        node, _ = _members(f, "node")
        units = {k: _text(ds.attrs.get("unit", "")) for d in (gpu, ib, node)
                 for k, ds in d.items()}
        sf = SeriesFile(Path(path), int(f.attrs["job_id"]), float(f.attrs["interval_s"]),
                        np.asarray(f["time"][()], dtype=np.float64),
                        [_text(n).rstrip("\x00") for n in f["nodes"][()]], gpu, ib, node,
                        uuid, port, units, _attempts_attr(f), _width(gpu, uuid),
                        _width(ib, port))
    except UNREADABLE as exc:
        raise ArchiveError(f"{path}: not a readable job series ({exc})") from exc
    _check_shapes(sf)
    return sf


@contextmanager
def open_series(path: Path) -> Iterator[SeriesFile]:
    """Open a series file for reading (HDF5's file lock held, as every reader of it does).

    Raises:
        ArchiveError: it cannot be opened, is not a job series, or its shapes do not match
            the layout.
    """
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ArchiveError(f"cannot open {path}: {exc}") from exc
    with f:
        yield _series_file(f, Path(path))


def read_series_file(path: Path) -> JobSeries:
    """Read a whole series file written by ingest or `write_series`.

    Raises:
        ArchiveError: not a readable bluevela job series file.
    """
    with open_series(path) as sf:
        return sf.load()


def read_series(archive_dir: Path, job_id: int) -> JobSeries | None:
    """The job's series from the archive, or None when it has none."""
    path = series_path(archive_dir, job_id)
    if not path.is_file():
        return None
    return read_series_file(path)
