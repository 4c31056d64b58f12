"""What a training script uses from bluevela: no torch, no heavy imports.

    from bluevela import runtime
    runtime.install_signal_handler()          # once, first thing (main thread)
    for step in range(start, steps):
        train_step()
        if step % k == 0 or runtime.checkpoint_requested():
            with runtime.checkpointing(step): # its cost and time go to bv's goodput ledger
                save_checkpoint()             # atomically: temp file, fsync, rename
            if runtime.checkpoint_requested():
                break                         # bv requeues the job; the next attempt resumes
        runtime.progress(step)                # heartbeat for --hang-timeout (opt-in)
    runtime.finished()                        # training over: teardown is not a hang

See docs/resilience.md ("For script authors").
"""

from __future__ import annotations

from typing import Any

from bluevela.runtime.checkpoint import (
    CHECKPOINT_SIGNAL,
    attempt,
    checkpoint_requested,
    clear_checkpoint_request,
    install_signal_handler,
    request_checkpoint,
    requested_by,
    stopping_for_checkpoint,
)

__all__ = [
    "CHECKPOINT_SIGNAL",
    "attempt",
    "checkpoint_requested",
    "checkpoint_saved",
    "checkpoint_store",
    "checkpointing",
    "clear_checkpoint_request",
    "finished",
    "install_signal_handler",
    "progress",
    "request_checkpoint",
    "requested_by",
    "stopping_for_checkpoint",
]


def __getattr__(name: str) -> Any:
    # The heartbeat lives in its own module (the in-job supervisor's side); loaded on first use.
    if name in ("progress", "finished", "checkpoint_saved", "checkpointing"):
        from bluevela.runtime import heartbeat

        return getattr(heartbeat, name)
    if name == "checkpoint_store":
        # The node-local checkpoint store (bluevela/ckpt, docs/checkpoints.md), on first use.
        from bluevela.ckpt.store import open_store

        return open_store
    raise AttributeError(f"module 'bluevela.runtime' has no attribute {name!r}")
