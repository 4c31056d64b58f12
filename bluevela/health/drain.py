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


def hook_client(site: Site) -> SlurmClient:
    """A Slurm client for hooks: no retries, every command bounded by `drain_timeout_s`.

    The prolog must not hang on an unreachable controller (Slurm's guide advises against
    Slurm commands in the prolog; a precise drain reason is worth one bounded call).
    """
    from bluevela.slurm.cli_client import CliSlurmClient

    return CliSlurmClient(retry_s=0.0, command_timeout_s=site.health.drain_timeout_s)


def check_of_reason(site: Site, reason: str) -> str | None:
    """The check named by one of our reasons: 'bv: ib: mlx5_3/1 state DOWN' -> 'ib'."""
    if not is_ours(site, reason):
        return None
    rest = reason[len(site.health.drain_prefix):].strip()
    name, sep, _ = rest.partition(":")
    name = name.strip()
    return name if sep and name.isidentifier() else None


def passes_for_resume(site: Site, reason: str, statuses: dict[str, int]) -> tuple[bool, str]:
    """Whether a node drained with `reason` may be resumed given fresh check `statuses`.

    Passing means: no check CRITICAL now, and the check the reason names (when it names one)
    ran and is OK or WARNING (an UNKNOWN says nothing either way, so it does not resume).

    Args:
        site: the site (for the prefix).
        reason: the node's current drain reason.
        statuses: check name -> Status value (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).
    """
    critical = sorted(n for n, s in statuses.items() if s == 2)
    if critical:
        return False, f"still CRITICAL: {', '.join(critical)}"
    named = check_of_reason(site, reason)
    if named is None:
        bad = sorted(n for n, s in statuses.items() if s not in (0, 1))
        return (not bad), (f"not passing: {', '.join(bad)}" if bad else "all checks pass")
    if named not in statuses:
        return False, f"the drain names check {named!r}, which this run did not include"
    if statuses[named] not in (0, 1):
        return False, f"check {named!r} could not run (UNKNOWN)"
    return True, f"check {named!r} passes again"
