"""The fleet breaker's arithmetic and parsing (pure functions; the races themselves run
against the real slurmctld in tests/fleet/test_breaker_cluster.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bluevela.errors import SlurmError, SlurmUnreachable
from bluevela.fleet.nodestate import (
    SLOT_START_IN_S,
    breaker_limit,
    budgets,
    parse_slots,
    slot_key,
    slot_name,
)
from bluevela.site import Site
from bluevela.slurm.cli_client import parse_reservation_line
from bluevela.slurm.client import NodeInfo, ReservationInfo

REPO = Path(__file__).resolve().parents[2]

# Verbatim `scontrol show reservation -o` lines from Slurm 22.05.8 on the dev cluster.
SLOT_LINE = (
    "ReservationName=bv-drain-debug-0 StartTime=2036-11-23T04:52:04 EndTime=2036-11-23T04:53:04 "
    "Duration=00:01:00 Nodes=node3 NodeCnt=1 CoreCnt=2 Features=(null) PartitionName=(null) "
    "Flags=OVERLAP,IGNORE_JOBS,SPEC_NODES TRES=cpu=2 Users=root Groups=(null) Accounts=(null) "
    "Licenses=(null) State=INACTIVE BurstBuffer=(null) Watts=n/a MaxStartDelay=(null)")
OPERATOR_LINE = (
    "ReservationName=op2 StartTime=2026-11-26T04:52:16 EndTime=2027-11-26T04:52:16 "
    "Duration=365-00:00:00 Nodes=node[1-16] NodeCnt=16 CoreCnt=32 Features=(null) "
    "PartitionName=(null) Flags=MAINT,SPEC_NODES TRES=cpu=32 Users=root Groups=(null) "
    "Accounts=(null) Licenses=(null) State=ACTIVE BurstBuffer=(null) Watts=n/a "
    "MaxStartDelay=(null)")


@pytest.mark.parametrize(("total", "pct", "limit"), [
    (16, 15.0, 3), (3, 15.0, 1), (20, 15.0, 3), (40, 15.0, 6), (16, 40.0, 7), (16, 0.0, 0),
    (16, 100.0, 16), (0, 15.0, 0), (10, 10.0, 1),
])
def test_limit_is_ceil_of_the_share(total: int, pct: float, limit: int) -> None:
    """The same bound the read-then-drain breaker had (16 nodes at 15%: 3), now enforced."""
    assert breaker_limit(total, pct) == limit


def test_reservation_lines_parse_and_only_slots_count() -> None:
    res = [parse_reservation_line(SLOT_LINE), parse_reservation_line(OPERATOR_LINE)]
    assert parse_reservation_line("No reservations in the system") is None
    slot_res = res[0]
    assert isinstance(slot_res, ReservationInfo) and slot_res.nodes == ("node3",)
    assert "IGNORE_JOBS" in slot_res.flags
    slots = parse_slots([r for r in res if r is not None])
    assert [(s.name, s.key, s.index, s.node) for s in slots] == [
        ("bv-drain-debug-0", "debug", 0, "node3")]
    created = slots[0].created
    assert created is not None
    assert created == time.mktime(time.strptime("2036-11-23T04:52:04", "%Y-%m-%dT%H:%M:%S")) \
        - SLOT_START_IN_S


def test_slot_names_are_safe_and_parseable() -> None:
    assert slot_name("gpu-h100", 2) == "bv-drain-gpu_h100-2"
    assert slot_key("a b;c") == "a_b_c"
    info = ReservationInfo(slot_name("gpu-h100", 12), ("gpu001",), None)
    assert [(s.key, s.index) for s in parse_slots([info])] == [("gpu_h100", 12)]
    # A reservation that only looks like a slot (two nodes) is not one.
    assert parse_slots([ReservationInfo("bv-drain-debug-1", ("n1", "n2"), None)]) == []


def test_older_drains_without_a_slot_shrink_the_free_range(site: Site) -> None:
    """Two nodes drained by bv before the slots existed, one slot held: with a limit of 3
    no slot is free (2 + 1 = 3); an operator's drain does not count."""
    nodes = [NodeInfo(f"node{i}", "IDLE", "", ("debug",)) for i in range(1, 17)]
    nodes[0] = NodeInfo("node1", "IDLE+DRAIN", "bv: ib: port down", ("debug",))
    nodes[1] = NodeInfo("node2", "IDLE+DRAIN", "bv: gpu: XID 79", ("debug",))
    nodes[2] = NodeInfo("node3", "IDLE+DRAIN", "maint: dimm swap", ("debug",))
    slots = parse_slots([ReservationInfo("bv-drain-debug-2", ("node9",), None)])
    (b,) = budgets(site, nodes, slots, ["debug"])
    assert (b.total, b.limit, b.unslotted, b.used, b.free()) == (16, 3, ("node1", "node2"), 3, [])
    (b,) = budgets(site, nodes, [], ["debug"])
    assert b.free() == [0]
    assert b.why(site).startswith("fleet breaker: 2/16 nodes already drained by bv: in "
                                  "partition debug (limit 15% = 3 node(s))")


