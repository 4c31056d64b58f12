"""A framework's checkpoint folder through the store: what bv's HF Trainer and Accelerate
integrations use when the site turns the node-local tier on (docs/checkpoints.md,
"Frameworks").

Those frameworks write a checkpoint as a folder of files (model, optimizer, scheduler, RNG
states, trainer state) through their own code, with no storage plugin to hand the bytes to. So
the integration lets the framework write its folder to this node's tier (`FolderStore.work`:
a local disk, not the shared file system: the loop's stall) and gives the folder's files to the
store as this rank's shard of the step (`save`): the store copies them to the partner node and
drains them to shared storage as for any state. At start (`restore`, a collective) the newest
step complete somewhere is written back to this node's tier, each rank's own files with rank 0's
(model, optimizer, trainer state), and linked where the framework's own resume looks
(``<output_dir>/checkpoint-N``): every node's link target is its own node's copy, so no rank
reads the shared file system on the way, and a spare that replaced a lost node fetches that
node's shard from its partner. Only where nothing of that step or a newer one lies there
already: the framework's own folder always wins.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bluevela.ckpt.store import CheckpointStore, SaveStats, from_site, open_store
from bluevela.util.fs import atomic_write

logger = logging.getLogger(__name__)

MAX_FILES = 100_000  # files of one checkpoint folder
SHARED_SUBDIR = "bv-ckpt"  # the store's shared directory inside the framework's output dir


class FolderError(ValueError):
    """A checkpoint folder the store cannot take or give back (one-line reason)."""


def tier_on() -> bool:
    """Whether this node has a node-local checkpoint tier (site.yaml's node class
    `checkpoint.dir`, or ``BV_CKPT_LOCAL_DIR``)."""
    return from_site(None).local_dir is not None


def read_folder(folder: Path) -> dict[str, bytes]:
    """Every regular file under `folder` by its relative name ('/'-separated); a symbolic link
    is never followed (left out, said in the log)."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            rel = path.relative_to(folder).as_posix()
            if not stat.S_ISREG(st.st_mode):
                logger.info("bv ckpt: %s left out of the checkpoint: not a regular file", rel)
                continue
            if len(out) >= MAX_FILES:
                raise FolderError(f"{folder}: more than {MAX_FILES} files")
            out[rel] = path.read_bytes()
        dirnames.sort()
    return out


def _checked(name: str) -> list[str]:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise FolderError(f"file name {name[:80]!r} in a checkpoint is not a relative path")
    return parts


def write_folder(files: Mapping[str, bytes], dest: Path) -> None:
    """Write `files` under `dest` (created), each file atomically; a name that is not a plain
    relative path is refused before anything is written."""
    for name in files:
        _checked(name)
    for name, data in files.items():
        path = dest.joinpath(*_checked(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data, 0o600)


class FolderStore:
    """One rank's side (a collective to build: every rank of the job makes one).

    Args:
        output_dir: the framework's output directory (its checkpoints' home); the store
            drains to ``<output_dir>/bv-ckpt/<name>``.
        name: the store's checkpoint name ("hf", "accelerate").
    """

    def __init__(self, output_dir: str | os.PathLike[str], name: str, **overrides: Any) -> None:
        self.output_dir = Path(output_dir)
        self.store: CheckpointStore = open_store(self.output_dir / SHARED_SUBDIR, name,
                                                 **overrides)
        if self.store.root is None:
            raise FolderError("no node-local checkpoint tier on this node")
        self.work = self.store.root / f"{name}.work"  # the epilog removes the job's root

    def save_dir(self) -> Path:
        """Where the framework writes this rank's next folder (empty, on this node)."""
        d = self.work / f"save-r{self.store.rank}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def save(self, step: int, folder: Path, drain: bool | None = None) -> SaveStats:
        """This rank's files of the folder the framework just wrote, as its shard of `step`;
        the folder is removed once staged (the store's tier holds the copy)."""
        stats = self.store.save(step, {"files": read_folder(folder)}, drain=drain)
        shutil.rmtree(folder, ignore_errors=True)
        return stats

    def restore(self, link_name: str, newest_there: int | None) -> int | None:
        """A collective: the newest step complete somewhere, written to this node's tier and
        linked at ``<output_dir>/<link_name % step>`` by rank 0 unless the framework's own
        folder of that step or a newer one (`newest_there`, rank 0's look) is there. Returns
        the step linked, else None."""
        coll = self.store.coll
        newest_there = coll.all_gather(newest_there)[0]
        restored = self.store.load_latest()
        step = None
        if restored is not None and (newest_there is None or restored.step > newest_there):
            files: dict[str, bytes] = {}
            if self.store.rank != 0:
                got = self.store.load_rank(restored.step, 0)
                if got is None:
                    raise FolderError(f"rank 0's shard of step {restored.step}: "
                                      + "; ".join(self.store.last_skips))
                files.update(got[0]["files"])
            files.update(restored.state["files"])
            local = self.work / "resume" / (link_name % restored.step)
            write_folder(files, local)
            step = restored.step
            if self.store.rank == 0:
                _link(local, self.output_dir / (link_name % step))
        coll.all_gather(None)  # no rank looks for the folder before rank 0 linked it
        return step

    def close(self) -> None:
        self.store.close()


def _link(target: Path, at: Path) -> None:
    """`at` -> `target` (same absolute path on every node: each node's own copy); a dangling
    link of an earlier job there is replaced, anything else is left alone."""
    at.parent.mkdir(parents=True, exist_ok=True)
    if at.is_symlink() and not at.exists():
        at.unlink()
    try:
        os.symlink(target, at)
    except FileExistsError:
        logger.info("bv ckpt: %s exists: left as it is", at)
