"""BVTS: the sampler's on-disk time series format (standard library only).

A file is a header then fixed-size records::

    b"BVTS1\\n"
    one JSON line (UTF-8, ends with b"\\n", at most 1 MiB):
        {"node": "gpu001", "interval_s": 10.0, "start_unix_s": 1700000000.0,
         "columns": [{"name": "gpu0.util_pct", "component": "gpu0", "unit": "%"}, ...],
         "components": {"gpu0": {"uuid": "GPU-..."},             # optional labels
                        "node": {"cpu_source": "cgroup v2 /sys/fs/cgroup/..."}},
         "job_id": 123}                                          # side files only
    records: float64 unix time + N float32 values, little-endian (NaN: not available)

The sampler writes `<state>/samples/seg-<unix_start>.bvts` (a new segment on the hour, when the
column set or the labels change, when the clock steps back, and at every start); the epilog cuts a job's window out of them into one
file of the same format with the union of their columns (`cut_window`).

A reader of a live segment ignores a last, partial record (the sampler may be writing it);
`strict=True` (ingest reading a side file) refuses it instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"BVTS1\n"
MAX_HEADER = 1 << 20
MAX_COLUMNS = 16384
SEGMENT_RE = re.compile(r"^seg-([0-9]{1,12})\.bvts$")
TMP_SEGMENT_RE = re.compile(r"^\.seg-[0-9]{1,12}\.bvts\.[0-9]{1,10}\.tmp$")
NAN = float("nan")


class FormatError(ValueError):
    """Not a valid BVTS file (bad magic, header, or a truncated record in strict mode)."""


@dataclass(frozen=True)
class Column:
    name: str
    component: str
    unit: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "component": self.component, "unit": self.unit}

    @property
    def metric(self) -> str:
        """The name without its component (`gpu0.util_pct` -> `util_pct`)."""
        return self.name[len(self.component) + 1:] if self.name.startswith(
            self.component + ".") else self.name


@dataclass(frozen=True)
class Header:
    node: str
    interval_s: float
    columns: tuple[Column, ...]
    start_unix_s: float = 0.0
    components: dict[str, dict[str, str]] = field(default_factory=dict)
    job_id: int | None = None

    @property
    def record_size(self) -> int:
        return 8 + 4 * len(self.columns)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "node": self.node, "interval_s": self.interval_s, "start_unix_s": self.start_unix_s,
            "columns": [c.to_dict() for c in self.columns], "components": self.components}
        if self.job_id is not None:
            doc["job_id"] = self.job_id
        return MAGIC + json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def record_struct(n_columns: int) -> struct.Struct:
    return struct.Struct(f"<d{n_columns}f")


def _parse_header(doc: Any) -> Header:
    if not isinstance(doc, dict):
        raise FormatError("header is not a JSON object")
    node, interval = doc.get("node"), doc.get("interval_s")
    if not isinstance(node, str) or not node:
        raise FormatError("header has no node name")
    if isinstance(interval, bool) or not isinstance(interval, int | float) \
            or not math.isfinite(interval) or interval <= 0:
        raise FormatError("header interval_s is not a positive number")
    raw = doc.get("columns")
    if not isinstance(raw, list) or len(raw) > MAX_COLUMNS:
        raise FormatError("header columns is not a list")
    cols = []
    for c in raw:
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str)
                                              for k in ("name", "component", "unit")):
            raise FormatError("a header column is not {name, component, unit}")
        cols.append(Column(c["name"], c["component"], c["unit"]))
    if len({c.name for c in cols}) != len(cols):
        raise FormatError("header has duplicate column names")
    comps = doc.get("components") or {}
    if not isinstance(comps, dict):
        raise FormatError("header components is not an object")
    components = {str(k): {str(a): str(b) for a, b in v.items()}
                  for k, v in comps.items() if isinstance(v, dict)}
    start = doc.get("start_unix_s", 0.0)
    job = doc.get("job_id")
    return Header(node, float(interval), tuple(cols),
                  float(start) if isinstance(start, int | float) else 0.0, components,
                  job if isinstance(job, int) and not isinstance(job, bool) else None)


def open_no_follow(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """Open a regular file for reading, never through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                 dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header_fd(fd: int) -> tuple[Header, int]:
    """The header of the file open at `fd` and the offset of its first record.

    Raises:
        FormatError: bad magic or header.
    """
    os.lseek(fd, 0, os.SEEK_SET)
    head = os.pread(fd, len(MAGIC) + MAX_HEADER, 0)
    if not head.startswith(MAGIC):
        raise FormatError("bad magic (not a BVTS1 file)")
    end = head.find(b"\n", len(MAGIC))
    if end < 0:
        raise FormatError("header line not terminated (truncated?)")
    try:
        doc = json.loads(head[len(MAGIC):end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not JSON: {exc}") from exc
    return _parse_header(doc), end + 1


@dataclass
class Segment:
    """A file's header and its raw record bytes (whole records only)."""

    header: Header
    data: bytes
    truncated: int = 0  # bytes of a trailing partial record that were dropped

    @property
    def n_records(self) -> int:
        return len(self.data) // self.header.record_size

    def records(self) -> Iterator[tuple[float, tuple[float, ...]]]:
        st = record_struct(len(self.header.columns))
        for rec in st.iter_unpack(self.data):
            yield rec[0], rec[1:]

    def time_at(self, i: int) -> float:
        return struct.unpack_from("<d", self.data, i * self.header.record_size)[0]


def read_fd(fd: int, *, strict: bool = False, limit: int = 1 << 34) -> Segment:
    """Read a whole BVTS file open at `fd`.

    Raises:
        FormatError: bad header; in `strict` mode also a trailing partial record.
    """
    header, offset = read_header_fd(fd)
    size = os.fstat(fd).st_size - offset
    if size > limit:
        raise FormatError(f"larger than {limit} bytes")
    chunks, pos = [], offset
    while True:
        chunk = os.pread(fd, 1 << 22, pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    data = b"".join(chunks)
    extra = len(data) % header.record_size
    if extra:
        if strict:
            raise FormatError(f"truncated record ({extra} trailing bytes)")
        data = data[:len(data) - extra]
    return Segment(header, data, extra)


@dataclass(frozen=True)
class Probe:
    """What a file holds, read without loading its records: header, record count, first and
    last record times (records are in time order)."""

    header: Header
    n_records: int
    t_first: float
    t_last: float


def probe_file(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> Probe:
    """Header and bounds of a BVTS file; a trailing partial record is refused.

    Raises:
        FormatError: bad header, truncated record, or no record at all.
        OSError: unreadable, or a symlink (ELOOP).
    """
    fd = open_no_follow(path, dir_fd)
    try:
        header, offset = read_header_fd(fd)
        size = os.fstat(fd).st_size - offset
        rs = header.record_size
        if size % rs:
            raise FormatError(f"truncated record ({size % rs} trailing bytes)")
        n = size // rs
        if not n:
            raise FormatError("no record")
        first = struct.unpack("<d", os.pread(fd, 8, offset))[0]
        last = struct.unpack("<d", os.pread(fd, 8, offset + (n - 1) * rs))[0]
    finally:
        os.close(fd)
    return Probe(header, n, first, last)


def read_file(path: str | os.PathLike[str], *, strict: bool = False,
              dir_fd: int | None = None) -> Segment:
    fd = open_no_follow(path, dir_fd)
    try:
        return read_fd(fd, strict=strict)
    finally:
        os.close(fd)


class SegmentWriter:
    """Appends records to one segment file (created whole with its header, never over a name).

    A write that fails (ENOSPC, EIO) leaves no half of anything behind: a header that could not
    be written closes and unlinks the new file (the constructor raises), a record that could
    not be written is cut off again, so the file always ends on a whole record.
    """

    def __init__(self, path: Path, header: Header, mode: int = 0o640) -> None:
        self.path = path
        self.header = header
        self.records = 0
        self._struct = record_struct(len(header.columns))
        # The header is written under a private name and the file then linked into place, so a
        # reader (the epilog, the exporter) never sees a segment without its header. link(2)
        # fails with EEXIST like O_EXCL did; the temporary name is not a segment name.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC | os.O_APPEND, mode)
        try:
            self._write(header.encode())
            os.link(tmp, path, follow_symlinks=False)
        except BaseException:
            # One descriptor per failed start would otherwise leak (a full disk, every tick).
            os.close(self.fd)
            self.fd = -1
            raise
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self._size = len(header.encode())

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def append(self, t: float, values: Sequence[float]) -> None:
        # One write per record: a reader sees whole records or a partial last one, never a gap.
        data = self._struct.pack(t, *values)
        try:
            self._write(data)
        except OSError:
            try:  # a partial record would shift every later one: cut it off
                os.ftruncate(self.fd, self._size)
            except OSError:
                pass
            raise
        self._size += len(data)
        self.records += 1

    def close(self, *, sync: bool = True) -> None:
        if self.fd >= 0:
            if sync:
                try:
                    os.fsync(self.fd)
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = -1


def list_segments(samples: Path) -> list[tuple[float, str]]:
    """(start, name) of every `seg-<start>.bvts` regular file, oldest first."""
    out = []
    try:
        with os.scandir(samples) as it:
            for de in it:
                m = SEGMENT_RE.match(de.name)
                if m and de.is_file(follow_symlinks=False):
                    out.append((float(m.group(1)), de.name))
    except FileNotFoundError:
        return []
    return sorted(out)


def union_columns(headers: Iterable[Header]) -> tuple[tuple[Column, ...], dict[str, dict[str, str]]]:
    cols: dict[str, Column] = {}
    comps: dict[str, dict[str, str]] = {}
    for h in headers:
        for c in h.columns:
            cols.setdefault(c.name, c)
        for k, v in h.components.items():
            comps.setdefault(k, {}).update(v)
    return tuple(cols.values()), comps


def cut_window(samples: Path, t_start: float, t_end: float, *, node: str,
               job_id: int | None = None) -> tuple[Header, bytes] | None:
    """The records of the segments in `samples` with t_start <= time <= t_end, as one file's
    header and records over the union of their columns (NaN where a segment lacked one).
    None when there is no record in the window."""
    segs = list_segments(samples)
    chosen = []
    for i, (start, name) in enumerate(segs):
        nxt = segs[i + 1][0] if i + 1 < len(segs) else math.inf
        if start > t_end or nxt < t_start:
            continue
        try:
            seg = read_file(samples / name)
        except (OSError, FormatError) as exc:
            logger.warning("sample segment %s skipped: %s", samples / name, exc)
            continue
        chosen.append(seg)
    if not chosen:
        return None
    columns, comps = union_columns(s.header for s in chosen)
    index = {c.name: i for i, c in enumerate(columns)}
    out_struct = record_struct(len(columns))
    parts: list[bytes] = []
    for seg in chosen:
        same = seg.header.names == tuple(c.name for c in columns)
        where = [index[c.name] for c in seg.header.columns]
        for t, vals in seg.records():
            if not t_start <= t <= t_end:
                continue
            if same:
                parts.append(out_struct.pack(t, *vals))
            else:
                row = [NAN] * len(columns)
                for j, v in zip(where, vals, strict=True):
                    row[j] = v
                parts.append(out_struct.pack(t, *row))
    if not parts:
        return None
    header = Header(node, chosen[-1].header.interval_s, columns, t_start, comps, job_id)
    return header, b"".join(parts)
