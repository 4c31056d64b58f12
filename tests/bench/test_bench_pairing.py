"""Pair planning and fault isolation (pure): every node paired, follow-ups that isolate a slow
node or link, and verdicts."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bluevela.bench.pairing import (
    Observation,
    follow_ups,
    initial_pairs,
    pair_of,
    rounds,
    verdict,
)


def test_every_node_is_paired_odd_count_one_node_twice() -> None:
    assert initial_pairs(["node1", "node2", "node3"]) == [("node1", "node2"), ("node1", "node3")]
    assert initial_pairs(["node10", "node2", "node1", "node3"]) == [
        ("node1", "node2"), ("node3", "node10")]
    assert initial_pairs(["a"]) == []
    for n in range(2, 12):
        nodes = [f"n{i}" for i in range(n)]
        covered = {x for p in initial_pairs(nodes) for x in p}
        assert covered == set(nodes)


def test_rounds_are_node_disjoint() -> None:
    pairs = initial_pairs([f"n{i}" for i in range(7)])
    plan = rounds(pairs)
    assert sum(len(r) for r in plan) == len(pairs)
    for r in plan:
        used = [x for p in r for x in p]
        assert len(used) == len(set(used))
    assert rounds([("a", "b"), ("a", "c")]) == [[("a", "b")], [("a", "c")]]


def simulate(nodes: list[str], is_slow: Callable[[tuple[str, str]], bool],
             max_rounds: int = 5) -> tuple[list[Observation], object]:
    """Drive the planner as the nightly does, with a model of which pairs are slow."""
    obs = [Observation(p, is_slow(p)) for p in initial_pairs(nodes)]
    for _ in range(max_rounds):
        more = follow_ups(nodes, obs)
        if not more:
            break
        obs += [Observation(p, is_slow(p)) for p in more]
    return obs, verdict(obs)


def test_three_nodes_slow_node3_is_found_with_one_follow_up() -> None:
    obs, v = simulate(["node1", "node2", "node3"], lambda p: "node3" in p)
    assert [o.pair for o in obs] == [("node1", "node2"), ("node1", "node3"), ("node2", "node3")]
    assert v.culprits == {"node3": ("node1", "node2")}  # type: ignore[attr-defined]
    assert v.link_faults == () and v.unresolved == ()  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", ["n0", "n3", "n6", "n9"])
def test_one_slow_node_among_many(bad: str) -> None:
    nodes = [f"n{i}" for i in range(10)]
    obs, v = simulate(nodes, lambda p: bad in p)
    assert set(v.culprits) == {bad}  # type: ignore[attr-defined]
    assert len(obs) <= len(initial_pairs(nodes)) + 2  # two follow-ups at most


def test_two_slow_nodes_in_one_pair_are_both_found() -> None:
    nodes = [f"n{i}" for i in range(6)]
    _, v = simulate(nodes, lambda p: "n0" in p or "n1" in p)
    assert set(v.culprits) == {"n0", "n1"}  # type: ignore[attr-defined]


def test_a_slow_link_is_blamed_on_the_link_not_the_nodes() -> None:
    nodes = [f"n{i}" for i in range(4)]
    _, v = simulate(nodes, lambda p: p == ("n0", "n1"))
    assert v.culprits == {}  # type: ignore[attr-defined]
    assert v.link_faults == (("n0", "n1"),)  # type: ignore[attr-defined]


def test_two_nodes_cannot_isolate() -> None:
    obs, v = simulate(["a", "b"], lambda p: True)
    assert len(obs) == 1
    assert v.culprits == {} and v.unresolved == (("a", "b"),)  # type: ignore[attr-defined]


def test_pairs_that_could_not_run_are_no_evidence() -> None:
    obs = [Observation(("a", "b"), False, ran=False), Observation(("a", "c"), True)]
    v = verdict(obs)
    assert v.culprits == {} and v.unresolved == (("a", "c"),)
    # a has been tried with everyone; c is tried next with b, which has no evidence yet
    assert follow_ups(["a", "b", "c"], obs) == [("b", "c")]
    with pytest.raises(ValueError):
        pair_of("a", "a")
