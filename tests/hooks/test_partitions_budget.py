"""Nodes in several partitions (issue 35): each partition adds three fleet-breaker slot creates
to a drain, but the healthcheck's run cap assumed one partition, so on a node in two its drain
could run past slurmd's 60 s kill. site.yaml `health.partitions_per_node` now sizes the cap
(docs/install.md 1.4 has the rule: cap = 52 - (3 + 3P) x drain_timeout_s), and validate names
the key when a node is in more partitions than it says."""

from __future__ import annotations

from dataclasses import replace

from bluevela.hooks.budget import HEALTHCHECK_KILL_S, healthcheck_cap_s, hook_budget, problems
from bluevela.site import Site, load_site
from tests.conftest import REPO

SITE = load_site(REPO / "site.yaml")


def _site(partitions: int, drain_timeout_s: float = 5.0) -> Site:
    return replace(SITE, health=replace(SITE.health, partitions_per_node=partitions,
                                        drain_timeout_s=drain_timeout_s))


def test_the_cap_follows_the_partitions_a_node_is_in() -> None:
    for p, t in ((1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0), (2, 5.0)):
        site = _site(p, t)
        assert healthcheck_cap_s(site) == max(1.0, 52 - (3 + 3 * p) * t)
        # the drain after a run at that cap ends within slurmd's kill
        assert hook_budget(site, "healthcheck", partitions=p).total_s <= HEALTHCHECK_KILL_S
    assert problems(_site(2, 4.0), None, partitions=2) == []
    # t = 5 with two partitions fits the 60 s but leaves the checks 7 s: named
    assert problems(_site(2, 5.0), None, partitions=2)[0].startswith(
        "healthcheck run cap 7 s < 10 s")


def test_validate_names_the_key_when_a_node_is_in_more_partitions() -> None:
    [line] = problems(SITE, 400.0, partitions=2)
    assert "kill at 60 s (a node in 2 partitions: set health.partitions_per_node: 2)" in line
