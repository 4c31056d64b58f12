"""Which step a resume takes and where each rank reads it from: pure functions over what the
ranks gathered (no file, socket or clock), so a table test covers every branch.

The rule: the newest step that every rank can read somewhere, each rank from its fastest place
(this node's own file, a copy this node holds for a partner, the copy on another node of the
job fetched over the network, then shared storage). Shared storage is listed only when the
node-local tiers do not settle it: no step complete there, or a newer step seen there that is
not complete whose drain a rank recorded (a `drained-<rank>` marker beside its node-local
shard), or every local candidate failed. A step newer than every complete one that no rank
recorded as drained cannot be in shared storage: it is not worth a read of the file system.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeInv:
    """What one node of the job holds in its node-local tier."""

    node: str
    addr: tuple[str, int] | None  # a rank's shard server there
    own: dict[int, frozenset[int]] = field(default_factory=dict)  # step -> ranks
    held: dict[int, frozenset[int]] = field(default_factory=dict)
    drained: frozenset[int] = frozenset()  # steps a rank here drained to shared storage

    def holds(self, step: int, rank: int) -> str | None:
        if rank in self.own.get(step, ()):
            return "own"
        if rank in self.held.get(step, ()):
            return "held"
        return None

    def to_wire(self) -> dict[str, object]:
        return {"node": self.node, "addr": list(self.addr) if self.addr else None,
                "own": {str(s): sorted(r) for s, r in self.own.items()},
                "held": {str(s): sorted(r) for s, r in self.held.items()},
                "drained": sorted(self.drained)}

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> NodeInv:
        def conv(x: object) -> dict[int, frozenset[int]]:
            assert isinstance(x, dict)
            return {int(s): frozenset(int(r) for r in rs) for s, rs in x.items()}

        addr = d.get("addr")
        return cls(str(d["node"]),
                   (str(addr[0]), int(addr[1])) if isinstance(addr, list) else None,
                   conv(d.get("own", {})), conv(d.get("held", {})),
                   frozenset(int(s) for s in d.get("drained", [])))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Place:
    """Where one rank's shard of a step can be read."""

    tier: str  # "local" (this node), "partner" (another node's copy), "shared"
    node: str | None = None
    addr: tuple[str, int] | None = None
    kind: str = ""  # own / held for a node-local file

    def words(self) -> str:
        if self.tier == "shared":
            return "shared"
        where = "this node" if self.tier == "local" else self.node
        return f"{self.tier} ({self.kind} copy on {where})"


def _steps(invs: Sequence[NodeInv]) -> set[int]:
    return {s for inv in invs for s in (*inv.own, *inv.held)}


World = int | Sequence[int] | None
"""Whose shards a step needs: `world` ranks (0..world-1), the ranks listed (a replicated state
saved by rank 0 only), or None: the ranks the step was saved by, whatever the job's size now
(a resharding resume), taken as 0..the highest rank seen of that step anywhere (a shard's
header says the world it was saved by: a step missing its highest ranks everywhere is found
out when the first header is read)."""


def saved_world(step: int, invs: Sequence[NodeInv],
                shared: dict[int, frozenset[int]] | None = None) -> int:
    """1 + the highest rank of `step` seen on any node or in shared storage (0: none)."""
    seen = [r for inv in invs for r in (*inv.own.get(step, ()), *inv.held.get(step, ()))]
    seen += list((shared or {}).get(step, ()))
    return max(seen) + 1 if seen else 0


def _ranks(world: World, step: int, invs: Sequence[NodeInv],
           shared: dict[int, frozenset[int]] | None = None) -> Sequence[int]:
    if world is None:
        return range(saved_world(step, invs, shared))
    return range(world) if isinstance(world, int) else world


def local_complete(invs: Sequence[NodeInv], world: World) -> list[int]:
    """Steps, newest first, of which every rank's shard (see `World`) is on some node of the
    job."""
    out = []
    for step in sorted(_steps(invs), reverse=True):
        if all(any(inv.holds(step, r) for inv in invs) for r in _ranks(world, step, invs)):
            out.append(step)
    return out


def needs_shared(invs: Sequence[NodeInv], world: World, failed: set[int]) -> bool:
    """Whether shared storage must be listed before choosing (see the module docstring)."""
    good = [s for s in local_complete(invs, world) if s not in failed]
    if not good:
        return True
    drained = [s for inv in invs for s in inv.drained if s not in failed]
    return bool(drained) and max(drained) > good[0]


def candidates(invs: Sequence[NodeInv], world: World,
               shared: dict[int, frozenset[int]],
               failed: set[int]) -> list[int]:
    """Steps every rank can read somewhere (node-local or shared), newest first."""
    steps = (_steps(invs) | set(shared)) - failed
    out = []
    for step in sorted(steps, reverse=True):
        if all(any(inv.holds(step, r) for inv in invs) or r in shared.get(step, ())
               for r in _ranks(world, step, invs, shared)):
            out.append(step)
    return out


def places(step: int, rank: int, my_node: str, invs: Sequence[NodeInv],
           shared: dict[int, frozenset[int]]) -> list[Place]:
    """Where `rank` reads its shard of `step`, fastest first: this node (its own file before a
    partner's copy), another node of the job (own file before copy), then shared storage."""
    out: list[Place] = []
    here = [inv for inv in invs if inv.node == my_node]
    for inv in here[:1]:
        kind = inv.holds(step, rank)
        if kind:
            out.append(Place("local", inv.node, inv.addr, kind))
    others = [(inv.holds(step, rank), inv) for inv in invs if inv.node != my_node]
    for want in ("own", "held"):
        for kind, inv in others:
            if kind == want and inv.addr is not None:
                out.append(Place("partner", inv.node, inv.addr, kind))
    if rank in shared.get(step, ()):
        out.append(Place("shared"))
    return out
