"""Atomic, symlink-safe file writes and validated names.

Hooks run as root, so every path they write is built from validated names only, and nothing is
followed through a symlink. Writes go to a temporary file in the target directory, are fsynced,
renamed into place, and the directory is fsynced too (what Slurm does for its own state).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bluevela.errors import UnsafeValueError

# Slurm node names: letters, digits, '-', '_', '.'; no path separators, no leading dot.
_NODE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_JOB_RE = re.compile(r"^[0-9]{1,12}$")

T = TypeVar("T")


def safe_node_name(value: str) -> str:
    """Return `value` if it is a plain node name, else raise UnsafeValueError."""
    if not _NODE_RE.match(value) or ".." in value:
        raise UnsafeValueError(f"unsafe node name {value!r}")
    return value


def safe_job_id(value: str | int) -> int:
    """Return the job id as an int if it is a plain positive integer, else raise."""
    text = str(value)
    if not _JOB_RE.match(text) or int(text) <= 0:
        raise UnsafeValueError(f"unsafe job id {text!r}")
    return int(text)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it survives power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path, mode: int = 0o755) -> Path:
    """Create `path` (and parents) if needed; refuse it if it is a symlink or not a directory."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeValueError(f"{path} is not a plain directory")
    return path


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` atomically: temp file (O_EXCL|O_NOFOLLOW), fsync, rename, fsync dir.

    Raises:
        OSError: on any I/O failure (ENOSPC included); the target is then untouched and the
            temporary file removed.
    """
    # The parent is opened normally (a site may symlink /var/spool elsewhere); the file itself
    # is written and renamed relative to that fd.
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        atomic_write_at(dfd, path.name, data, mode)
    finally:
        os.close(dfd)


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(name: str | os.PathLike[str], dir_fd: int | None = None, *,
             create: int | None = None) -> int:
    """Open a directory without following a symlink at its last component; return the fd.

    Every later move or unlink relative to the fd (`os.rename(..., src_dir_fd=, dst_dir_fd=)`,
    `os.unlink(..., dir_fd=)`) stays in that directory even if its name is swapped for a
    symlink meanwhile.

    Args:
        name: the directory (relative to `dir_fd` when given).
        dir_fd: a directory fd `name` is relative to.
        create: mkdir it first with this mode when missing.

    Raises:
        UnsafeValueError: it is a symlink or not a directory.
        OSError: it cannot be created or opened (FileNotFoundError when missing).
    """
    if create is not None:
        try:
            os.mkdir(name, create, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeValueError(f"{os.fspath(name)} is a symlink or not a directory; "
                                   "refusing to follow it") from exc
        raise


def owner_problem(st: os.stat_result, uid: int | None = None) -> str | None:
    """Why a directory with `st` is not private to `uid` (default: us), or None when it is:
    it must be owned by `uid` and not writable by group or others."""
    uid = os.geteuid() if uid is None else uid
    if st.st_uid != uid:
        return f"owned by {user_name(st.st_uid)}, not {user_name(uid)}"
    if st.st_mode & 0o022:
        return f"mode {stat.S_IMODE(st.st_mode):04o} is group/other-writable"
    return None


def user_name(uid: int) -> str:
    """`name (uid N)`, or `uid N` when the uid has no passwd entry."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def atomic_write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """`atomic_write` relative to an open directory (see `open_dir`): temp file created with
    O_EXCL|O_NOFOLLOW, fsync, rename, fsync of the directory, all through `dir_fd`.

    Raises:
        OSError: on any I/O failure; the target is then untouched and the temp file removed.
    """
    atomic_fill_at(dir_fd, name, lambda fd: write_all(fd, data), mode)


def atomic_fill_at(dir_fd: int, name: str, fill: Callable[[int], T], mode: int = 0o644) -> T:
    """`atomic_write_at` for content written as it comes (a stream, a hashed file): `fill`
    writes it to the temporary file's fd; its result is returned once the file is in place.

    Raises:
        OSError: on any I/O failure; the target is then untouched and the temp file removed.
        Whatever `fill` raises, with the same clean-up.
    """
    tmp = f".{name}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # a stale temp of a dead writer with our pid
    except FileNotFoundError:
        pass
    fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        result = fill(fd)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)
    return result


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of `data` to `fd` (os.write may write less than it was given)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def read_bounded(fd: int, limit: int) -> bytes:
    """At most `limit` bytes of an open file, read in 1 MiB chunks (a larger file is cut:
    the caller's parser sees it as too long or truncated)."""
    chunks = []
    while limit > 0:
        chunk = os.read(fd, min(1 << 20, limit))
        if not chunk:
            break
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def read_no_follow(path: Path, limit: int = 64 << 20) -> bytes:
    """Read a regular file without following a symlink at its last component."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeValueError(f"{path} is not a regular file")
        return read_bounded(fd, limit)
    finally:
        os.close(fd)


def try_flock(fd: int) -> bool:
    """Take an exclusive flock on `fd` without blocking: True when taken, False when another
    process holds it.

    Raises:
        OSError: any other failure (no lock service on NFS, ...).
    """
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True
