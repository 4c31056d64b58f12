"""The one place that changes node state in Slurm: drain, resume, and the fleet breaker.

Checks judge (`bluevela.health.checks` never imports this module); the hooks, the nightly and
`bv health resume` act, through here.

Etiquette (NHC's):
- Every reason we set starts with the site's prefix (`bv:`); we resume only nodes whose reason
  carries it, so an operator's drain is never touched.
- A nightly drain (`bv: nightly <date>: ...`) is resumed only by an operator (`bv health
  resume`), never by the hourly healthcheck: the healthcheck does not re-measure what the
  nightly found (GEMM, HBM, pairwise bandwidth).
- Each Slurm call is bounded by `health.drain_timeout_s`, with no retries.

The fleet breaker (docs/health.md, "Fleet breaker"): at most `ceil(N * fleet_breaker_pct /
100)` of a partition's N nodes are ever drained by us, whatever the timing. A node may drain
only after it holds a *slot* of every partition it is in. A slot is a reservation named
`bv-drain-<partition>-<i>`, `i < limit`, on the node itself: slurmctld refuses a second
reservation of the same name, which makes creating one an atomic compare-and-set on the one
thing every node shares, the controller. The reservation starts ten years from its creation
(so it never keeps a job off the node) and that start time also dates the slot.

One failing node asks the controller at most 2 reads (sinfo, show reservation) + 3 creates per
partition + 1 drain, after a random delay of up to `HOOK_JITTER_S` (hooks only), so a storm of
simultaneous prologs spreads out and late nodes see the slots already taken and stop after the
two reads. A slot is freed (deleted) right after its node is resumed by us; a slot whose node
is no longer drained by us (an operator resumed it with scontrol) is stale and is freed by that
node's own next drain or healthcheck, by `bv health resume`, or by the nightly run: never by
another node's hook, whose delete could race with a fresh holder of the same name.

The action gate (docs/health.md, "Audit mode and the kill switch"): every automatic action
here (a drain, a resume, a breaker slot taken or freed) first asks `local_actions` and, right
before its first write to slurmctld, the cluster-wide kill switch:

- `health.actions` in site.yaml: `enforce` (default), `audit` (checks run and report; nothing
  is drained, resumed or held: the log says what would have happened) or `off` (the hooks
  check nothing);
- `/etc/bluevela/actions` (`$BV_ACTIONS_FILE`), one word, overrides site.yaml on that node in
  either direction (audit everywhere but enforce on a few canaries; off on one node). A word
  that is not one of the three reads as `audit`: a typo never turns actions on;
- the reservation `bv-actions-off` on slurmctld stops every action of every node at once,
  without touching a file on any node. It is read only when a node is about to act (the read
  the breaker makes anyway), so healthy nodes still make no call.

`bv health resume`, an operator's explicit command, is not gated.
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bluevela.errors import SlurmError
from bluevela.site import Site
from bluevela.slurm.client import NodeInfo, ReservationInfo, SlurmClient
from bluevela.util.actions import Actions
from bluevela.util.actions import local_actions as _local_actions

logger = logging.getLogger(__name__)
MAX_REASON = 200

SLOT_PREFIX = "bv-drain-"
SLOT_START_IN_S = 3650 * 86400  # the slot reservation starts ten years after its creation
SLOT_DURATION_MIN = 1
SLOT_FLAGS = ("IGNORE_JOBS", "OVERLAP")
# A slot younger than this whose node is not (yet) drained may be a drain in flight: nobody
# frees it. The holder itself gives up (frees its slots, does not drain) when taking them took
# longer than MAX_TAKE_S, well inside the grace.
SLOT_GRACE_S = 120.0
MAX_TAKE_S = 60.0
MAX_CREATE_TRIES = 3  # create attempts per partition (random free slots) before giving up
HOOK_JITTER_S = 2.0  # hooks wait up to this long before their first Slurm call
NO_PARTITION = "_none"  # slots of nodes in no partition (counted over all nodes)
_SLOT = re.compile(r"^bv-drain-([A-Za-z0-9_]{1,64})-([0-9]{1,6})$")
KILL_SWITCH = "bv-actions-off"  # a reservation of this name on slurmctld stops every action


class DrainFailed(SlurmError):
    """A Slurm call of `drain_node` failed.

    `slots` are the breaker slots taken before it failed: with a slot the node counts against
    the breaker (it may be drained after all, by us or by Slurm for a prolog's exit 1); with
    none it does not, and a prolog must not exit 1 for it (Slurm would drain it outside the
    breaker: fifty prologs that cannot reach a slow slurmctld would drain fifty nodes).
    """

    def __init__(self, message: str, slots: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.slots = slots


@dataclass(frozen=True)
class DrainOutcome:
    node: str
    drained: bool
    reason: str
    why_not: str | None = None  # "fleet breaker: 3/16 ...", "already drained by operator", ...
    slots: tuple[str, ...] = ()  # breaker slots taken for this drain
    rpcs: int = 0  # Slurm commands this call ran
    gated: str | None = None  # "audit" or "off": the action gate stopped it (why_not says why)

    @property
    def breaker(self) -> bool:
        return bool(self.why_not and self.why_not.startswith("fleet breaker"))


# -- the action gate ----------------------------------------------------------------------------


def local_actions(site: Site, environ: Mapping[str, str] | None = None) -> Actions:
    """This host's mode: the node file when there is one, else site.yaml's `health.actions`
    (bluevela.util.actions)."""
    return _local_actions(site.health.actions, environ)


def cluster_actions(local: Actions, reservations: Sequence[ReservationInfo]) -> Actions:
    """`local`, unless the kill switch (reservation `bv-actions-off`) is on the controller."""
    if any(r.name == KILL_SWITCH for r in reservations):
        return Actions("off", f"reservation {KILL_SWITCH}")
    return local


# -- reasons ------------------------------------------------------------------------------------


def make_reason(site: Site, detail: str) -> str:
    """`bv: <detail>`, on one line, bounded in length."""
    prefix = site.health.drain_prefix
    text = " ".join(detail.split())
    reason = f"{prefix} {text}" if not text.startswith(prefix) else text
    return reason[:MAX_REASON]


def is_ours(site: Site, reason: str) -> bool:
    prefix = site.health.drain_prefix
    return bool(prefix) and reason.startswith(prefix)


def is_nightly(site: Site, reason: str) -> bool:
    """A drain set by the nightly acceptance run (`bv: nightly <date>: ...`)."""
    if not is_ours(site, reason):
        return False
    return reason[len(site.health.drain_prefix):].strip().startswith("nightly ")


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
    A nightly drain never passes here: the health checks do not measure what the nightly
    measured; only an operator resumes it.

    Args:
        site: the site (for the prefix).
        reason: the node's current drain reason.
        statuses: check name -> Status value (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).
    """
    if is_nightly(site, reason):
        return False, ("a nightly drain: the health checks do not re-measure it; an operator "
                       "resumes it (bv health resume)")
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


def hook_client(site: Site) -> SlurmClient:
    """A Slurm client for hooks: no retries, every command bounded by `drain_timeout_s`.

    The prolog must not hang on an unreachable controller (Slurm's guide advises against
    Slurm commands in the prolog; a precise drain reason is worth a few bounded calls).
    """
    from bluevela.slurm.cli_client import CliSlurmClient

    return CliSlurmClient(retry_s=0.0, command_timeout_s=site.health.drain_timeout_s)


# -- the fleet breaker's slots ------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One taken breaker slot (a `bv-drain-<partition>-<i>` reservation)."""

    name: str
    key: str  # the partition's slot key
    index: int
    node: str
    created: float | None  # unix seconds (the reservation's start minus SLOT_START_IN_S)


def slot_key(partition: str) -> str:
    """A partition name as it appears in slot names (letters, digits, `_`)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", partition)[:64] or NO_PARTITION


def slot_name(partition: str, index: int) -> str:
    return f"{SLOT_PREFIX}{slot_key(partition)}-{index}"


def parse_slots(reservations: Sequence[ReservationInfo]) -> list[Slot]:
    """The breaker slots among `reservations` (others are ignored)."""
    out: list[Slot] = []
    for r in reservations:
        m = _SLOT.match(r.name)
        if not m or len(r.nodes) != 1:
            continue
        created = None if r.start_time is None else r.start_time - SLOT_START_IN_S
        out.append(Slot(r.name, m.group(1), int(m.group(2)), r.nodes[0], created))
    return out


def breaker_limit(total: int, pct: float) -> int:
    """How many of `total` nodes the breaker lets us drain: ceil(total * pct / 100)."""
    if total <= 0 or pct <= 0:
        return 0
    return min(total, math.ceil(total * pct / 100.0 - 1e-9))


@dataclass(frozen=True)
class Budget:
    """One partition's breaker, from one read of the nodes and one of the reservations."""

    partition: str
    total: int
    limit: int
    held: dict[int, Slot] = field(default_factory=dict)  # every slot of this partition
    unslotted: tuple[str, ...] = ()  # drained by us, holding no slot here (older drains)

    @property
    def used(self) -> int:
        return len(self.held) + len(self.unslotted)

    def free(self) -> list[int]:
        """Slot indices nobody holds, below a bound `k` such that
        `k + unslotted + (slots held at index >= k) <= limit`: whatever wins the race for the
        names below `k`, the drains stay within the limit (drains without a slot, and slots
        left above `k` by an earlier, larger range, count against it)."""
        k = self.limit - len(self.unslotted)
        while k > 0 and k + len(self.unslotted) + sum(1 for i in self.held if i >= k) > self.limit:
            k -= 1
        return [i for i in range(max(k, 0)) if i not in self.held]

    def why(self, site: Site) -> str:
        return (f"fleet breaker: {self.used}/{self.total} nodes already drained by "
                f"{site.health.drain_prefix} in partition {self.partition} (limit "
                f"{site.health.fleet_breaker_pct:g}% = {self.limit} node(s))")


def budgets(site: Site, nodes: Sequence[NodeInfo], slots: Sequence[Slot],
            partitions: Sequence[str]) -> list[Budget]:
    """The breaker of each of `partitions` (NO_PARTITION: over all nodes)."""
    out: list[Budget] = []
    for part in partitions:
        members = nodes if part == NO_PARTITION else [n for n in nodes if part in n.partitions]
        key = slot_key(part)
        held = {s.index: s for s in slots if s.key == key}
        holders = {s.node for s in held.values()}
        unslotted = tuple(sorted(n.name for n in members if n.drained and is_ours(site, n.reason)
                                 and n.name not in holders))
        out.append(Budget(part, len(members), breaker_limit(len(members),
                                                            site.health.fleet_breaker_pct),
                          held, unslotted))
    return out


def _stale(slot: Slot, nodes_by_name: dict[str, NodeInfo], site: Site, now: float) -> bool:
    """Held by a node no longer drained by us, and old enough not to be a drain in flight."""
    info = nodes_by_name.get(slot.node)
    if info is not None and info.drained and is_ours(site, info.reason):
        return False
    return slot.created is not None and now - slot.created > SLOT_GRACE_S


class _Counted:
    """Counts the Slurm commands one operation runs (figures for the RPC budget)."""

    def __init__(self, client: SlurmClient, timeout: float) -> None:
        self.client = client
        self.timeout = timeout
        self.calls = 0

    def nodes(self) -> list[NodeInfo]:
        self.calls += 1
        return self.client.nodes()

    def reservations(self) -> list[ReservationInfo]:
        self.calls += 1
        return self.client.reservations(timeout_s=self.timeout)

    def slots(self) -> list[Slot]:
        return parse_slots(self.reservations())

    def create(self, name: str, node: str) -> bool:
        self.calls += 1
        return self.client.create_reservation(name, node, start_in_s=SLOT_START_IN_S,
                                              duration_min=SLOT_DURATION_MIN,
                                              flags=SLOT_FLAGS, timeout_s=self.timeout)

    def delete(self, name: str) -> bool:
        self.calls += 1
        try:
            return self.client.delete_reservation(name, timeout_s=self.timeout)
        except SlurmError as exc:
            logger.error("could not free breaker slot %s: %s", name, exc)
            return False

    def drain(self, node: str, reason: str) -> None:
        self.calls += 1
        self.client.drain(node, reason, timeout_s=self.timeout)

    def resume(self, node: str) -> None:
        self.calls += 1
        self.client.resume(node, timeout_s=self.timeout)


def release_own_slots(client: SlurmClient | _Counted, site: Site, node: str, *,
                      only_stale: bool = True,
                      slots: Sequence[Slot] | None = None,
                      nodes: Sequence[NodeInfo] | None = None,
                      gated: bool = True) -> list[str]:
    """Free the breaker slots `node` holds (only stale ones unless `only_stale` is False).

    Only the holder's own hooks, `bv health resume` and the nightly call this for a node:
    slots are never freed by another node's hook.
    """
    c = client if isinstance(client, _Counted) else _Counted(client, site.health.drain_timeout_s)
    if slots is None:
        reservations = c.reservations()
        if gated and not cluster_actions(Actions("enforce", ""), reservations).enforce:
            return []  # the kill switch: not even a stale slot is freed (but see resume_node)
        slots = parse_slots(reservations)
    held = [s for s in slots if s.node == node]
    if not held:
        return []
    if only_stale:
        if nodes is None:
            c.calls += 1
            nodes = c.client.nodes([node])
        infos = list(nodes)
        by_name = {n.name: n for n in infos}
        held = [s for s in held if _stale(s, by_name, site, time.time())]
    freed = [s.name for s in held if c.delete(s.name)]
    for name in freed:
        logger.warning("freed breaker slot %s of %s", name, node)
    return freed


def release_stale_slots(client: SlurmClient, site: Site) -> list[str]:
    """Free every stale slot (the nightly's and an operator's clean-up; one process at once)."""
    if not local_actions(site).enforce:
        return []
    c = _Counted(client, site.health.drain_timeout_s)
    reservations = c.reservations()
    if not cluster_actions(Actions("enforce", ""), reservations).enforce:
        return []  # the kill switch
    slots = parse_slots(reservations)
    if not slots:
        return []
    by_name = {n.name: n for n in c.nodes()}
    now = time.time()
    freed: list[str] = []
    for s in slots:
        if _stale(s, by_name, site, now) and c.delete(s.name):
            logger.warning("freed stale breaker slot %s of %s (not drained by %s)", s.name,
                           s.node, site.health.drain_prefix)
            freed.append(s.name)
    return freed


# -- drain and resume ---------------------------------------------------------------------------


def drain_node(client: SlurmClient, site: Site, node: str, detail: str, *,
               jitter_s: float = 0.0, rng: random.Random | None = None,
               sleep: Callable[[float], None] = time.sleep,
               clock: Callable[[], float] = time.monotonic) -> DrainOutcome:
    """Drain `node` with a `bv:` reason unless the fleet breaker or an operator's drain says no.

    Holds under any number of simultaneous callers across nodes (see the module docstring).

    Args:
        jitter_s: wait a random 0..jitter_s seconds first (hooks: HOOK_JITTER_S).
        rng, sleep, clock: injectable for tests.

    Raises:
        SlurmError: a Slurm call failed (slots already taken stay taken: the node may be
            drained after all, by this call or by Slurm for a prolog's exit 1).
    """
    rng = rng or random.Random()
    reason = make_reason(site, detail)
    local = local_actions(site)
    if not local.enforce:  # audit or off here: no call to Slurm at all
        return DrainOutcome(node, False, reason, local.why("drain"), gated=local.mode)
    c = _Counted(client, site.health.drain_timeout_s)
    if jitter_s > 0:
        sleep(rng.uniform(0.0, jitter_s))
    nodes = c.nodes()
    by_name = {n.name: n for n in nodes}
    mine = by_name.get(node)
    if mine is None:
        raise SlurmError(f"node {node} is not known to Slurm")
    if mine.drained and not is_ours(site, mine.reason):
        return DrainOutcome(node, False, reason, f"already drained by operator: {mine.reason}",
                            rpcs=c.calls)
    reservations = c.reservations()
    gate = cluster_actions(local, reservations)
    if not gate.enforce:
        return DrainOutcome(node, False, reason, gate.why("drain"), rpcs=c.calls,
                            gated=gate.mode)
    if mine.drained:
        # Already ours, and counted as such: only the reason changes.
        c.drain(node, reason)
        logger.warning("drained %s (again): %s", node, reason)
        return DrainOutcome(node, True, reason, rpcs=c.calls)
    slots = parse_slots(reservations)
    # Our own slots while we are not drained by us: stale (an operator resumed us) or a drain
    # of this node in flight in another process.
    own = [s for s in slots if s.node == node]
    if own:
        freed = set(release_own_slots(c, site, node, slots=own, nodes=nodes))
        if len(freed) < len(own):
            return DrainOutcome(node, False, reason,
                                "another bluevela run is draining this node", rpcs=c.calls)
        slots = [s for s in slots if s.name not in freed]
    parts = sorted(set(mine.partitions)) or [NO_PARTITION]
    return _drain_under_breaker(c, site, node, reason, nodes, slots, parts, rng, clock)


def _drain_under_breaker(c: _Counted, site: Site, node: str, reason: str, nodes: list[NodeInfo],
                         slots: list[Slot], parts: list[str], rng: random.Random,
                         clock: Callable[[], float]) -> DrainOutcome:
    """Take a free breaker slot in each of the node's partitions (a reservation create, the
    compare-and-set), then drain; any slot taken is given back when one partition has none.

    Raises:
        DrainFailed: the drain (or a create) failed; the slots taken stay taken.
    """
    taken: list[str] = []
    t0 = clock()

    def give_back(why: str) -> DrainOutcome:
        for name in taken:
            c.delete(name)
        logger.error("NOT draining %s (%s): %s", node, reason, why)
        return DrainOutcome(node, False, reason, why, rpcs=c.calls)

    try:
        for budget in budgets(site, nodes, slots, parts):
            free = budget.free()
            if not free:
                return give_back(budget.why(site))
            for index in rng.sample(free, min(len(free), MAX_CREATE_TRIES)):
                name = slot_name(budget.partition, index)
                if c.create(name, node):
                    taken.append(name)
                    break
            else:
                return give_back(f"{budget.why(site)}; the free slot(s) went to other nodes "
                                 "draining at the same moment")
        if clock() - t0 > MAX_TAKE_S:
            return give_back(f"taking the breaker slots took over {MAX_TAKE_S:.0f} s")
        c.drain(node, reason)
    except SlurmError as exc:
        # The drain may have happened (a timeout after slurmctld acted), and a prolog that
        # could not drain exits 1, so Slurm drains the node itself ("Prolog error"): the slots
        # stay taken, counted, until freed as stale.
        if taken:
            logger.error("drain of %s failed (%s); keeping breaker slot(s) %s", node, exc,
                         ", ".join(taken))
        raise DrainFailed(str(exc), tuple(taken)) from exc
    logger.warning("drained %s: %s (breaker slot(s) %s)", node, reason, ", ".join(taken))
    return DrainOutcome(node, True, reason, slots=tuple(taken), rpcs=c.calls)


def resume_node(client: SlurmClient, site: Site, node: str) -> DrainOutcome:
    """Resume `node` only when its drain reason is ours, then free its breaker slots.

    A node that is not drained gives back its stale slots (an operator resumed it by hand).
    """
    c = _Counted(client, site.health.drain_timeout_s)
    c.calls += 1
    found = client.nodes([node])
    if not found:
        raise SlurmError(f"node {node} is not known to Slurm")
    info = found[0]
    if not info.drained:
        freed = release_own_slots(c, site, node, nodes=found, gated=False)
        note = f"; freed stale breaker slot(s) {', '.join(freed)}" if freed else ""
        return DrainOutcome(node, False, info.reason, f"not drained{note}", rpcs=c.calls)
    if not is_ours(site, info.reason):
        return DrainOutcome(node, False, info.reason, f"drained by operator: {info.reason}",
                            rpcs=c.calls)
    c.resume(node)
    # Resumed first, freed after: the slot never goes to another node while this one is
    # still drained. An operator's resume (not gated) frees its slot even under the kill switch.
    freed = release_own_slots(c, site, node, only_stale=False, gated=False)
    return DrainOutcome(node, True, info.reason, slots=tuple(freed), rpcs=c.calls)


@dataclass(frozen=True)
class ResumeCheck:
    """What the healthcheck decided about resuming its node."""

    resumed: bool
    note: str | None
    gated: str | None = None  # "audit" or "off": it would have resumed (the note says so)


def dcgm_gate(site: Site, before_resume: Callable[[], tuple[int, str]] | None
              ) -> tuple[bool, str | None]:
    """The site's DCGM diagnostic before a resume (`health.dcgm.before_resume_level`):
    (passes, note). `before_resume` runs it and gives (Status value, summary); OK or WARNING
    passes, anything else (a failure, DCGM absent, a timeout) keeps the node drained."""
    level = site.health.dcgm.before_resume_level
    if not level:
        return True, None
    if before_resume is None:
        return False, f"DCGM diag r{level} must pass before a resume: not run"
    code, summary = before_resume()
    if code not in (0, 1):
        name = {2: "CRITICAL", 3: "UNKNOWN"}.get(code, str(code))
        return False, f"DCGM diag r{level} before resume: {name}: {summary}"
    return True, f"DCGM diag r{level} passes"


def resume_if_passing(client: SlurmClient, site: Site, node: str,
                      statuses: dict[str, int],
                      before_resume: Callable[[], tuple[int, str]] | None = None) -> ResumeCheck:
    """The healthcheck's resume: a node drained by us whose named check passes again, and
    then the site's DCGM diagnostic before a resume (`before_resume`, see `dcgm_gate`).

    Operators' drains and nightly drains stay. A node that is not drained frees its stale
    breaker slots (one reservation read per healthcheck run on an idle node).
    """
    local = local_actions(site)
    found = client.nodes([node])
    info = found[0] if found else None
    if info is None:
        return ResumeCheck(False, f"node {node} is not known to Slurm")
    if not info.drained:
        if not local.enforce:
            return ResumeCheck(False, None)
        freed = release_own_slots(client, site, node, nodes=found)
        return ResumeCheck(False, f"freed stale breaker slot(s) {', '.join(freed)}"
                           if freed else None)
    if not is_ours(site, info.reason):
        note = f"drained by an operator ({info.reason}): left alone"
        logger.info("%s %s", node, note)
        return ResumeCheck(False, note)
    ok, note = passes_for_resume(site, info.reason, statuses)
    if ok:
        ok, dcgm_note = dcgm_gate(site, before_resume)
        note = f"{note}; {dcgm_note}" if ok and dcgm_note else dcgm_note or note
    if not ok:
        logger.warning("%s stays drained (%s): %s", node, info.reason, note)
        return ResumeCheck(False, note)
    gate = local if not local.enforce else cluster_actions(
        local, client.reservations(timeout_s=site.health.drain_timeout_s))
    if not gate.enforce:
        why = f"{gate.why('resume')} ({note})"
        logger.warning("NOT resuming %s: %s", node, why)
        return ResumeCheck(False, why, gated=gate.mode)
    out = resume_node(client, site, node)
    if out.drained:
        logger.warning("resumed %s (was: %s): %s", node, info.reason, note)
        return ResumeCheck(True, note)
    return ResumeCheck(False, out.why_not)
