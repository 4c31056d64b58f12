"""A framework's checkpoint folder published whole, or not at all.

HF's Trainer and Accelerate write a checkpoint folder in place, file after file, and their
resume takes the highest-numbered folder whatever it holds: a save cut short (a rank lost
mid-save, the step's abort killing a rank still writing, a full disk) became the newest, and the
resume then failed on every attempt (HF: no trainer_state.json; Accelerate: fewer custom
states than registered objects). The integrations have the
framework write into a staging folder instead (a name its resume never matches); once every
rank wrote its part (one barrier: a lost peer raises there), the saving process flushes the
files and renames the folder into place. What a save cut short left in the staging folder is
cleared at the next save.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bluevela.util.fs import fsync_dir

STAGING = ".bv-saving"  # beside the checkpoints: where a save is written before it is published
T = TypeVar("T")


def barrier() -> None:
    """Every rank wrote its part (a lost peer raises here: nothing is published)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def fsync_tree(folder: str) -> None:
    """The saved files and their folders on disk before the rename makes them the newest
    (regular files only: nothing is followed)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


def publish(staged: str, target: str) -> None:
    """Rename the complete `staged` folder to `target`; a `target` already there (the same
    step saved again) is replaced, never mixed with. No `staged` folder: another node's saving
    process published it (one shared file system, a save on each node)."""
    if not os.path.isdir(staged):
        return
    fsync_tree(staged)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    old = None
    if os.path.lexists(target):
        old = f"{staged}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(staged, target)
    fsync_dir(Path(target).parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clear(stage: str) -> None:
    """Empty the staging folder: what a save cut short left (any step)."""
    try:
        names = os.listdir(stage)
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(stage, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def done(stage: str) -> None:
    """The staging folder removed once empty (another node's save may still use it)."""
    with contextlib.suppress(OSError):
        os.rmdir(stage)


def staged_save(stage: str, saver: bool, write: Callable[[], T], made: str,
                target: str) -> T:
    """The framework's save, `write()`, pointed at `stage` by the caller: the staging folder
    cleared first (by the saving process, before any rank writes), every rank's part written
    (the second barrier), then the saving process publishes ``stage/made`` as `target` and
    empties the staging folder. A rank lost on the way raises in a barrier: nothing is
    published."""
    if saver:
        clear(stage)
        os.makedirs(stage, exist_ok=True)
    barrier()
    result = write()
    barrier()
    if saver:
        publish(os.path.join(stage, made), target)
        clear(stage)
        done(stage)
    return result
