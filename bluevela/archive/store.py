"""The archive directory: immutable HDF5 segment files, a manifest naming the live ones, and
the single-writer lock.

Layout (see docs/archive.md)::

    <archive>/MANIFEST.json          live segments (atomically replaced: temp, fsync, rename)
    <archive>/.lock                  flock()ed by the one writer
    <archive>/segments/seg-<generation>-L<level>.h5

Crash safety: a segment is built in memory, written to a temporary name, fsynced and renamed
(`util.fs.atomic_write`); only then is it added to the manifest, the same way. Readers open
only what the manifest names, so they never see a half-written file; a writer killed at any
moment leaves at worst an unlisted file or a stale temporary file, which the next writer
removes under the lock. Compaction merges `FANOUT` segments of one level into one of the next
level (new file, then manifest, then the old files are deleted), so a year of nightly ingests
stays a handful of files.

HDF5's own file locking is turned off (`locking=False`, as HDF5_USE_FILE_LOCKING=FALSE):
segment files never change after their rename, and writers exclude each other with flock on
`.lock`, which also works on NFS (Linux emulates it with POSIX locks).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bluevela.archive import schema as S
from bluevela.archive.segment_read import h5py_module as h5py_module
from bluevela.archive.segment_read import open_h5 as open_h5
from bluevela.archive.segment_read import read_datasets as read_datasets
from bluevela.archive.segment_read import read_rows as read_rows
from bluevela.errors import ArchiveError, UnsafeValueError
from bluevela.util.fs import atomic_write, ensure_dir, fsync_dir, read_no_follow, try_flock

if TYPE_CHECKING:
    import h5py
    import numpy as np

    from bluevela.archive.tables import Tables

logger = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "bluevela-archive-manifest"
LOCK = ".lock"
SEGMENTS = "segments"
FANOUT = 4  # 8 files for a year of nightly ingests; each report rewritten ~log4(ingests) times
COMPRESSION_LEVEL = 1
CHUNK_BYTES = 32 << 10
_SEGMENT_RE = re.compile(r"^seg-([0-9]{12})-L([0-9]{1,2})\.h5$")


@dataclass(frozen=True)
class SegmentInfo:
    """One live segment, as listed in the manifest."""

    file: str
    level: int
    generation: int
    reports: int
    jobs: int
    job_id_min: int
    job_id_max: int
    time_min: float
    time_max: float
    bytes: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentInfo:
        info = cls(**{k: d[k] for k in cls.__dataclass_fields__})
        if not _SEGMENT_RE.match(info.file):
            raise ArchiveError(f"manifest names an unexpected file {info.file!r}")
        return info


@dataclass
class Manifest:
    """The live segment list; `generation` numbers every segment ever written."""

    generation: int = 0
    segments: list[SegmentInfo] = field(default_factory=list)

    def to_json(self) -> bytes:
        body = {"format": MANIFEST_FORMAT, "schema_version": S.SCHEMA_VERSION,
                "generation": self.generation, "written_unix_s": time.time(),
                "segments": [asdict(s) for s in self.segments]}
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


class Archive:
    """An archive directory: read the manifest, open segments, take the writer lock."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.segments_dir = self.root / SEGMENTS

    def check(self) -> None:
        """Raise ArchiveError unless the archive directory exists and is a directory."""
        if not self.root.exists():
            raise ArchiveError(f"archive directory {self.root} does not exist "
                               "(create it, or set paths.archive / BV_ARCHIVE_DIR)")
        if self.root.is_symlink() or not self.root.is_dir():
            raise ArchiveError(f"archive {self.root} is not a plain directory")

    def manifest(self) -> Manifest:
        """Read the manifest (an empty archive has none).

        Raises:
            ArchiveError: missing archive, unreadable or invalid manifest, or segment files
                present without a manifest.
        """
        self.check()
        path = self.root / MANIFEST
        try:
            raw = read_no_follow(path)
        except FileNotFoundError:
            if self._segment_files():
                raise ArchiveError(f"{path} is missing but {self.segments_dir} holds segment "
                                   "files; restore the manifest from a backup") from None
            return Manifest()
        except (OSError, UnsafeValueError) as exc:
            raise ArchiveError(f"cannot read {path}: {exc}") from exc
        try:
            body = json.loads(raw)
            if body.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {body.get('format')!r}")
            if body.get("schema_version") != S.SCHEMA_VERSION:
                raise ValueError(f"schema_version {body.get('schema_version')!r} is not "
                                 f"{S.SCHEMA_VERSION}")
            segs = [SegmentInfo.from_dict(d) for d in body["segments"]]
            return Manifest(int(body["generation"]), segs)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ArchiveError(f"{path} is not a valid archive manifest: {exc}") from exc

    def _init_manifest(self) -> None:
        """Give a new archive an empty manifest before its first segment, so that a segment
        without a manifest always means damage, never a first ingest killed half-way."""
        path = self.root / MANIFEST
        if os.path.lexists(path) or self._segment_files():
            return
        try:
            atomic_write(path, Manifest().to_json(), 0o644)
        except OSError as exc:
            raise ArchiveError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def path_of(self, info: SegmentInfo) -> Path:
        return self.segments_dir / info.file

    def _segment_files(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.segments_dir) if n.endswith(".h5"))
        except FileNotFoundError:
            return []

    def read_segments(self, fn: Callable[[list[tuple[SegmentInfo, Path]]], T],
                      retries: int = 5) -> T:
        """Call `fn(list of (info, path))`, retrying if a compaction removed a file meanwhile."""
        for attempt in range(retries):
            segs = [(s, self.path_of(s)) for s in self.manifest().segments]
            try:
                return fn(segs)
            except FileNotFoundError:
                if attempt == retries - 1:
                    raise ArchiveError(f"segments of {self.root} keep vanishing while read; "
                                       "is a writer compacting continuously?") from None
                time.sleep(0.05)
        raise AssertionError("unreachable")

    @contextmanager
    def writer(self, lock_wait_s: float = 30.0) -> Iterator[Writer]:
        """Hold the single-writer lock; the Writer cleans what a killed writer left.

        Raises:
            ArchiveError: the lock is held by another writer past `lock_wait_s`, or cannot be
                taken at all (e.g. no lock daemon on NFS).
        """
        self.check()
        path = self.root / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ArchiveError(f"cannot open lock file {path}: {exc.strerror}") from exc
        try:
            deadline = time.monotonic() + lock_wait_s
            while True:
                try:
                    if try_flock(fd):
                        break
                except OSError as exc:
                    raise ArchiveError(f"cannot lock {path}: {exc.strerror} (on NFS this "
                                       "needs a working lock service)") from exc
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                    raise ArchiveError(f"another ingest holds {path} (pid {holder or '?'})"
                                       f"; gave up after {lock_wait_s:g} s") from None
                time.sleep(0.1)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._init_manifest()
            w = Writer(self)
            w.collect_garbage()
            yield w
        finally:
            os.close(fd)  # releases the flock


