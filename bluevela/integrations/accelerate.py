"""Accelerate: the next `save_state()` after a `load_state()` of the newest automatic checkpoint.

Accelerate has no signal code: the script's one line (docs/byos.md) turns bv's request into
Accelerate's own trigger, and the script saves with its own `save_state()`. With Accelerate's
automatic naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``), `save_state()`
writes ``<project_dir>/checkpoints/checkpoint_<iteration>`` and `load_state()` without a folder
loads the highest-numbered one, as documented; but `load_state()` leaves the counter
(``project_configuration.iteration``) at 0 in the new process, so the resumed script's next
`save_state()` aims at ``checkpoint_0``, which exists, and raises ValueError ("already
exists. Please manually override `self.save_iteration`"): at the second interruption the
ranks fail instead of saving, and everything since the first one is lost (accelerate 1.15.0;
huggingface/accelerate issues 1601 and 3306).

So bv's start-up hook (boot.py) calls `patch()` when `accelerate.accelerator` is imported:
after a `load_state()` with no folder under automatic naming, the counter becomes the loaded
number + 1 (never lowered: a script that set it itself, or an Accelerate that does it, keeps
its own). A `load_state(folder)` the script names is its own choice, untouched.

The node-local checkpoint tier (docs/checkpoints.md, "Frameworks"), when the site turns it on
for this node and the script uses automatic naming: every `Accelerator` also opens a
checkpoint store (`bluevela.ckpt.folder`, a collective, at the end of `__init__`) and links
the newest save complete somewhere at ``<project_dir>/checkpoints/checkpoint_<n>`` (unless
Accelerate's own folder of that number or a newer one is there), where the script's
`load_state()` finds it; each automatic `save_state()` is written to this node's tier instead
of ``project_dir`` and handed to the store (partner copy, drain every
`checkpoint.drain_every`-th save and at bv's signal; at the process's exit the copies are
waited for). A `save_state(folder)` the script names is Accelerate's own, untouched.

Published whole, or not at all (without the tier, automatic naming): `save_state()` writes
``checkpoint_<n>`` in place and `load_state()` takes the highest number whatever the folder
holds, so a save cut short (a rank lost mid-save, a full disk) failed every later resume.
Each automatic save is written under ``<project_dir>/.bv-saving/`` and renamed into
``checkpoints/`` once every rank wrote its part (publish.py); Accelerate's ``total_limit``
then applies to ``checkpoints/`` as before.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from types import ModuleType
from typing import Any

from bluevela import integrations

logger = logging.getLogger(__name__)
_PATCHED = "_bv_patched"
_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")  # what save_state() names its folders


def newest(folder: str) -> int | None:
    """The highest ``checkpoint_<n>`` number in `folder` (Accelerate's automatic names), or
    None."""
    return max(checkpoint_numbers(folder), default=None)


def patch(module: ModuleType) -> bool:
    """Make `module.Accelerator.load_state` carry the automatic checkpoint counter on; False
    (and one warning) when the installed accelerate is not a known version."""
    import accelerate

    if not integrations.supported("accelerate", accelerate.__version__):
        return False
    cls = module.Accelerator
    if getattr(cls, _PATCHED, False):
        return True
    original = cls.load_state

    @functools.wraps(original)
    def load_state(self: Any, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, input_dir, *args, **kwargs)
        config = self.project_configuration
        if input_dir is None and config.automatic_checkpoint_naming:
            loaded = newest(os.path.join(self.project_dir, "checkpoints"))
            if loaded is not None and config.iteration <= loaded:
                config.iteration = loaded + 1
        return result

    cls.load_state = load_state
    from bluevela.ckpt.folder import tier_on

    _patch_saves(cls, tier_on())
    setattr(cls, _PATCHED, True)
    return True


def _save_published(save: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """An automatic `save_state()` into the staging folder, published by the saving process
    once every rank is done (publish.py)."""
    import shutil

    from bluevela.integrations import publish

    config = self.project_configuration
    project = config.project_dir
    stage = os.path.join(project, publish.STAGING)
    n = self.save_iteration
    name = f"checkpoint_{n}"
    final = os.path.join(project, "checkpoints")
    if os.path.exists(os.path.join(final, name)):  # Accelerate's own refusal, unchanged
        raise ValueError(f"Checkpoint directory {os.path.join(final, name)} "
                         f"({n}) already exists. Please manually override "
                         "`self.save_iteration` with what iteration to start with.")
    saver = self.is_main_process or (config.save_on_each_node and self.is_local_main_process)

    def write() -> Any:
        config.project_dir = stage  # this save only
        try:
            return save(self, None, *args, **kwargs)
        finally:
            config.project_dir = project

    result = publish.staged_save(stage, saver, write, os.path.join("checkpoints", name),
                                 os.path.join(final, name))
    if saver and config.total_limit is not None:
        for old in to_rotate(checkpoint_numbers(final), n, config.total_limit):
            shutil.rmtree(os.path.join(final, f"checkpoint_{old}"), ignore_errors=True)
    return os.path.join(final, name) if isinstance(result, str) else result


def to_rotate(numbers: list[int], saved: int, total_limit: int) -> list[int]:
    """The older checkpoints Accelerate's `total_limit` removes once `saved` is published: as
    its own `save_state()` counts before a save, ``len(older) + 1 - total_limit`` of them, the
    lowest numbers first (the new one is always kept)."""
    older = sorted(n for n in numbers if n != saved)
    return older[:max(0, len(older) + 1 - total_limit)]


def checkpoint_numbers(folder: str) -> list[int]:
    """Every ``checkpoint_<n>`` number in `folder`."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [int(m.group(1)) for name in names if (m := _AUTOMATIC.match(name))]


def _open_store(acc: Any) -> None:
    """The Accelerator's checkpoint store, and the newest save complete somewhere linked where
    `load_state()` looks. A store that cannot open leaves Accelerate's own saves (one line)."""
    import atexit

    from bluevela.ckpt.folder import FolderStore

    try:
        fs = FolderStore(acc.project_dir, "accelerate")
        n = fs.restore("checkpoints/checkpoint_%d",
                       newest(os.path.join(acc.project_dir, "checkpoints")))
    except (OSError, ValueError) as exc:
        import sys

        sys.stderr.write(f"bv: no node-local checkpoint store for Accelerate ({exc}): its "
                         "own saves\n")
        return
    acc._bv_folder = fs
    atexit.register(fs.close)  # the background copies end before the process does
    if n is not None and fs.store.rank == 0:
        logger.warning("bv: checkpoint_%d from the checkpoint store, linked in %s/checkpoints "
                       "(this node's copy)", n, acc.project_dir)


def _patch_saves(cls: Any, tier: bool) -> None:
    """Automatic saves to the node's tier when the store is open, else published whole."""
    init, save = cls.__init__, cls.save_state

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        config = self.project_configuration
        if config.automatic_checkpoint_naming and config.project_dir:
            _open_store(self)

    @functools.wraps(save)
    def save_state(self: Any, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        fs = getattr(self, "_bv_folder", None)
        config = self.project_configuration
        if not config.automatic_checkpoint_naming or not config.project_dir:
            return save(self, output_dir, *args, **kwargs)
        if fs is None:
            return _save_published(save, self, *args, **kwargs)
        n = self.save_iteration
        work = fs.save_dir()
        project = config.project_dir
        config.project_dir = str(work)  # this save only, this node
        try:
            result = save(self, output_dir, *args, **kwargs)
        finally:
            config.project_dir = project
        fs.save(n, work / "checkpoints" / f"checkpoint_{n}")
        return result

    if tier:
        cls.__init__ = __init__
    cls.save_state = save_state
