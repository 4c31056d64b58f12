"""Hugging Face Trainer: save at bv's checkpoint signal, at a step all ranks agree on, and stop.

`BvCheckpointCallback.on_step_end` (every rank, every optimizer step): one all-reduce of the
local request flag; when any rank was asked, ``control.should_save`` and
``control.should_training_stop``: the Trainer then saves its own ``checkpoint-<global_step>``
in ``output_dir`` (model, optimizer, scheduler, RNG, trainer state) and `train()` returns. The
script goes on as after a normal end and exits 0; bv requeues the job.

Resume: the Trainer resumes only when the script passes ``resume_from_checkpoint`` (HF's own
examples pass ``get_last_checkpoint(output_dir)``); bv does not change what the script asks for.
docs/byos.md says so.

Injection (no line of the user's code): Transformers has no plugin entry point, so bv's
start-up hook (boot.py) calls `patch()` when `transformers.trainer` is imported: every
`Trainer.__init__` ends by adding the callback.
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


def _callback_class(base: type) -> type:
    class BvCheckpointCallback(base):
        """bv's checkpoint signal -> save at the agreed step, stop training."""

        stopped_at: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            from bluevela import runtime

            runtime.install_signal_handler()  # SIGUSR1 and SIGTERM (with its grace)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            from bluevela import runtime
            from bluevela.integrations.agree import any_rank

            if any_rank(runtime.checkpoint_requested(), args.device):
                runtime.stopping_for_checkpoint()  # bv requeues: this rank stopped for it
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = int(state.global_step)
                if state.is_world_process_zero:
                    sys.stderr.write(f"bv: checkpoint requested ({runtime.requested_by() or 'signal'}"
                                     f"): saving step {state.global_step} in {args.output_dir} "
                                     "and stopping\n")
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            from bluevela import runtime

            # At bv's request or because training ended (a request after the last step):
            # bv's supervisor learns which, and requeues only for the first.
            runtime.finished()

    return BvCheckpointCallback


def patch(module: ModuleType) -> bool:
    """Make every `module.Trainer` add bv's callback; False (and one warning) when the installed
    transformers is not a known version."""
    import transformers

    if not integrations.supported("transformers", transformers.__version__):
        return False
    trainer_cls = module.Trainer
    if getattr(trainer_cls, _PATCHED, False):
        return True
    callback_cls = _callback_class(transformers.TrainerCallback)
    original = trainer_cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not any(type(cb).__name__ == callback_cls.__name__
                   for cb in self.callback_handler.callbacks):
            self.add_callback(callback_cls())

    trainer_cls.__init__ = __init__
    setattr(trainer_cls, _PATCHED, True)
    return True
