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

The node-local checkpoint tier (docs/checkpoints.md, "Frameworks"), when the site turns it on
for this node: every Trainer also opens a checkpoint store (`bluevela.ckpt.folder`, a
collective, once torch.distributed is set up) and first links the newest step complete
somewhere at ``<output_dir>/checkpoint-N`` (unless HF's own folder of that step or a newer one
is there), so ``get_last_checkpoint(output_dir)`` and ``resume_from_checkpoint=True`` find it.
The store opens when the script's ``TrainingArguments`` are made (HF sets up torch.distributed
in them, every rank makes them, and HF's example scripts call ``get_last_checkpoint`` right
after, before any Trainer exists); the first Trainer with those arguments' ``output_dir`` takes
that store. A ``TrainingArguments`` made on some ranks only would wait in that collective: HF's
Trainer needs them on every rank anyway. Each save (`Trainer._save_checkpoint`, HF's one save
path: periodic saves and bv's) is written to this node's tier instead of ``output_dir`` and
handed to the store (partner copy, drain every `checkpoint.drain_every`-th save, at bv's
signal and when `train()` returns). Not for hyper-parameter search runs (a trial's own
directory) nor with ``load_best_model_at_end`` (HF keeps the best checkpoint's path): those
keep HF's own saves.

Published whole, or not at all (without the tier): HF writes ``checkpoint-N`` in place, file
after file, and ``get_last_checkpoint`` takes the highest such folder whatever it holds. A save
cut short (a peer lost mid-save, the step's abort killing a rank that was still writing, a
full disk) left a folder HF's resume then took: without ``trainer_state.json`` (written last)
or with a truncated ``optimizer.pt`` the resume failed on every attempt (FileNotFoundError
on trainer_state.json, reproduced on transformers 5.24). Each save is written in ``<output_dir>/.bv-saving/checkpoint-N`` (a name HF's resume
never matches), then every rank meets in one barrier (all of them wrote their part), and the
saving process (HF's ``should_save``: process 0, or each node's first with
``save_on_each_node``) flushes the files and renames the folder into place. A rank that died
before the barrier leaves only the staging folder, removed at the next save; the resume finds
the previous complete checkpoint. HF's rotation (``save_total_limit``) then runs on
``output_dir``. Not for hyper-parameter trials, ``load_best_model_at_end`` or
``metric_for_best_model`` (HF keeps the best checkpoint's path) nor ``push_to_hub`` (it pushes
the folder it saved): those keep HF's own in-place saves.
"""

from __future__ import annotations

import functools
import logging
import os
import re
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
    from bluevela.ckpt.folder import tier_on

    tier = tier_on()

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not any(type(cb).__name__ == callback_cls.__name__
                   for cb in self.callback_handler.callbacks):
            self.add_callback(callback_cls())
        if tier and not getattr(self.args, "load_best_model_at_end", False):
            _open_store(self)

    trainer_cls.__init__ = __init__
    _patch_saves(trainer_cls, tier)
    if tier:
        _patch_arguments(transformers.TrainingArguments)
    setattr(trainer_cls, _PATCHED, True)
    return True


# output_dir (as given) -> the FolderStore its arguments opened, None once a Trainer took it or
# when it could not open (each later Trainer then opens its own, as without this).
_EARLY: dict[str, Any] = {}


def _patch_arguments(args_cls: Any) -> None:
    """Every ``TrainingArguments`` opens the store of its ``output_dir`` once made (see the
    module's doc), so the checkpoint is linked before the script looks for it."""
    if getattr(args_cls, _PATCHED, False):
        return
    post_init = args_cls.__post_init__

    @functools.wraps(post_init)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        post_init(self, *args, **kwargs)
        out = getattr(self, "output_dir", None)
        if (out and not getattr(self, "load_best_model_at_end", False)
                and str(out) not in _EARLY):
            _EARLY[str(out)] = _restore(self, str(out))

    args_cls.__post_init__ = __post_init__
    setattr(args_cls, _PATCHED, True)


_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # HF's PREFIX_CHECKPOINT_DIR-<global_step>


def newest(output_dir: str) -> int | None:
    """The highest step of a ``checkpoint-<step>`` folder in `output_dir`, or None."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return None
    return max((int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))
                and os.path.isdir(os.path.join(output_dir, n))), default=None)


def _open_store(trainer: Any) -> None:
    """The Trainer's checkpoint store: the one its arguments opened, else one opened now."""
    out = str(trainer.args.output_dir)
    fs = _EARLY.get(out)
    if fs is not None:
        _EARLY[out] = None  # taken: arguments made again (a copy of them) open no other
    else:
        fs = _restore(trainer.args, out)
    if fs is not None:
        trainer._bv_folder = fs


def _restore(args: Any, output_dir: str) -> Any:
    """A store for `output_dir`, and the newest step complete somewhere linked where HF's
    resume looks (a collective). None, and one line, when it cannot open: HF's own saves."""
    from bluevela.ckpt.folder import FolderStore

    try:
        _ = args.device  # HF sets up torch.distributed here: the store's collective
        fs = FolderStore(output_dir, "hf")
        step = fs.restore("checkpoint-%d", newest(output_dir))
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"bv: no node-local checkpoint store for the Trainer ({exc}): HF's "
                         "own saves\n")
        return None
    if step is not None and fs.store.rank == 0:
        sys.stderr.write(f"bv: checkpoint-{step} from the checkpoint store, linked in "
                         f"{output_dir} (this node's copy)\n")
    return fs


def _staged(trainer: Any, trial: Any) -> bool:
    """Whether this save goes through the staging folder (see the module's doc)."""
    args = trainer.args
    return (trial is None and getattr(trainer, "hp_search_backend", None) is None
            and not getattr(args, "load_best_model_at_end", False)
            and not getattr(args, "metric_for_best_model", None)
            and not getattr(args, "push_to_hub", False))


def _save_into(folder: str, save: Any, self: Any, model: Any, trial: Any, *args: Any,
               **kwargs: Any) -> Any:
    """HF's own save, its ``checkpoint-N`` written under `folder` instead of the output
    directory (this save only)."""
    self._get_output_dir = lambda trial=None: folder
    try:
        return save(self, model, trial, *args, **kwargs)
    finally:
        del self._get_output_dir


def _save_published(save: Any, self: Any, model: Any, trial: Any, *args: Any,
                    **kwargs: Any) -> Any:
    """HF's save into the staging folder, then published by the saving process once every
    rank is done (the module's doc)."""
    from transformers.trainer_utils import rotate_checkpoints

    from bluevela.integrations import publish

    run_dir = self._get_output_dir(trial=trial)
    stage = os.path.join(run_dir, publish.STAGING)
    name = f"checkpoint-{self.state.global_step}"

    result = publish.staged_save(
        stage, self.args.should_save,
        lambda: _save_into(stage, save, self, model, trial, *args, **kwargs),
        name, os.path.join(run_dir, name))
    if self.args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint,
                           use_mtime=True)
    return result


def _patch_saves(trainer_cls: Any, tier: bool) -> None:
    """`Trainer._save_checkpoint` (HF's one save path: periodic saves and bv's) to the node's
    tier when the store is open, else published whole; `train` finalizes the store."""
    save, train = trainer_cls._save_checkpoint, trainer_cls.train

    @functools.wraps(save)
    def _save_checkpoint(self: Any, model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        fs = getattr(self, "_bv_folder", None)
        if fs is None or trial is not None:
            if _staged(self, trial):
                return _save_published(save, self, model, trial, *args, **kwargs)
            return save(self, model, trial, *args, **kwargs)
        work = fs.save_dir()
        folder = work / f"checkpoint-{self.state.global_step}"
        folder.mkdir()
        result = _save_into(str(work), save, self, model, trial, *args, **kwargs)
        fs.save(int(self.state.global_step), folder)
        return result

    @functools.wraps(train)
    def train_(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = train(self, *args, **kwargs)
        fs = getattr(self, "_bv_folder", None)
        if fs is not None:
            self._bv_folder = None  # later saves are HF's own: the store is closed
            fs.store.finalize()  # drain the newest, wait for the copies
        return result

    trainer_cls._save_checkpoint = _save_checkpoint
    if tier:
        trainer_cls.train = train_
