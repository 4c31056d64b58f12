"""Draining and resuming nodes with NHC's etiquette.

- Every reason we set starts with the site's prefix (`bv:`); we resume only nodes whose reason
  carries it, so an operator's drain is never touched.
- Fleet breaker: when the share of a partition's nodes already drained by us reaches
  `health.fleet_breaker_pct`, further drains are refused (reported loudly): a fleet-wide
  "failure" is far more likely a bad threshold or a shared dependency than many broken nodes.
- Each scontrol call is bounded by `health.drain_timeout_s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from bluevela.errors import SlurmError
from bluevela.site import Site
from bluevela.slurm.client import NodeInfo, SlurmClient

logger = logging.getLogger(__name__)
MAX_REASON = 200


@dataclass(frozen=True)
class DrainOutcome:
    node: str
    drained: bool
    reason: str
    why_not: str | None = None  # "fleet breaker: 3/16 ...", "already drained by operator", ...


def make_reason(site: Site, detail: str) -> str:
    """`bv: <detail>`, on one line, bounded in length."""
    prefix = site.health.drain_prefix
    text = " ".join(detail.split())
    reason = f"{prefix} {text}" if not text.startswith(prefix) else text
    return reason[:MAX_REASON]


def is_ours(site: Site, reason: str) -> bool:
    return reason.startswith(site.health.drain_prefix)


def fleet_share(nodes: list[NodeInfo], node: str, site: Site) -> tuple[int, int]:
    """(drained by us, total) over the partitions `node` is in."""
    mine = next((n for n in nodes if n.name == node), None)
    parts = set(mine.partitions) if mine else set()
    peers = [n for n in nodes if parts & set(n.partitions)] if parts else nodes
    ours = sum(1 for n in peers if n.drained and is_ours(site, n.reason))
    return ours, len(peers)


def drain_node(client: SlurmClient, site: Site, node: str, detail: str) -> DrainOutcome:
    """Drain `node` with a `bv:` reason unless the fleet breaker or an operator's drain says no."""
    reason = make_reason(site, detail)
    timeout = site.health.drain_timeout_s
    nodes = client.nodes()
    mine = next((n for n in nodes if n.name == node), None)
    if mine is not None and mine.drained and not is_ours(site, mine.reason):
        return DrainOutcome(node, False, reason, f"already drained by operator: {mine.reason}")
    ours, total = fleet_share(nodes, node, site)
    already = mine is not None and mine.drained
    if not already and total and ours * 100.0 / total >= site.health.fleet_breaker_pct:
        why = (f"fleet breaker: {ours}/{total} nodes already drained by "
               f"{site.health.drain_prefix} (limit {site.health.fleet_breaker_pct:g}%)")
        logger.error("NOT draining %s (%s): %s", node, reason, why)
        return DrainOutcome(node, False, reason, why)
    client.drain(node, reason, timeout_s=timeout)
    logger.warning("drained %s: %s", node, reason)
    return DrainOutcome(node, True, reason)


def resume_node(client: SlurmClient, site: Site, node: str) -> DrainOutcome:
    """Resume `node` only when its drain reason is ours."""
    found = client.nodes([node])
    if not found:
        raise SlurmError(f"node {node} is not known to Slurm")
    info = found[0]
    if not info.drained:
        return DrainOutcome(node, False, info.reason, "not drained")
    if not is_ours(site, info.reason):
        return DrainOutcome(node, False, info.reason, f"drained by operator: {info.reason}")
    client.resume(node, timeout_s=site.health.drain_timeout_s)
    return DrainOutcome(node, True, info.reason)
