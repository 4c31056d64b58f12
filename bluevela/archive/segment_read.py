"""Reading a segment file: opening it, a table's rows in the schema's canonical dtype, and
checking a whole file against the schema (`schema_problems`, `read_datasets`).

Below `store` (the archive directory and its writer) and `query`, above `schema` (the
dtypes): the schema describes a file, this reads one, so neither imports the other's user.
h5py and numpy are imported inside the functions that need them.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.archive import schema as S
from bluevela.errors import ArchiveError

if TYPE_CHECKING:
    from collections.abc import Mapping

    import h5py
    import numpy as np


def h5py_module() -> Any:
    """Import h5py with HDF5 file locking off (our files are immutable; see module doc)."""
    os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
    import h5py

    return h5py


def open_h5(path: Path) -> h5py.File:
    """Open a segment read-only, mapping any failure to one clear ArchiveError line."""
    h5py = h5py_module()
    try:
        return h5py.File(path, "r", locking=False)
    except FileNotFoundError:
        raise
    except (OSError, RuntimeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArchiveError(f"{path}: not a readable HDF5 archive file ({first})") from exc


@cache
def _mem_type(path: str) -> Any:
    return h5py_module().h5t.py_create(S.dtypes()[path])


@cache
def _has_objects(path: str) -> bool:
    dt = S.dtypes()[path]
    return dt.hasobject


def _read_type(dsid: Any, path: str) -> Any:
    """The memory type to read `path` with. Without variable-length strings, the file's own
    type when its layout is ours: HDF5 then copies bytes instead of converting every
    NUL-terminated string to NUL-padded (5x faster, and NUL-terminated strings written from
    NUL-padded ones are zero-filled anyway)."""
    if not _has_objects(path):
        ftype = dsid.get_type()
        dt = S.dtypes()[path]
        fields: Mapping[str, Any] = dt.fields or {}
        if ftype.get_size() == dt.itemsize and (
                dt.names is None or (ftype.get_nmembers() == len(dt.names) and all(
                    ftype.get_member_name(i).decode() == n
                    and ftype.get_member_offset(i) == fields[n][1]
                    for i, n in enumerate(dt.names)))):
            return ftype
    return _mem_type(path)


def read_rows(f: h5py.File, path: str, start: int = 0, count: int | None = None) -> np.ndarray:
    """Rows [start, start+count) of a table as its canonical numpy dtype.

    The low-level read skips h5py's per-call dtype work (~0.3 ms a call), which is most of
    the cost of `bv archive node` over many files. HDF5 converts by column name, so a file
    whose columns differ fails here with ArchiveError rather than returning garbage.
    """
    import numpy as np

    h5py = h5py_module()
    dsid = f[path].id
    space = dsid.get_space()
    total = space.shape[0]
    count = total - start if count is None else count
    out = np.zeros(count, dtype=S.dtypes()[path])  # zeros: object columns must start valid
    if count <= 0:
        return out
    if start < 0 or start + count > total:
        raise ArchiveError(f"{f.filename}: rows {start}..{start + count} of /{path} are past "
                           f"its end ({total})")
    space.select_hyperslab((start,), (count,))
    try:
        dsid.read(h5py.h5s.create_simple((count,)), space, out, mtype=_read_type(dsid, path))
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        raise ArchiveError(f"{f.filename}: cannot read /{path}: {exc}") from exc
    return out


def schema_problems(f: h5py.File, data: dict[str, Any] | None = None) -> list[str]:
    """Check an open segment file against schema version 1; return the problems found.

    Checks the root attributes, every dataset's presence, dtype and 1-D shape, the row ranges
    the indexes point at, and that no report key (job_id, node, phase, restart) is stored
    twice. A file written before a column of ADDED_COLUMNS existed passes (it reads as 0).

    Args:
        f: the open file.
        data: filled with every dataset's rows (read once here), for a caller that needs them.
    """
    data = {} if data is None else data
    problems = _layout_problems(f, data)
    if problems:
        return problems
    counts = {p: len(a) for p, a in data.items()}
    for name in ("reports", "jobs", "checks", "telemetry"):
        attr = int(f.attrs.get(f"n_{name}", -1))
        if attr != counts[name]:
            problems.append(f"root attribute n_{name}={attr} but /{name} has {counts[name]} rows")
    return problems + _report_key_problems(data["reports"]) + _index_problems(data, counts)


def _layout_problems(f: h5py.File, data: dict[str, Any]) -> list[str]:
    """The root's format and version, each dataset's presence, shape and dtype; the rows of
    every dataset that passes are read into `data`."""
    fmt = f.attrs.get("format")
    if isinstance(fmt, bytes):
        fmt = fmt.decode()
    if fmt != S.FORMAT:
        return [f"root attribute format is {fmt!r}, expected {S.FORMAT!r}"]
    version = int(f.attrs.get("schema_version", -1))
    if version != S.SCHEMA_VERSION:
        return [f"schema_version {version} is not {S.SCHEMA_VERSION}"]
    problems: list[str] = []
    for path, dt in S.dtypes().items():
        if path not in f:
            problems.append(f"missing dataset /{path}")
            continue
        ds = f[path]
        if ds.ndim != 1:
            problems.append(f"/{path} is not 1-D")
            continue
        old = S.legacy_dtype(path)
        if (ds.dtype.names != dt.names or ds.dtype.itemsize != dt.itemsize) and not (
                old is not None and ds.dtype.names == old.names
                and ds.dtype.itemsize == old.itemsize):
            problems.append(f"/{path} has dtype {ds.dtype}, expected {dt}")
            continue
        data[path] = read_rows(f, path)
    return problems


def _report_key_problems(rep: np.ndarray) -> list[str]:
    """/reports sorted by (node, job_id, restart, phase), each key once."""
    import numpy as np

    if not len(rep):
        return []
    order = np.lexsort((rep["phase"], rep["restart"], rep["job_id"], rep["node"]))
    if not np.array_equal(order, np.arange(len(rep))):
        return ["/reports is not sorted by (node, job_id, restart, phase)"]
    same = (
        (rep["node"][1:] == rep["node"][:-1])
        & (rep["job_id"][1:] == rep["job_id"][:-1])
        & (rep["restart"][1:] == rep["restart"][:-1])
        & (rep["phase"][1:] == rep["phase"][:-1])
    )
    if same.any():
        return [f"/reports holds {int(same.sum())} duplicate report key(s)"]
    return []


def _index_problems(data: dict[str, Any], counts: dict[str, int]) -> list[str]:
    """The row pointers and indexes: every range inside its target table, the job-reports
    index a permutation of /reports, /jobs one row per job in order and its id index equal."""
    import numpy as np

    problems: list[str] = []
    for table, first, count, target in (
        ("reports", "check_first", "check_count", "checks"),
        ("reports", "telemetry_first", "telemetry_count", "telemetry"),
        ("checks", "metric_first", "metric_count", "check_metrics"),
        ("jobs", "node_first", "node_count", "job_nodes"),
        ("jobs", "report_first", "report_count", S.JOB_REPORTS_INDEX),
        (S.NODE_INDEX, "report_first", "report_count", "reports"),
        (S.NODE_INDEX, "telemetry_first", "telemetry_count", "telemetry"),
    ):
        arr = data[table]
        if len(arr) and int((arr[first] + arr[count]).max()) > counts[target]:
            problems.append(f"/{table}.{first}+{count} points past the end of /{target}")
    for table in ("checks", "check_metrics", "telemetry"):
        arr = data[table]
        if len(arr) and int(arr["report_row"].max()) >= counts["reports"]:
            problems.append(f"/{table}.report_row points past the end of /reports")
    jr = data[S.JOB_REPORTS_INDEX]
    if len(jr) != counts["reports"] or (len(jr) and int(jr.max()) >= counts["reports"]):
        problems.append(f"/{S.JOB_REPORTS_INDEX} does not index /reports")
    jobs = data["jobs"]
    if len(jobs) and not bool(np.all(jobs["job_id"][1:] > jobs["job_id"][:-1])):
        problems.append("/jobs is not sorted by job_id with one row per job")
    if not np.array_equal(data[S.JOB_IDS_INDEX], jobs["job_id"]):
        problems.append(f"/{S.JOB_IDS_INDEX} differs from /jobs.job_id")
    return problems


def read_datasets(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of a segment file, fully read.

    Raises:
        ArchiveError: the file is not a readable schema-1 segment.
    """
    data: dict[str, np.ndarray] = {}
    with open_h5(path) as f:
        problems = schema_problems(f, data)
    if problems:
        raise ArchiveError(f"{path}: {problems[0]}")
    return data