class Writer:
    """What only the lock holder may do: write segments, commit the manifest, compact."""

    def __init__(self, archive: Archive) -> None:
        self.archive = archive
        self.manifest = archive.manifest()

    def collect_garbage(self) -> None:
        """Remove temporary files and segments the manifest does not list (a killed writer's)."""
        live = {s.file for s in self.manifest.segments}
        for directory in (self.archive.root, self.archive.segments_dir):
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            in_segments = directory == self.archive.segments_dir
            for name in names:
                # Only our own temporaries: the archive directory may hold other tools' files.
                stale_temp = name.endswith(".tmp") and name.startswith(
                    ".seg-" if in_segments else f".{MANIFEST}.")
                orphan = in_segments and _SEGMENT_RE.match(name) and name not in live
                if stale_temp or orphan:
                    try:
                        os.unlink(directory / name)
                        logger.info("removed %s left by an interrupted writer", directory / name)
                    except OSError as exc:
                        logger.warning("cannot remove %s: %s", directory / name, exc.strerror)

    def write_segment(self, tables: Tables, level: int) -> SegmentInfo:
        """Write `tables` as a new durable segment file (not yet in the manifest).

        Raises:
            ArchiveError: the file could not be written (ENOSPC...); nothing is left behind.
        """
        from bluevela.archive.tables import finalize

        final = finalize(tables)
        generation = self.manifest.generation + 1
        name = f"seg-{generation:012d}-L{level}.h5"
        data = segment_image(final, generation=generation, level=level)
        try:
            ensure_dir(self.archive.segments_dir, 0o755)
            atomic_write(self.archive.segments_dir / name, data, 0o644)
        except (OSError, UnsafeValueError) as exc:
            raise ArchiveError(f"cannot write {self.archive.segments_dir / name}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from exc
        self.manifest.generation = generation
        logger.debug("wrote %s (%d bytes)", name, len(data))
        rep, jobs = final["reports"], final["jobs"]
        ids = rep["job_id"] if len(rep) else jobs["job_id"]
        return SegmentInfo(
            file=name, level=level, generation=generation, reports=len(rep), jobs=len(jobs),
            job_id_min=int(ids.min()) if len(ids) else 0,
            job_id_max=int(ids.max()) if len(ids) else 0,
            time_min=float(rep["time_unix_s"].min()) if len(rep) else 0.0,
            time_max=float(rep["time_unix_s"].max()) if len(rep) else 0.0,
            bytes=len(data),
        )

    def commit(self, add: Sequence[SegmentInfo], remove: Sequence[SegmentInfo] = ()) -> None:
        """Atomically replace the manifest: `add` becomes live, `remove` is dropped and deleted.

        Raises:
            ArchiveError: the manifest could not be written (the old one stays in force).
        """
        gone = {s.file for s in remove}
        new = Manifest(self.manifest.generation,
                       [s for s in self.manifest.segments if s.file not in gone] + list(add))
        path = self.archive.root / MANIFEST
        try:
            atomic_write(path, new.to_json(), 0o644)
        except OSError as exc:
            raise ArchiveError(f"cannot write {path}: {exc.strerror or exc}") from exc
        self.manifest = new
        logger.debug("manifest committed: +%s -%s", [s.file for s in add],
                     [s.file for s in remove])
        for s in remove:
            try:
                os.unlink(self.archive.path_of(s))
            except FileNotFoundError:
                pass
        if remove:
            fsync_dir(self.archive.segments_dir)

    def compact(self, fanout: int = FANOUT) -> int:
        """Merge `fanout` segments of the lowest crowded level into one; repeat. Return merges.

        Raises:
            ArchiveError: a merged segment or the manifest could not be written; the archive
                is then unchanged (the inputs stay live).
        """
        merges = 0
        while True:
            by_level: dict[int, list[SegmentInfo]] = {}
            for s in self.manifest.segments:
                by_level.setdefault(s.level, []).append(s)
            crowded = sorted(lv for lv, segs in by_level.items() if len(segs) >= fanout)
            if not crowded:
                return merges
            level = crowded[0]
            inputs = sorted(by_level[level], key=lambda s: s.generation)[:fanout]
            t0 = time.perf_counter()
            merged = merge_tables([self.archive.path_of(s) for s in inputs])
            info = self.write_segment(merged, level + 1)
            self.commit([info], inputs)
            merges += 1
            logger.info("compacted %d L%d segments (%d reports) into %s in %.2f s", len(inputs),
                        level, info.reports, info.file, time.perf_counter() - t0)


def merge_tables(paths: list[Path]) -> Tables:
    """The union of several segments' tables, in the given order (earlier wins duplicates)."""
    from bluevela.archive.tables import concat, from_segment

    return concat(from_segment(read_datasets(p)) for p in paths)


def segment_image(final: dict[str, np.ndarray], *, generation: int, level: int) -> bytes:
    """The bytes of an HDF5 segment file holding `final` (built in memory, never on disk)."""
    h5py = h5py_module()

    from bluevela import __version__

    f = h5py.File(f"bluevela-segment-{generation}.h5", "w", driver="core", backing_store=False)
    try:
        f.attrs["format"] = S.FORMAT
        f.attrs["schema_version"] = S.SCHEMA_VERSION
        f.attrs["generation"] = generation
        f.attrs["level"] = level
        f.attrs["created_unix_s"] = time.time()
        f.attrs["created_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        f.attrs["bluevela_version"] = __version__
        f.attrs["docs"] = "docs/archive.md in the bluevela source tree"
        for name in ("reports", "jobs", "checks", "telemetry", "check_metrics", "job_nodes"):
            f.attrs[f"n_{name}"] = len(final[name])
        for path, arr in final.items():
            _dataset(f, path, arr)
        f.flush()
        return bytes(f.id.get_file_image())
    finally:
        f.close()


def _file_type(dtype: np.dtype[Any]) -> Any:
    """The HDF5 type to store `dtype` with: fixed-width strings NUL-terminated, not NUL-padded,
    so that h5dump prints `"node1"` rather than 64 bytes of padding (the columns are one byte
    wider than the longest value validation allows, so nothing is cut)."""
    h5py = h5py_module()
    h5t = h5py.h5t
    tid = h5t.py_create(dtype, logical=True)
    if dtype.names is None:
        return tid
    out = h5t.create(h5t.COMPOUND, tid.get_size())
    for i in range(tid.get_nmembers()):
        member = tid.get_member_type(i)
        if isinstance(member, h5t.TypeStringID) and not member.is_variable_str():
            member = member.copy()
            member.set_strpad(h5t.STR_NULLTERM)
        out.insert(tid.get_member_name(i), tid.get_member_offset(i), member)
    return out


def _dataset(f: h5py.File, path: str, arr: np.ndarray) -> None:
    import numpy as np

    h5py = h5py_module()
    # The canonical dtype, not arr's: arrays read back from a file lose h5py's string/enum
    # metadata, which the new file must carry again.
    dtype = S.dtypes()[path]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    if len(arr):
        dcpl.set_chunk((max(1, min(len(arr), CHUNK_BYTES // max(1, dtype.itemsize))),))
        dcpl.set_shuffle()
        dcpl.set_deflate(COMPRESSION_LEVEL)
    parent, _, name = path.rpartition("/")
    group = f.require_group(parent) if parent else f
    space = h5py.h5s.create_simple((len(arr),))
    ftype = _file_type(dtype)
    dsid = h5py.h5d.create(group.id, name.encode(), ftype, space, dcpl=dcpl)
    ds = h5py.Dataset(dsid)
    if len(arr) and not dtype.hasobject:
        # Same layout in memory and file: HDF5 copies bytes (NUL-padded strings are valid
        # NUL-terminated ones) instead of converting every string, several times faster.
        data = np.ascontiguousarray(arr, dtype=dtype)
        dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, data, mtype=ftype)
    elif len(arr):
        ds[...] = arr.astype(dtype, copy=False) if arr.dtype != dtype else arr
    ds.attrs["description"] = S.DESCRIPTIONS.get(path, "")
    names = dtype.names or ()
    units = {n: S.UNITS[n] for n in names if n in S.UNITS}
    if units:
        ds.attrs["units"] = json.dumps(units, sort_keys=True)
