"""Lightning: save at bv's checkpoint signal, at a step all ranks agree on, and stop.

Lightning's entry point groups ``lightning.pytorch.callbacks_factory`` and
``pytorch_lightning.callbacks_factory`` (pyproject.toml) call `callbacks()` /
`pl_callbacks()` in every `Trainer.__init__`; they return bv's callback only in a training
process bv launched (`bluevela.integrations.armed()`) with a known Lightning version.

At each training batch end every rank reduces its request flag (Lightning's own
``strategy.reduce_boolean_decision``: one all-reduce); when any rank was asked, every rank
saves Lightning's HPC checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``, what Lightning's
own SLURM requeue handler writes) and sets ``trainer.should_stop``. Nothing here calls
``scontrol``: bv requeues.

The next attempt must start at that step whichever resume the script chose:
- ``fit()`` without ``ckpt_path`` under Slurm (bv's training world keeps ``SLURM_NTASKS`` set,
  so Lightning detects Slurm): Lightning loads the newest ``hpc_ckpt_*``, the one above.
- ``fit(ckpt_path="last")`` (Lightning's documented resume): Lightning 2.x loads the newest by
  modification time of each ModelCheckpoint's ``last*.ckpt`` in its ``dirpath`` (and of
  OnExceptionCheckpoint's file); it never looks at ``hpc_ckpt_*``. So for every ModelCheckpoint
  with ``save_last`` rank 0 points its last checkpoint (``last.ckpt``, or the name it already
  uses in this run) at the HPC file (`point_last`): a symbolic link, as Lightning's own
  ``save_last="link"`` makes, so the state is written once (a copy where no link can be made,
  a second save where ``dirpath`` is remote). The callback's ``last_model_path`` is set to that
  name before the save, so the resumed ModelCheckpoint goes on writing the same file.
- An explicit ``ckpt_path=<dirpath>/last.ckpt``: the same link.
A ModelCheckpoint without ``save_last`` gets no ``last.ckpt`` from bv: its configuration says
there is none, and Lightning's "last" finds none (it warns and starts over), as without bv.

The node-local checkpoint tier (docs/checkpoints.md, "Frameworks"), when the site turns it on
for this node: the callback's `setup` (every rank, after Lightning set up torch.distributed,
before it restores a checkpoint) gives the strategy `StoreCheckpointIO` over a store draining
to ``<default_root_dir>/bv-ckpt`` (bluevela/ckpt/lightning.py), unless the script chose a
CheckpointIO of its own: every save (ModelCheckpoint's, bv's HPC one) then stalls only for
staging, and every resume reads the newest verified copy from the fastest place.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from bluevela import integrations

logger = logging.getLogger(__name__)
_HPC = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")


def hpc_save_path(folder: str) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in `folder` (as Lightning numbers them: newest + 1)."""
    try:
        numbers = [int(m.group(1)) for p in Path(folder).iterdir() if (m := _HPC.match(p.name))]
    except OSError:
        numbers = []
    return str(Path(folder) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


def _remote(path: str) -> bool:
    """A URL (fsspec's ``s3://``, ``file://``): no symbolic link there."""
    return "://" in path


def last_paths(trainer: Any) -> list[str]:
    """Where ``fit(ckpt_path="last")`` looks: per ModelCheckpoint with ``save_last``, the last
    checkpoint it wrote in this run, else ``<dirpath>/last.ckpt`` (its own name for it). Sets
    each callback's ``last_model_path`` to it: that is part of the state about to be saved, and
    the resumed callback then writes its next last checkpoint there, not to ``last-v1.ckpt``."""
    # The ModelCheckpoint of each Lightning package the script imported (never an import here:
    # the other package would take seconds in the signal's window).
    kinds = tuple(module.ModelCheckpoint for name in ("lightning.pytorch.callbacks",
                                                      "pytorch_lightning.callbacks")
                  if (module := sys.modules.get(name)) is not None)
    out: list[str] = []
    for cb in trainer.callbacks:
        if not isinstance(cb, kinds) or not cb.save_last or not cb.dirpath:
            continue
        dirpath = str(cb.dirpath)
        last = str(cb.last_model_path or "")
        if not last or os.path.dirname(os.path.normpath(last)) != os.path.normpath(dirpath):
            import torch

            metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                       "step": torch.tensor(trainer.global_step)}
            last = cb.format_checkpoint_name(metrics, cb.CHECKPOINT_NAME_LAST)
        cb.last_model_path = last
        if last not in out:
            out.append(last)
    return out


def mark_saved(trainer: Any, path: str) -> None:
    """Tell each ModelCheckpoint with ``save_last`` that this run saved `path`: Lightning
    2.6's ``on_train_end`` writes ``last.ckpt`` once more when the callback saved nothing
    itself in the run (an attempt stopped before its first ``every_n_train_steps``), a second
    full write of the same step in the signal's window; and ``save_last="link"`` links to
    this file. Only where the attribute exists (a private one, of the versions that do so)."""
    for cb in trainer.callbacks:
        if getattr(cb, "save_last", None) and hasattr(cb, "_last_checkpoint_saved"):
            cb._last_checkpoint_saved = path


