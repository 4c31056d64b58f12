"""Which node pairs to measure, and which node (or link) is at fault when a pair is slow. Pure.

1. `initial_pairs`: neighbours in name order, so every node is in a pair; with an odd count the
   last node is also paired with the first (one node in two pairs).
2. `rounds`: pairs sharing a node cannot be measured at once; greedy rounds of disjoint pairs.
3. After each round, `follow_ups` pairs every suspect (a node of a slow pair that has not yet
   passed with anyone, and is slow with fewer than two partners) with a new partner, preferring
   nodes that passed with someone: "known good" partners make the next result mean something.
4. `verdict`: a node slow with two different partners and fine with none is the culprit. A slow
   pair whose two nodes are each fine with another partner is a link (or switch path) fault.
   Anything else stays unresolved (e.g. two nodes and nothing to compare with).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bluevela.util.names import natural_key

logger = logging.getLogger(__name__)

Pair = tuple[str, str]


def pair_of(a: str, b: str) -> Pair:
    """The canonical (ordered) pair of two distinct nodes."""
    if a == b:
        raise ValueError(f"a node cannot pair with itself: {a}")
    x, y = sorted((a, b), key=natural_key)
    return (x, y)


def initial_pairs(nodes: Iterable[str]) -> list[Pair]:
    """Neighbours in natural name order; odd count: the last also pairs with the first."""
    ns = sorted(set(nodes), key=natural_key)
    pairs = [pair_of(ns[i], ns[i + 1]) for i in range(0, len(ns) - 1, 2)]
    if len(ns) % 2 == 1 and len(ns) >= 3:
        pairs.append(pair_of(ns[-1], ns[0]))
    return pairs


def rounds(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """Greedy rounds of node-disjoint pairs, in the given order."""
    out: list[list[Pair]] = []
    busy: list[set[str]] = []
    for p in pairs:
        for i, used in enumerate(busy):
            if p[0] not in used and p[1] not in used:
                out[i].append(p)
                used.update(p)
                break
        else:
            out.append([p])
            busy.append(set(p))
    return out


@dataclass(frozen=True)
class Observation:
    """One measured pair: slow (a pair figure failed its floor) or not; `ran` False when the
    measurement could not run (no evidence either way)."""

    pair: Pair
    slow: bool
    ran: bool = True


@dataclass
class Evidence:
    slow_with: dict[str, set[str]] = field(default_factory=dict)
    fine_with: dict[str, set[str]] = field(default_factory=dict)
    tried: set[Pair] = field(default_factory=set)

    @classmethod
    def of(cls, observations: Iterable[Observation]) -> Evidence:
        ev = cls()
        for ob in observations:
            ev.tried.add(ob.pair)
            if not ob.ran:
                continue
            a, b = ob.pair
            book = ev.slow_with if ob.slow else ev.fine_with
            book.setdefault(a, set()).add(b)
            book.setdefault(b, set()).add(a)
        return ev

    def cleared(self, node: str) -> bool:
        return bool(self.fine_with.get(node))

    def culprit(self, node: str) -> bool:
        return len(self.slow_with.get(node, ())) >= 2 and not self.cleared(node)


def suspects(ev: Evidence) -> list[str]:
    """Nodes of slow pairs not yet cleared nor convicted."""
    return sorted((n for n in ev.slow_with if not ev.cleared(n) and not ev.culprit(n)),
                  key=natural_key)


def follow_ups(nodes: Iterable[str], observations: Iterable[Observation]) -> list[Pair]:
    """New pairs that would tell the suspects apart (empty when nothing more can be learned)."""
    ev = Evidence.of(observations)
    pool = sorted(set(nodes), key=natural_key)
    planned: list[Pair] = []
    taken: set[str] = set()
    sus = suspects(ev)
    for s in sus:
        if s in taken:
            continue

        def rank(c: str) -> tuple[int, list[object]]:
            # Known-good partners first, then untested, then other suspects; convicted last.
            grade = 0 if ev.cleared(c) else 3 if ev.culprit(c) else 2 if c in sus else 1
            return grade, natural_key(c)

        candidates = sorted((c for c in pool if c != s and pair_of(s, c) not in ev.tried
                             and c not in taken and not ev.culprit(c)), key=rank)
        if candidates:
            p = pair_of(s, candidates[0])
            planned.append(p)
            taken.update(p)
    return planned


@dataclass(frozen=True)
class Verdict:
    """Who is at fault. `culprits` maps a node to its slow partners."""

    culprits: dict[str, tuple[str, ...]]
    link_faults: tuple[Pair, ...]
    unresolved: tuple[Pair, ...]


def verdict(observations: Iterable[Observation]) -> Verdict:
    """Culprit nodes, faulty links and slow pairs that nothing explains."""
    obs = list(observations)
    ev = Evidence.of(obs)
    culprits = {n: tuple(sorted(ev.slow_with[n], key=natural_key))
                for n in sorted(ev.slow_with, key=natural_key) if ev.culprit(n)}
    links: list[Pair] = []
    unresolved: list[Pair] = []
    for ob in obs:
        if not (ob.ran and ob.slow):
            continue
        a, b = ob.pair
        if a in culprits or b in culprits:
            continue
        target = links if ev.cleared(a) and ev.cleared(b) else unresolved
        if ob.pair not in target:
            target.append(ob.pair)
    return Verdict(culprits, tuple(links), tuple(unresolved))
