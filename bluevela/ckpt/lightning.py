"""Lightning's `CheckpointIO` over the checkpoint store: a Lightning script takes the
node-local tier, the partner copy and the drain with one plugin,

    store = runtime.checkpoint_store("/shared/ckpt/run1")
    trainer = L.Trainer(..., plugins=[StoreCheckpointIO(store)])
    trainer.fit(model, ckpt_path="last")   # or the path of any checkpoint it saved

Lightning saves on global rank 0 only: that rank's shard of the step (at `global_step`) is the
checkpoint, and every rank resumes from it (`load_latest(source_rank=0)`), from its fastest
verified place. Where Lightning expects the file, a small JSON stub names the store and the
step (ModelCheckpoint's top-k, `last`, and `ckpt_path` keep working on paths); removing a
checkpoint removes the stub (the store's keep-N prunes the shards). A checkpoint holding a value
the store does not save (an arbitrary object in `hyper_parameters`) fails with its path
(`StageError`): save such values yourself, or keep Lightning's own CheckpointIO. Imports
Lightning: load it only in a training process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from bluevela.ckpt.store import CheckpointStore
from bluevela.util.fs import atomic_write, read_no_follow

STUB = "bv-ckpt-stub"


class StoreCheckpointIO(CheckpointIO):
    """See the module docstring."""

    def __init__(self, store: CheckpointStore, drain: bool | None = None) -> None:
        self.store = store
        self.drain = drain

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        step = int(checkpoint.get("global_step", 0))
        self.store.save(step, checkpoint, drain=self.drain)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, json.dumps({STUB: self.store.cfg.name, "step": step}).encode())

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        try:
            stub = json.loads(read_no_follow(Path(path), 4096))
            step = int(stub["step"]) if stub.get(STUB) == self.store.cfg.name else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            step = None
        restored = self.store.load_latest(source_rank=0, at_most=step)
        if restored is None or (step is not None and restored.step != step):
            found = "nothing" if restored is None else f"step {restored.step}"
            raise FileNotFoundError(f"bv ckpt: {path} names step {step}; the store can read "
                                    f"{found} (see its summary line)")
        state = restored.state
        assert isinstance(state, dict)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def teardown(self) -> None:
        self.store.wait()
