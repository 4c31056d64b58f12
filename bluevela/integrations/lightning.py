"""Lightning: save at bv's checkpoint signal, at a step all ranks agree on, and stop.

Lightning's entry point groups ``lightning.pytorch.callbacks_factory`` and
``pytorch_lightning.callbacks_factory`` (pyproject.toml) call `callbacks()` /
`pl_callbacks()` in every `Trainer.__init__`; they return bv's callback only in a training
process bv launched (`bluevela.integrations.armed()`) with a known Lightning version.

At each training batch end every rank reduces its request flag (Lightning's own
``strategy.reduce_boolean_decision``: one all-reduce); when any rank was asked, every rank
saves Lightning's HPC checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``, what Lightning's
own SLURM requeue handler writes) and sets ``trainer.should_stop``. Lightning's own resume
loads the newest ``hpc_ckpt_*`` when ``fit()`` gets no ``ckpt_path`` under Slurm (bv's
training world keeps ``SLURM_NTASKS`` set, so Lightning detects Slurm), so the next attempt
starts at the step this one stopped at. Nothing here calls ``scontrol``: bv requeues.
"""

from __future__ import annotations

import logging
import re
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


def _callback_class(base: type) -> type:
    class BvCheckpoint(base):
        """bv's checkpoint signal -> HPC checkpoint at the agreed batch end, stop."""

        stopped_at: int | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            from bluevela import runtime

            runtime.install_signal_handler(signal.SIGUSR1)  # SIGTERM stays Lightning's

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
            trainer.save_checkpoint(path)
            self.stopped_at = int(trainer.global_step)
            trainer.should_stop = True
            if trainer.is_global_zero:
                sys.stderr.write(f"bv: checkpoint requested ({runtime.requested_by() or 'signal'}"
                                 f"): saved step {trainer.global_step} to {path}, stopping\n")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            from bluevela import runtime

            # Training is over, at bv's request or because it ended (a request that came
            # after the last batch): bv's supervisor learns which, and requeues only for the
            # first.
            runtime.finished()

    return BvCheckpoint


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
