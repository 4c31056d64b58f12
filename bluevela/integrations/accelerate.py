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
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    numbers = [int(m.group(1)) for name in names if (m := _AUTOMATIC.match(name))]
    return max(numbers, default=None)


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
    setattr(cls, _PATCHED, True)
    return True
