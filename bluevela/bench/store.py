"""The nightly-run record: one HDF5 file per night under `<archive>/nightly/`.

Layout (schema 1; docs/nightly.md has the full table):

    <archive>/nightly/<YYYY-MM-DD>.h5
      attrs: schema, night, cluster, started_utc, finished_utc, bluevela_version,
             link_faults (JSON), unresolved (JSON)
      /figures   compound, one row per figure (headline and sweep points) of every subject
      /results   compound, one row per (subject, measurement): status and message
      /nodes     compound, one row per node: class, status, drained, drain reason
      /pairs     compound, one row per measured pair: round, slow, headline figures

A subject is a node (`peer` empty) or a pair (`node` < `peer`). Every dataset is written in one
batch from a numpy structured array. The file is written under a temporary name, fsynced, renamed
into place and the directory fsynced: a crash leaves either the old file or the new one, never a
torn one. A rerun on the same night replaces the night's file.

h5py and numpy are imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bluevela import __version__
from bluevela.errors import ArchiveError
from bluevela.util.fs import ensure_dir, fsync_dir

logger = logging.getLogger(__name__)

SCHEMA = 1
_NIGHT = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class FigureRow:
    scope: str  # "node" | "pair"
    node: str
    peer: str  # "" for a node
    measurement: str
    name: str
    value: float
    unit: str
    device: int
    size: int
    headline: bool
    status: int = 0  # the figure's verdict (headline figures), else 0
    limit: float = 0.0
    baseline: float = math.nan
    job_id: int = 0
    round: int = 0


@dataclass(frozen=True)
class ResultRow:
    scope: str
    node: str
    peer: str
    measurement: str
    status: int
    applicable: bool
    ran: bool
    message: str
    note: str
    job_id: int = 0
    round: int = 0


@dataclass(frozen=True)
class NodeRow:
    node: str
    node_class: str
    status: int
    drained: bool
    culprit: bool
    reason: str  # why it failed (and the drain reason, or why it was not drained)


@dataclass(frozen=True)
class PairRow:
    node: str
    peer: str
    round: int
    status: int
    slow: bool
    pair_busbw_gbs: float
    mpi_bw_gbs: float
    job_id: int = 0


@dataclass
class NightRecord:
    """Everything one night measured and decided."""

    night: str
    cluster: str
    started_utc: str
    finished_utc: str
    figures: list[FigureRow] = field(default_factory=list)
    results: list[ResultRow] = field(default_factory=list)
    nodes: list[NodeRow] = field(default_factory=list)
    pairs: list[PairRow] = field(default_factory=list)
    link_faults: list[tuple[str, str]] = field(default_factory=list)
    unresolved: list[tuple[str, str]] = field(default_factory=list)
    version: str = __version__


def check_night(night: str) -> str:
    """`night` if it is a YYYY-MM-DD date, else ArchiveError (it becomes a file name)."""
    if not _NIGHT.match(night):
        raise ArchiveError(f"night {night!r} is not YYYY-MM-DD")
    return night


def nightly_dir(archive: Path) -> Path:
    return archive / "nightly"


def night_path(root: Path, night: str) -> Path:
    """The file of `night` in the nightly directory `root`."""
    return root / f"{check_night(night)}.h5"


def list_nights(root: Path) -> list[str]:
    """Nights with a record in `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.stem for p in root.glob("*.h5") if _NIGHT.match(p.stem))


# -- writing --------------------------------------------------------------------------------

_TEXT_FIELDS = {"scope": 8, "node": 64, "peer": 64, "measurement": 16, "name": 32, "unit": 16,
                "node_class": 32}


def _dtype(row_type: type, np: Any, h5py: Any) -> Any:
    fields = []
    for name, ftype in row_type.__annotations__.items():
        if name in _TEXT_FIELDS:
            fields.append((name, f"S{_TEXT_FIELDS[name]}"))
        elif ftype == "str":
            fields.append((name, h5py.string_dtype("utf-8")))
        elif ftype == "float":
            fields.append((name, "<f8"))
        elif ftype == "bool":
            fields.append((name, "u1"))
        else:
            fields.append((name, "<i8"))
    return np.dtype(fields)


def _array(rows: Sequence[Any], row_type: type, np: Any, h5py: Any) -> Any:
    dt = _dtype(row_type, np, h5py)
    arr = np.zeros(len(rows), dtype=dt)
    for name in dt.names:
        values = [getattr(r, name) for r in rows]
        if name in _TEXT_FIELDS:
            for v in values:
                if len(v.encode()) > _TEXT_FIELDS[name]:
                    raise ArchiveError(f"{name} {v!r} is longer than {_TEXT_FIELDS[name]} bytes")
            arr[name] = [v.encode() for v in values]
        elif dt.fields[name][0].kind == "O":  # HDF5 variable-length text refuses NUL
            arr[name] = [str(v).replace("\x00", "") for v in values]
        else:
            arr[name] = values
    return arr


def write_night(root: Path, record: NightRecord) -> Path:
    """Write `record` as `<root>/<night>.h5`: temporary name, fsync, rename, fsync the dir.

    Raises:
        ArchiveError: when the directory or the file cannot be written (the old file, if any,
            is left untouched).
    """
    import h5py
    import numpy as np

    target = night_path(root, record.night)
    try:
        ensure_dir(root)
    except OSError as exc:
        raise ArchiveError(f"{root}: cannot create the nightly directory: {exc}") from exc
    tables = {name: _array(rows, row_type, np, h5py)
              for name, rows, row_type in (("figures", record.figures, FigureRow),
                                           ("results", record.results, ResultRow),
                                           ("nodes", record.nodes, NodeRow),
                                           ("pairs", record.pairs, PairRow))}
    tmp = root / f".{target.name}.{os.getpid()}.tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["schema"] = SCHEMA
            f.attrs["night"] = record.night
            f.attrs["cluster"] = record.cluster
            f.attrs["started_utc"] = record.started_utc
            f.attrs["finished_utc"] = record.finished_utc
            f.attrs["bluevela_version"] = record.version
            f.attrs["link_faults"] = json.dumps([list(p) for p in record.link_faults])
            f.attrs["unresolved"] = json.dumps([list(p) for p in record.unresolved])
            for name, table in tables.items():
                f.create_dataset(name, data=table)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        fsync_dir(root)
    except (OSError, ValueError, TypeError) as exc:
        tmp.unlink(missing_ok=True)
        raise ArchiveError(f"{target}: cannot write the nightly record: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    logger.info("wrote %s (%d figures)", target, len(record.figures))
    return target


# -- reading --------------------------------------------------------------------------------

def _rows(ds: Any, row_type: type) -> list[Any]:
    """The dataset's rows as `row_type`s, converted a column at a time (`tolist()` gives Python
    values: the per-row numpy scalar access was 4 s of the 1,000-node report's 8)."""
    arr = ds[()]
    names = arr.dtype.names or ()
    cols: dict[str, list[Any]] = {}
    for name, ftype in row_type.__annotations__.items():
        if name not in names:
            continue
        conv: Any = {"bool": bool, "float": float, "int": int}.get(ftype)
        cols[name] = [v.decode("utf-8", errors="replace") if isinstance(v, bytes)
                      else conv(v) if conv else v for v in arr[name].tolist()]
    return [row_type(**{k: c[i] for k, c in cols.items()}) for i in range(len(arr))]


def read_night(path: Path) -> NightRecord:
    """Read one night's record.

    Raises:
        ArchiveError: when the file is missing, not HDF5, or of another schema.
    """
    import h5py

    try:
        with h5py.File(path, "r") as f:
            schema = int(f.attrs.get("schema", 0))
            if schema != SCHEMA:
                raise ArchiveError(f"{path}: schema {schema}, this bluevela reads {SCHEMA}")

            def attr(name: str) -> str:
                v = f.attrs.get(name, "")
                return v.decode() if isinstance(v, bytes) else str(v)

            return NightRecord(
                night=attr("night"), cluster=attr("cluster"),
                started_utc=attr("started_utc"), finished_utc=attr("finished_utc"),
                version=attr("bluevela_version"),
                figures=_rows(f["figures"], FigureRow),
                results=_rows(f["results"], ResultRow),
                nodes=_rows(f["nodes"], NodeRow),
                pairs=_rows(f["pairs"], PairRow),
                link_faults=[(a, b) for a, b in json.loads(attr("link_faults") or "[]")],
                unresolved=[(a, b) for a, b in json.loads(attr("unresolved") or "[]")],
            )
    except (OSError, KeyError) as exc:
        raise ArchiveError(f"{path}: cannot read the nightly record: {exc}") from exc


def read_nights(root: Path, nights: Iterable[str]) -> list[NightRecord]:
    """Records of `nights` (unreadable ones are skipped with a warning)."""
    out = []
    for night in nights:
        try:
            out.append(read_night(night_path(root, night)))
        except ArchiveError as exc:
            logger.warning("skipping %s", exc)
    return out


#: (node, measurement) -> figure name -> [(night, value)] of past headline figures.
NodeHistory = dict[tuple[str, str], dict[str, list[tuple[str, float]]]]


def history(root: Path, before: str, nights: int) -> NodeHistory:
    """Headline figures of the last `nights` nights strictly before `before`, per node.

    A pair's figures count for both of its nodes.
    """
    past = [n for n in list_nights(root) if n < before][-nights:]
    out: NodeHistory = {}
    for rec in read_nights(root, past):
        for row in rec.figures:
            if not row.headline:
                continue
            for subject in (row.node, row.peer) if row.peer else (row.node,):
                out.setdefault((subject, row.measurement), {}).setdefault(row.name, []).append(
                    (rec.night, row.value))
    return out


def series(hist: NodeHistory, subjects: Sequence[str], measurement: str) -> dict[str, list[float]]:
    """One value per past night for each figure of `measurement` over `subjects`, oldest
    first: a node's own values, or for a pair the median of both nodes' pair figures that
    night (the pair is judged against its two nodes' recent pair figures)."""
    import statistics

    merged: dict[str, dict[str, list[float]]] = {}
    for subject in subjects:
        for name, points in hist.get((subject, measurement), {}).items():
            for night, value in points:
                merged.setdefault(name, {}).setdefault(night, []).append(value)
    return {name: [statistics.median(by_night[n]) for n in sorted(by_night)]
            for name, by_night in merged.items()}
