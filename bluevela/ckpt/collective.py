"""How the ranks of a store agree: one all-gather of small JSON-able values.

The store needs a handful of collectives (at open: addresses; at a resume: inventories and
results; at the end: what each tier holds), never per tensor. `TorchGroup` uses the default
process group that the training script already made (`all_gather_object`); `Single` is a job
of one rank. torch is imported only by `TorchGroup` and only when torch.distributed is already
in use (`default_collective` never imports it).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Collective(Protocol):
    rank: int
    world: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank (a collective: every rank calls it)."""
        ...


class Single:
    """A job of one rank."""

    rank = 0
    world = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class TorchGroup:
    """torch.distributed's default group (gloo or NCCL; the objects travel pickled inside the
    job's own process group, as torch's own checkpointing does)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


def default_collective() -> Collective:
    """The training script's process group when it made one, else a job of one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchGroup()
    return Single()
