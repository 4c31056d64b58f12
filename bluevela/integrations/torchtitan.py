"""torchtitan: save at bv's checkpoint signal, at a step all ranks agree on, and stop.

torchtitan has no signal code: it saves every ``checkpoint.interval`` steps (``step-<N>`` under
``<dump_folder>/<checkpoint.folder>``, torch.distributed.checkpoint) and, when that folder
holds a complete one, auto-resumes from the newest. bv adds the missing piece, only when
checkpointing is enabled (``checkpoint.enable``, and not ``load_only``):

- ``Trainer.__init__`` first installs bv's handler (SIGUSR1, and SIGTERM with its grace:
  bluevela.runtime), before torchtitan's own build (model, data: often minutes), so the
  node agent sees a handler early. With checkpointing off nothing is installed, and the job
  gets torchrun's SIGTERM stop instead (docs/byos.md).
- ``Trainer.should_continue_training`` (the trainer's own loop condition: called on every
  rank once before the first step and once after each step, right after that step's
  ``checkpointer.save``) first asks torchtitan's own condition; while training goes on, the
  ranks agree (one all-reduce of one number: any rank asked). When they do, the checkpointer
  saves the step just finished in its own format and place (its own ``save`` with the interval
  set to 1 for that call: full state, async mode and ``keep_latest_k`` as configured; not
  ``last_step=True``, which by default saves the model only and would not resume), waits for
  an async save to be on disk, and the condition returns False: ``train()`` ends as at its last
  step, the script (torchtitan's own ``train.py``) closes the trainer, destroys the process
  group and exits 0. bv requeues; torchtitan's own load at the next start finds the
  ``step-<N>``. A step the interval already saved is not saved twice; a request before the
  attempt's first step saves nothing (the folder already holds that step, or nothing was
  trained).

Why this hook: torchtitan has no callbacks or plugin entry point. The loop condition is the
one public method every torchtitan loop built on ``Trainer.train`` calls at the step boundary
on every rank (the torchft trainer's too), after the step's save, with the trainer (step,
checkpointer) at hand: one method wrapped, no copy of the loop, nothing patched inside the
checkpointer. A trainer subclass with its own loop condition (or its own loop that never
calls it) is not covered.

Injection: bv's start-up hook (boot.py) calls `patch()` when ``torchtitan.trainer`` is
imported (torchtitan's ``train.py`` imports it), in a training process bv launched only.
A version outside the tested range, or a Trainer or checkpointer without the attributes used
here, gets no integration and one warning.
"""

from __future__ import annotations

import functools
import logging
import sys
from types import ModuleType
from typing import Any

from bluevela import integrations

logger = logging.getLogger(__name__)
_PATCHED = "_bv_patched"
# What the integration uses of torchtitan's trainer and checkpoint manager (0.3.x).
TRAINER_API = ("__init__", "train", "should_continue_training")
CHECKPOINTER_API = ("enable", "interval", "folder", "save", "maybe_wait_for_saving")

def checkpointing(config: Any) -> bool:
    """Whether a torchtitan ``Trainer.Config`` saves checkpoints (``enable`` and not
    ``load_only``)."""
    ckpt = getattr(config, "checkpoint", None)
    return bool(getattr(ckpt, "enable", False)) and not getattr(ckpt, "load_only", False)


def _usable(checkpointer: Any) -> bool:
    if checkpointer is None or not getattr(checkpointer, "enable", False):
        return False
    if getattr(checkpointer, "load_only", False):
        return False
    missing = [name for name in CHECKPOINTER_API if not hasattr(checkpointer, name)]
    if missing:
        integrations.warn_once("torchtitan.checkpointer",
                               f"bv: torchtitan checkpointer {type(checkpointer).__name__} "
                               f"has no {', '.join(missing)}: no checkpoint at bv's signal "
                               "from it")
        return False
    return True


def _saved_by_loop(checkpointer: Any, step: int) -> bool:
    """Whether the loop's own ``save(step)`` just wrote `step` (its interval or first step)."""
    should = getattr(checkpointer, "_should_save", None)
    try:
        return bool(should(step, False)) if callable(should) else False
    except Exception:  # noqa: BLE001 - unknown: save again (a second save of a step is harmless)
        return False


def save_and_stop(trainer: Any) -> bool:
    """At the step boundary, on every rank: True (after saving the step just finished in
    torchtitan's format) when any rank got bv's checkpoint signal."""
    from bluevela import runtime
    from bluevela.integrations.agree import any_rank

    checkpointer: Any = getattr(trainer, "checkpointer", None)
    if not _usable(checkpointer):
        return False
    if getattr(trainer, "_bv_first_step", None) is None:
        trainer._bv_first_step = int(trainer.step)  # the step this attempt started at
    runtime.install_signal_handler()  # idempotent; __init__ normally did it already
    if not any_rank(runtime.checkpoint_requested()):
        return False
    runtime.stopping_for_checkpoint()  # bv requeues: this rank stopped for it
    step = int(trainer.step)
    if step == trainer._bv_first_step:
        what = "nothing trained in this attempt, nothing to save"  # resumes where it started
    elif _saved_by_loop(checkpointer, step):
        what = f"step {step} saved by its interval"
    else:
        interval = checkpointer.interval
        checkpointer.interval = 1  # torchtitan's own full save of this step, as configured
        try:
            checkpointer.save(step)
        finally:
            checkpointer.interval = interval
        what = f"saved step {step}"
    checkpointer.maybe_wait_for_saving()  # an async save must be on disk before exit 0
    trainer._bv_stopped_at = step
    if _rank() == 0:
        sys.stderr.write(f"bv: checkpoint requested ({runtime.requested_by() or 'on another rank'}): "
                         f"{what} in {checkpointer.folder}, stopping\n")
    return True


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001, S110 - only picks who prints
        pass
    return 0


def patch(module: ModuleType) -> bool:
    """Wrap `module.Trainer` (``torchtitan.trainer``); False (and one warning) for a torchtitan
    version or Trainer this integration does not know."""
    import torchtitan

    version = str(getattr(torchtitan, "__version__", "0.0.0+unknown"))
    if not integrations.supported("torchtitan", version):
        return False
    trainer_cls = getattr(module, "Trainer", None)
    missing = [name for name in TRAINER_API if not hasattr(trainer_cls, name)]
    if trainer_cls is None or missing:
        integrations.warn_once("torchtitan.trainer",
                               f"bv: torchtitan {version} Trainer has no "
                               f"{', '.join(missing)}: no checkpoint at bv's signal from it")
        return False
    if getattr(trainer_cls, _PATCHED, False):
        return True
    original_init = trainer_cls.__init__
    original_continue = trainer_cls.should_continue_training

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("config", args[0] if args else None)
        if checkpointing(config):
            from bluevela import runtime

            runtime.install_signal_handler()  # SIGUSR1 and SIGTERM (with its grace)
        original_init(self, *args, **kwargs)

    @functools.wraps(original_continue)
    def should_continue_training(self: Any) -> bool:
        if not original_continue(self):
            return False  # torchtitan's own end (its last step saves as configured)
        if getattr(self, "_bv_stopped_at", None) is not None:
            return False
        return not save_and_stop(self)

    trainer_cls.__init__ = __init__
    trainer_cls.should_continue_training = should_continue_training
    setattr(trainer_cls, _PATCHED, True)
    return True