@pytest.mark.parametrize(("unslotted", "held", "free"), [
    (0, [], [0, 1, 2]), (0, [2], [0, 1]), (1, [2], [0]), (2, [2], []), (1, [0], [1]),
    (3, [], []), (0, [0, 1, 2], []),
])
def test_free_slots_never_let_the_total_pass_the_limit(site: Site, unslotted: int,
                                                       held: list[int], free: list[int]) -> None:
    """Whatever subset of the free names concurrent callers win, drains <= limit (3)."""
    nodes = [NodeInfo(f"node{i}", "IDLE", "", ("debug",)) for i in range(1, 17)]
    for i in range(unslotted):
        nodes[i] = NodeInfo(f"node{i + 1}", "IDLE+DRAIN", "bv: ib: port down", ("debug",))
    slots = parse_slots([ReservationInfo(f"bv-drain-debug-{i}", (f"node{10 + i}",), None)
                         for i in held])
    (b,) = budgets(site, nodes, slots, ["debug"])
    assert b.free() == free
    assert unslotted + len(held) + len(free) <= b.limit


def test_a_drain_that_fails_after_winning_a_slot_keeps_the_slot_counted(site: Site) -> None:
    from bluevela.fleet.nodestate import DrainFailed, drain_node
    from bluevela.hooks.phases import DrainResult
    from tests.fakes import SlowControllerSlurm

    slurm = SlowControllerSlurm("gpu007")
    with pytest.raises(DrainFailed) as info:
        drain_node(slurm, site, "gpu007", "ib: mlx5_0/1 state DOWN")  # type: ignore[arg-type]
    assert info.value.slots == tuple(slurm.created) and len(slurm.created) == 1
    # The slot was not given back: no delete reached the controller, and the next drain's
    # read of the reservations counts it against the partition's breaker.
    assert slurm.deleted == []
    held = parse_slots(slurm.reservations())  # type: ignore[arg-type]
    assert [(s.name, s.node) for s in held] == [(slurm.created[0], "gpu007")]
    (budget,) = budgets(site, slurm.nodes_, held, ["debug"])
    assert budget.used == 1 and len(budget.free()) == budget.limit - 1
    # The prolog exits 1 for it (counted: Slurm may drain it); not for a failure before a slot.
    assert DrainResult(True, False, "r", error="timeout", slot_held=True).prolog_exit() == 1
    assert DrainResult(True, False, "r", error="unreachable").prolog_exit() == 0
    assert DrainResult(True, False, "r", why_not="fleet breaker: 3/16").prolog_exit() == 0
    assert DrainResult(True, True, "r").prolog_exit() == 1
    assert DrainResult().prolog_exit() == 0


@pytest.mark.parametrize(("rc", "err", "create", "delete"), [
    (0, "", True, True),
    (1, "Error creating the reservation: Duplicate reservation name", False, SlurmError),
    (1, "Error deleting the reservation: Requested reservation is invalid", SlurmError, False),
    (1, "Error creating the reservation: Unable to contact slurm controller (connect failure)",
     SlurmUnreachable, SlurmUnreachable),
    (1, "Error: Requested node configuration is not available", SlurmError, SlurmError),
])
def test_a_slots_reservation_answer(monkeypatch: pytest.MonkeyPatch, rc: int, err: str,
                                    create: bool | type[Exception],
                                    delete: bool | type[Exception]) -> None:
    """What scontrol answered a slot's create or delete: done, already so (the name is taken,
    the reservation is gone), slurmctld unreachable, or refused with Slurm's own line."""
    import subprocess

    from bluevela.slurm.cli_client import CliSlurmClient

    argvs: list[list[str]] = []

    def run_once(self: CliSlurmClient, argv: list[str], **kw: object
                 ) -> subprocess.CompletedProcess[str]:
        argvs.append(list(argv))
        return subprocess.CompletedProcess(argv, rc, "", err)

    monkeypatch.setattr(CliSlurmClient, "_run_once", run_once)
    client = CliSlurmClient(retry_s=0)
    for call, want in ((lambda: client.create_reservation(
            "bv-slot-1", "node1", start_in_s=0, duration_min=5, flags=("MAINT",)), create),
                       (lambda: client.delete_reservation("bv-slot-1"), delete)):
        if isinstance(want, bool):
            assert call() is want
        else:
            with pytest.raises(want) as exc:
                call()
            assert type(exc.value) is want and str(exc.value).endswith(err)
    assert argvs[1] == ["scontrol", "delete", "ReservationName=bv-slot-1"]
