"""What bv's start-up hook (`_boot/sitecustomize.py`) does in each training process.

- The per-rank Slurm names (`bluevela.runtime.world.rank_env`) into `os.environ`.
- Post-import hooks (a `sys.meta_path` finder that runs a function after a module's own code):
  when `transformers.trainer` is imported, every `Trainer` gets bv's callback (hf.py); when
  `torchtitan.trainer` is, its Trainer saves and stops at bv's signal (torchtitan.py); when
  `accelerate.accelerator` is, `load_state()` of the newest automatic checkpoint carries
  Accelerate's checkpoint counter on, so the next `save_state()` can write (accelerate.py); when
  Lightning is imported, the checkpoint handler for SIGUSR1 is installed at once (its callback
  comes through Lightning's entry point; the handler must be there before the Trainer is, as
  importing Lightning takes seconds). Nothing else is imported here: a process that never
  imports a framework pays a dict lookup per import.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

from bluevela.runtime.world import rank_env

logger = logging.getLogger(__name__)


def _install_usr1(_: ModuleType) -> None:
    from bluevela import runtime

    if threading.current_thread() is threading.main_thread():
        runtime.install_signal_handler(signal.SIGUSR1)


def _hf(module: ModuleType) -> None:
    from bluevela.integrations import hf

    hf.patch(module)


def _accelerate(module: ModuleType) -> None:
    from bluevela.integrations import accelerate

    accelerate.patch(module)


def _torchtitan(module: ModuleType) -> None:
    from bluevela.integrations import torchtitan

    torchtitan.patch(module)


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "transformers.trainer": _hf,
    "accelerate.accelerator": _accelerate,
    "torchtitan.trainer": _torchtitan,
    "lightning.pytorch": _install_usr1,
    "pytorch_lightning": _install_usr1,
}


def _run_hook(name: str, hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001 - never break the user's import
        sys.stderr.write(f"bv: integration for {name} off ({type(exc).__name__}: {exc})\n")


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hooks[name](module)` right after module `name` is first executed."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        hook = self.hooks.pop(fullname, None)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _run_hook(fullname, hook, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _destroy_process_group() -> None:
    """At a normal exit, end torch.distributed's default group if the script left it: torch
    asks for it, and a gloo group's threads torn down at interpreter exit instead sometimes end
    the rank in SIGABRT ('terminate called without an active exception') after its work is done
    (seen with the HF Trainer, which never destroys its group): a failed rank, not a finished
    one. Only gloo: its destroy is local, while NCCL's could wait on a peer."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001, S110 - exiting anyway: never turn exit 0 into a failure
        pass


def start() -> None:
    """In the rank, before the script. A module imported already (a warm parent's pre-import,
    launch/warm.py `BV_WARM_PREIMPORT`: the rank is forked after it) gets its hook now, before
    the script can use it; the others when they are imported."""
    os.environ.update(rank_env(os.environ))
    later = dict(HOOKS)
    for name in [n for n in later if n in sys.modules]:
        _run_hook(name, later.pop(name), sys.modules[name])
    sys.meta_path.insert(0, AfterImport(later))
    atexit.register(_destroy_process_group)
