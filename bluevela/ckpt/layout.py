"""Where shards lie, and the inventory of a directory of them (standard library only).

Node-local tier (`site.yaml` `node_classes.<c>.checkpoint.dir`, or `BV_CKPT_LOCAL_DIR`)::

    <local>/bv-<uid>/job-<job>/<name>/own/step-<N>/rank-<R>.bvck    written by rank R here
    <local>/bv-<uid>/job-<job>/<name>/held/step-<N>/rank-<R>.bvck   a partner's copy of rank R

Shared tier (the script's checkpoint directory)::

    <shared>/<name>/step-<N>/rank-<R>.bvck
    <shared>/<name>/step-<N>/manifest.json    rank 0, once every rank's copy is drained

Everything under `job-<job>` belongs to that job: the epilog removes the directory when the
job's allocation ends on the node (`clear_job`). Directories are created 0700 and opened
without following a symlink; names are built from integers only.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from bluevela.util.fs import open_dir

STEP_RE = re.compile(r"^step-([0-9]{8,12})$")
RANK_RE = re.compile(r"^rank-([0-9]{5,7})\.bvck$")
DRAINED_RE = re.compile(r"^drained-([0-9]{5,7})$")  # a rank's shard of the step is drained
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
MAX_ENTRIES = 100_000  # a directory listing read no further


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.bvck"


def check_name(name: str) -> str:
    if not NAME_RE.match(name) or ".." in name:
        raise ValueError(f"checkpoint name {name!r}: letters, digits, '_', '-', '.' only")
    return name


def node_dir(local: Path, node: str) -> Path:
    """`local` with each `%n` replaced by `node`, the node's name (Slurm's convention for a
    path of one node among several on one host: several slurmd per host, a shared root)."""
    if "%n" not in str(local):
        return local
    if not NAME_RE.match(node) or ".." in node:
        raise ValueError(f"node name {node!r} cannot name a directory")
    return Path(str(local).replace("%n", node))


def job_root(local: Path, job: str, uid: int | None = None) -> Path:
    """The directory every node-local file of `job` lies under."""
    uid = os.getuid() if uid is None else uid
    if not job.isdigit():
        job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:64] or "none"
    return local / f"bv-{uid}" / f"job-{job}"


def open_chain(base: Path, parts: list[str], create: bool) -> int:
    """Open `base`/parts... one component at a time, never following a link below `base`.

    Raises:
        OSError: a component is missing (and not `create`), or cannot be made.
        UnsafeValueError: a component is a symlink or not a directory.
    """
    if create:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = open_dir(base)
    try:
        for part in parts:
            nxt = open_dir(part, fd, create=0o700 if create else None)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def drained_name(rank: int) -> str:
    return f"drained-{rank:05d}"


@dataclass(frozen=True)
class Entry:
    """A shard file found in a tier (not yet verified); `drained`: a marker that the rank's
    shard of the step reached shared storage (size 0)."""

    step: int
    rank: int
    size: int
    drained: bool = False


def inventory(base: Path, parts: list[str]) -> list[Entry]:
    """The shard files under `base`/parts/step-*/ (bounded, no link followed); a missing
    directory is an empty inventory."""
    try:
        fd = open_chain(base, parts, create=False)
    except (OSError, ValueError):
        return []
    out: list[Entry] = []
    try:
        for i, sname in enumerate(sorted(os.listdir(fd))):
            if i >= MAX_ENTRIES:
                break
            m = STEP_RE.match(sname)
            if not m:
                continue
            try:
                sfd = open_dir(sname, fd)
            except (OSError, ValueError):
                continue
            try:
                for j, rname in enumerate(os.listdir(sfd)):
                    if j >= MAX_ENTRIES:
                        break
                    r = RANK_RE.match(rname)
                    if not r:
                        d = DRAINED_RE.match(rname)
                        if d:
                            out.append(Entry(int(m.group(1)), int(d.group(1)), 0, True))
                        continue
                    try:
                        st = os.stat(rname, dir_fd=sfd, follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        out.append(Entry(int(m.group(1)), int(r.group(1)), st.st_size))
            finally:
                os.close(sfd)
    finally:
        os.close(fd)
    return out


def remove_step(base: Path, parts: list[str], step: int, rank: int | None = None) -> int:
    """Remove one rank's shard of `step` (or the whole step directory); the bytes freed."""
    try:
        fd = open_chain(base, parts, create=False)
    except (OSError, ValueError):
        return 0
    freed = 0
    try:
        try:
            sfd = open_dir(step_dir(step), fd)
        except (OSError, ValueError):
            return 0
        try:
            for name in os.listdir(sfd):
                if rank is not None and name not in (shard_name(rank), drained_name(rank)) \
                        and not name.startswith(f".{shard_name(rank)}."):
                    continue
                try:
                    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                    os.unlink(name, dir_fd=sfd)
                    freed += st.st_size
                except OSError:
                    pass
            left = os.listdir(sfd)
        finally:
            os.close(sfd)
        if not left:
            try:
                os.rmdir(step_dir(step), dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    return freed


def clear_job(local: Path, job: str, uid: int) -> bool:
    """Remove what `job` left under `local` for user `uid` (the epilog, as root): the job's
    directory `bv-<uid>/job-<job>`, opened one component at a time without following a link
    (the user owns `bv-<uid>`: a symlink planted there is refused, not followed), removed by
    an fd-based rmtree that follows no link inside it. True when something was removed.

    Raises:
        OSError, UnsafeValueError: `local` or `bv-<uid>` cannot be opened safely (a link, not
            a directory, not owned by `uid`).
    """
    from bluevela.errors import UnsafeValueError

    root = job_root(local, job, uid)
    base = open_dir(local)
    try:
        try:
            ufd = open_dir(root.parent.name, base)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(ufd).st_uid != uid:
                raise UnsafeValueError(f"{local / root.parent.name} is not owned by uid {uid}")
            try:
                st = os.stat(root.name, dir_fd=ufd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(root.name, dir_fd=ufd)  # a link or a file in its place: only that
                return True
            shutil.rmtree(root.name, dir_fd=ufd)
            return True
        finally:
            os.close(ufd)
    finally:
        os.close(base)