def point_last(target: str, last: str) -> None:
    """Make `last` name the checkpoint at `target`, replacing what `last` was in one rename (a
    stop at any moment leaves the old or the new, never neither): a relative symbolic link, or
    where the filesystem makes none, a copy."""
    folder = os.path.dirname(last) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(last)}.bv-{os.getpid()}")
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp)  # a stopped earlier try's
    elif os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.symlink(os.path.relpath(target, folder), tmp)
    except OSError:
        if os.path.isdir(target):
            shutil.copytree(target, tmp, symlinks=True)
        else:
            shutil.copyfile(target, tmp)
    if os.path.isdir(last) and not os.path.islink(last):
        shutil.rmtree(last)  # a sharded strategy's folder: no rename replaces one
    os.replace(tmp, last)


def _callback_class(base: type) -> type:
    class BvCheckpoint(base):
        """bv's checkpoint signal -> HPC checkpoint at the agreed batch end, stop."""

        stopped_at: int | None = None
        store_io: Any = None  # the StoreCheckpointIO given to the strategy, once

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            from bluevela import runtime

            runtime.install_signal_handler(signal.SIGUSR1)  # SIGTERM stays Lightning's
            if self.store_io is None:
                self.store_io = use_store(trainer)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            from bluevela import runtime

            if self.stopped_at is not None:
                return
            local = runtime.checkpoint_requested()
            if not trainer.strategy.reduce_boolean_decision(local, all=False):
                return
            runtime.stopping_for_checkpoint()  # bv requeues: this rank stopped for it
            path = hpc_save_path(str(trainer.default_root_dir))
            path = trainer.strategy.broadcast(path)  # rank 0's name on every rank
            lasts = last_paths(trainer)
            trainer.save_checkpoint(path)
            mark_saved(trainer, path)
            for last in lasts:
                if _remote(path) or _remote(last):
                    trainer.save_checkpoint(last)  # every rank: a save may be collective
                elif trainer.is_global_zero:
                    try:
                        point_last(path, last)
                    except OSError as exc:  # the HPC checkpoint stands: stop as asked
                        sys.stderr.write(f"bv: could not point {last} at {path} ({exc}): "
                                         "fit(ckpt_path=\"last\") would resume from an older "
                                         "checkpoint\n")
            if lasts:
                trainer.strategy.barrier("bv.last")  # every rank returns once the link is made
            self.stopped_at = int(trainer.global_step)
            trainer.should_stop = True
            if trainer.is_global_zero:
                also = "".join(f", {last}" for last in lasts)
                sys.stderr.write(f"bv: checkpoint requested ({runtime.requested_by() or 'signal'}"
                                 f"): saved step {trainer.global_step} to {path}{also}, "
                                 "stopping\n")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            from bluevela import runtime

            # Training is over, at bv's request or because it ended (a request that came
            # after the last batch): bv's supervisor learns which, and requeues only for the
            # first.
            runtime.finished()
            if self.store_io is not None:  # the newest save drained, the copies waited for
                self.store_io.store.finalize()

    return BvCheckpoint


def use_store(trainer: Any) -> Any:
    """With the node-local tier on, `StoreCheckpointIO` for the strategy (a collective: every
    rank's `setup`), unless its CheckpointIO is one the script chose; returns it, else None.
    A store that cannot open leaves Lightning's own (one line)."""
    from bluevela.ckpt.folder import SHARED_SUBDIR, tier_on

    strategy = trainer.strategy
    current = getattr(strategy, "_checkpoint_io", None)
    if current is not None and type(current).__name__ != "TorchCheckpointIO":
        return None  # the script's own plugin
    if not tier_on():
        return None
    from bluevela.ckpt.lightning import StoreCheckpointIO
    from bluevela.ckpt.store import open_store

    try:
        store = open_store(Path(trainer.default_root_dir) / SHARED_SUBDIR, "lightning")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"bv: no node-local checkpoint store for Lightning ({exc}): its own "
                         "CheckpointIO\n")
        return None
    io = StoreCheckpointIO(store)
    strategy.checkpoint_io = io
    return io


def _make(package: str) -> list[Any]:
    if not integrations.armed():
        return []
    base: type
    if package == "lightning":
        import lightning
        from lightning.pytorch.callbacks import Callback

        version, base = lightning.__version__, Callback
    else:
        import pytorch_lightning
        from pytorch_lightning.callbacks import Callback as PLCallback

        version, base = pytorch_lightning.__version__, PLCallback
    if not integrations.supported(package, version):
        return []
    return [_callback_class(base)()]


def callbacks() -> list[Any]:
    """Entry point ``lightning.pytorch.callbacks_factory``."""
    return _make("lightning")


def pl_callbacks() -> list[Any]:
    """Entry point ``pytorch_lightning.callbacks_factory``."""
    return _make("pytorch_lightning")
