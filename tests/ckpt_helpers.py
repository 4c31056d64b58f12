"""Helpers of the checkpoint store's tests: ranks as threads of one process, each with its own
"node" (a node-local directory of its own) and an all-gather over a barrier."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bluevela.ckpt.store import CheckpointStore, StoreConfig

KEY = b"k" * 32


class ThreadGroup:
    """The ranks of one job as threads: `all_gather` over a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def member(self, rank: int) -> Member:
        return Member(self, rank)


class Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world = group, rank, group.world

    def all_gather(self, obj: Any) -> list[Any]:
        self.group.slots[self.rank] = obj
        self.group.barrier.wait()
        out = list(self.group.slots)
        self.group.barrier.wait()
        return out


def run_ranks(world: int, fn: Callable[[int, Member], Any]) -> list[Any]:
    """fn(rank, collective) on `world` threads; their results by rank (an exception re-raised)."""
    group = ThreadGroup(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group.member(rank))
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def node_of(rank: int, per_node: int = 1) -> str:
    return f"n{rank // per_node + 1}"


def make_store(tmp: Path, rank: int, coll: Member, *, per_node: int = 1,
               node: str | None = None, **kw: Any) -> CheckpointStore:
    """Rank `rank`'s store: node-local dir tmp/local/<node>, shared dir tmp/shared."""
    node = node or node_of(rank, per_node)
    values: dict[str, Any] = {"shared_dir": tmp / "shared", "local_dir": tmp / "local" / node,
                              "name": "t", "job": "77"}
    values.update(kw)
    return CheckpointStore(StoreConfig(**values), coll, key=KEY, node=node)
