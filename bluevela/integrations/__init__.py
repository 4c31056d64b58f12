"""bv's integrations with the training frameworks: no line of the user's code.

Armed only in the training processes of a `bv submit` job (the node agent sets
``BV_INTEGRATIONS=1`` and puts bv's start-up hook on torchrun's PYTHONPATH:
bluevela/runtime/world.py, bluevela/integrations/boot.py):

- Lightning (`lightning.py`): a callback through Lightning's own entry point group
  (``lightning.pytorch.callbacks_factory``, ``pytorch_lightning.callbacks_factory``).
- Hugging Face Trainer (`hf.py`): a `TrainerCallback` added to every Trainer (Transformers has
  no plugin entry point: the start-up hook wraps `Trainer.__init__` when `transformers.trainer`
  is imported).
- torchtitan (`torchtitan.py`): the start-up hook wraps the Trainer's `__init__` and its loop
  condition `should_continue_training` when `torchtitan.trainer` is imported (no plugin entry
  point either); only when checkpointing is enabled.
- Accelerate: one documented line in the loop (docs/byos.md); the start-up hook wraps
  `Accelerator.load_state` when `accelerate.accelerator` is imported (`accelerate.py`: the
  automatic checkpoint counter after a resume).

Each one: bv's checkpoint signal (SIGUSR1 from the node agent) sets bluevela.runtime's flag; at
the next step boundary the ranks agree (one all-reduce of one number: any rank asked), save in
the framework's own format where its own resume finds it, stop, and exit 0; bv requeues.

A framework version outside the tested range gets no integration and one warning
(`supported()`). Tested: see TESTED.
"""

from __future__ import annotations

import logging
import os
import warnings

logger = logging.getLogger(__name__)

# Tested versions (docs/byos.md); the ranges they stand for: same major version, not older.
TESTED = {"lightning": "2.6.6", "pytorch_lightning": "2.6.6", "transformers": "5.24.0",
          "accelerate": "1.15.0", "torchtitan": "0.3.0"}
# torchtitan is 0.x and reshapes its trainer between minor releases: its minor version only.
RANGES = {"lightning": ((2, 0), (3, 0)), "pytorch_lightning": ((2, 0), (3, 0)),
          "transformers": ((4, 40), (6, 0)), "accelerate": ((0, 30), (2, 0)),
          "torchtitan": ((0, 3), (0, 4))}
_warned: set[str] = set()


def armed() -> bool:
    """Whether this process is a training process bv launched (and integrations are on)."""
    return os.environ.get("BV_INTEGRATIONS") == "1" and "LOCAL_RANK" in os.environ


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "0")
    except (IndexError, ValueError):
        return None


def supported(framework: str, version: str) -> bool:
    """True for a version in the tested range; else one warning per framework and False."""
    low, high = RANGES[framework]
    got = _major_minor(version)
    if got is not None and low <= got < high:
        return True
    warn_once(framework, f"bv: {framework} {version} is not a version bv's integration knows "
              f"(tested {TESTED[framework]}, range {low[0]}.{low[1]} to before "
              f"{high[0]}.{high[1]}): no checkpoint at bv's signal from it; the job gets "
              "torchrun's SIGTERM stop instead")
    return False


def warn_once(key: str, message: str) -> None:
    """One warning per `key` per process (a framework, or an integration's own part), shown
    at the caller of the function that asks."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)
