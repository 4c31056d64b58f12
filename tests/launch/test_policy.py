"""The relaunch policy (bluevela/launch/policy.py) from a table: every branch of what the
supervisor does after a step, with no socket, process or Slurm. Each row's words are the end
line's, as the supervisor has always written them (docs/resilience.md)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from bluevela.goodput.outcome import Loss, StepEnd
from bluevela.launch.policy import (
    GROWTH_OFF,
    NOTHING_TO_GROW_FROM,
    STOP_RC,
    Action,
    Allocation,
    Exit,
    Grow,
    Grown,
    JobSignal,
    PolicyOptions,
    Relaunch,
    Requeue,
    next_action,
)
from bluevela.launch.step_result import StepResult

N = ("node1", "node2", "node3", "node4")
STEP = ("node1", "node2", "node3")
FIXED = PolicyOptions(want=3, min_nodes=3)
GROWS = PolicyOptions(want=3, min_nodes=3, grow=True)
ELASTIC = PolicyOptions(want=3, min_nodes=2)
CLOSED, SILENT = Loss.closed(), Loss.silent(10)
HANG = "hang: rank 1 on node2 stopped first (no progress for 9 s)"
LOST2 = "node2 lost (its agent's connection closed: the node or its processes died)"
NO_ROOM = "no spare node (--spare-nodes) and no shrink (--min-nodes)"


def res(kind: StepEnd, cause: str = "x", rc: int = 1, lost: Mapping[str, Loss] | None = None,
        hang_node: str | None = None, hang_rank: int | None = None) -> StepResult:
    return StepResult(kind, rc, cause, dict(lost or {}), hang_node, hang_rank=hang_rank)


def at(nodes: tuple[str, ...] = N, step: tuple[str, ...] = STEP, launch: int = 1,
       excluded: Mapping[str, Loss] | None = None, grown: Grown | None = None,
       signal: JobSignal | None = None) -> Allocation:
    return Allocation(nodes, dict(excluded or {}), step, launch, grown, signal)


CASES: list[tuple[str, StepResult, Allocation, PolicyOptions, Action]] = [
    ("ok ends the job", res(StepEnd.OK, "exit 0", 0), at(), FIXED, Exit(0, "exit 0")),
    ("a rank failure ends it with its status",
     res(StepEnd.FAILED, "exit 3 (rank failure on node2)", 3), at(), FIXED,
     Exit(3, "exit 3 (rank failure on node2)")),
    ("a failure never ends 0", res(StepEnd.FAILED, "srun exited 0", 0), at(), FIXED,
     Exit(1, "srun exited 0")),
    ("SIGTERM: Slurm ends the job", res(StepEnd.TERMINATED, "SIGTERM from Slurm", 143), at(),
     FIXED, Exit(143, "SIGTERM from Slurm")),
    ("the checkpoint signal requeues", res(StepEnd.SIGNAL, "checkpoint signal", 0), at(), FIXED,
     Requeue("checkpoint signal")),
    ("a hang with a spare: the spare replaces the hung rank's node",
     res(StepEnd.HANG, HANG, hang_node="node2"), at(), FIXED,
     Relaunch(("node1", "node3", "node4"),
              f"{HANG}; relaunching on node[1,3-4] (spare node4 for node2; no Slurm requeue)",
              {"node2": Loss.hung()})),
    ("a hang without a spare: in place", res(StepEnd.HANG, HANG, hang_node="node2"),
     at(nodes=STEP), FIXED,
     Relaunch(STEP, f"{HANG}; relaunching on the same nodes (node[1-3]; no Slurm requeue)")),
    ("a hang whose spare is excluded: in place", res(StepEnd.HANG, HANG, hang_node="node2"),
     at(excluded={"node4": CLOSED}), FIXED,
     Relaunch(STEP, f"{HANG}; relaunching on the same nodes (node[1-3]; no Slurm requeue)")),
    ("a hang naming no node of the step: in place", res(StepEnd.HANG, HANG, hang_node=None),
     at(), FIXED,
     Relaunch(STEP, f"{HANG}; relaunching on the same nodes (node[1-3]; no Slurm requeue)")),
    ("a hang after max relaunches requeues", res(StepEnd.HANG, HANG, hang_node="node2"),
     at(launch=9), FIXED, Requeue(f"{HANG}; 8 relaunches done, requeued by bv")),
    ("the 8th relaunch still relaunches", res(StepEnd.HANG, HANG), at(nodes=STEP, launch=8),
     FIXED,
     Relaunch(STEP, f"{HANG}; relaunching on the same nodes (node[1-3]; no Slurm requeue)")),
    ("a hang, no spare, growth on: grow in place of the hung rank's node, keeping it for now",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1), at(nodes=STEP), GROWS,
     Grow(("node1", "node3"), ("node2",), 1, {}, alive=True)),
    ("a hang whose spare is excluded, growth on: grow",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1), at(excluded={"node4": CLOSED}),
     GROWS, Grow(("node1", "node3"), ("node2",), 1, {}, alive=True)),
    ("a hang with a spare, growth on: the spare, no grow",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1), at(), GROWS,
     Relaunch(("node1", "node3", "node4"),
              f"{HANG}; relaunching on node[1,3-4] (spare node4 for node2; no Slurm requeue)",
              {"node2": Loss.hung()})),
    ("a hang on a one-node job, growth on: nothing to keep, in place",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=0), at(nodes=("node2",),
                                                                 step=("node2",)),
     PolicyOptions(want=1, min_nodes=1, grow=True),
     Relaunch(("node2",), f"{HANG}; relaunching on the same nodes (node2; no Slurm requeue)")),
    ("a hang, grown: relaunch on the grown node, the end line says which node and why",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1),
     at(nodes=("node1", "node3", "node4"), grown=Grown(("node4",), 2.04, released=("node2",))),
     GROWS,
     Relaunch(("node1", "node3", "node4"),
              f"{HANG}; grown node4 in place of node2 (rank 1 hung there): relaunching on "
              "node[1,3-4] (grown node4 in 2.0 s, same job, no Slurm requeue)",
              {"node2": Loss.hung()})),
    ("a hang, not grown: relaunch in place (the nodes are alive: no requeue)",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1),
     at(nodes=STEP, grown=Grown(why="no node granted in 15 s (timeout)")),
     GROWS, Relaunch(STEP, f"{HANG}; no node grown in place of node2 (no node granted in 15 s "
                     "(timeout)): relaunching on the same nodes (node[1-3]; no Slurm requeue)")),
    ("a hang, not grown after letting go of the hung node: requeue, no second let-go",
     res(StepEnd.HANG, HANG, hang_node="node2", hang_rank=1),
     at(nodes=("node1", "node3"), step=STEP,
        grown=Grown(why="the job did not take the new node", released=("node2",))), GROWS,
     Requeue(f"{HANG}; no node grown (the job did not take the new node) and node2 let go; no "
             "healthy node left to relaunch on in this allocation (need 3), requeued by bv",
             (), {"node2": Loss.hung()})),
    ("a lost node with a spare", res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}), at(), FIXED,
     Relaunch(("node1", "node3", "node4"), f"{LOST2}; relaunching on node[1,3-4] (spare node4)",
              {"node2": CLOSED})),
    ("a hang that lost a node is a lost node",
     res(StepEnd.HANG, HANG, lost={"node3": SILENT}, hang_node="node2"), at(), FIXED,
     Relaunch(("node1", "node2", "node4"), f"{HANG}; relaunching on node[1-2,4] (spare node4)",
              {"node3": SILENT})),
    ("a lost node, elastic: fewer nodes", res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=STEP), ELASTIC,
     Relaunch(("node1", "node3"), f"{LOST2}; relaunching on 2 of 3 nodes (node[1,3])",
              {"node2": CLOSED})),
    ("a lost node after max relaunches: let go and requeue",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}), at(launch=9), FIXED,
     Requeue(f"{LOST2}; 8 relaunches done: the job lets go of node2 and is requeued by bv",
             ("node2",), {"node2": CLOSED})),
    ("no room, growth off: let go and requeue", res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=STEP), FIXED,
     Requeue(f"{LOST2}; {NO_ROOM}; no node grown ({GROWTH_OFF}): the job lets go of node2 "
             "and is requeued by bv", ("node2",), {"node2": CLOSED})),
    ("no room, growth on: grow in place of the lost node",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}), at(nodes=STEP), GROWS,
     Grow(("node1", "node3"), ("node2",), 1, {"node2": CLOSED})),
    ("two lost, growth on: grow by two",
     res(StepEnd.LOST, "two", lost={"node3": SILENT, "node2": CLOSED}), at(nodes=STEP), GROWS,
     Grow(("node1",), ("node2", "node3"), 2, {"node3": SILENT, "node2": CLOSED})),
    ("every node lost: nothing to grow from",
     res(StepEnd.LOST, "all", lost={n: CLOSED for n in STEP}), at(nodes=STEP), GROWS,
     Requeue(f"all; {NO_ROOM}; no node grown ({NOTHING_TO_GROW_FROM}): the job lets go of "
             "node[1-3] and is requeued by bv", STEP, {n: CLOSED for n in STEP})),
    ("grown: relaunch on the new node, same job",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=("node1", "node3", "node5"), excluded={"node2": CLOSED},
        grown=Grown(("node5",), 3.14, released=("node2",))), GROWS,
     Relaunch(("node1", "node3", "node5"), f"{LOST2}; relaunching on node[1,3,5] (grown node5 "
              "in 3.1 s, same job, no Slurm requeue)", {"node2": CLOSED})),
    ("not grown after letting go: requeue without a second let-go",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=STEP, excluded={"node2": CLOSED},
        grown=Grown(why="no node granted in 15 s (timeout)", released=("node2",))), GROWS,
     Requeue(f"{LOST2}; {NO_ROOM}; no node grown (no node granted in 15 s (timeout)): the job "
             "lets go of node2 and is requeued by bv", (), {"node2": CLOSED})),
    ("not grown before letting go: the requeue lets go",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=STEP, grown=Grown(why="job 5 is PENDING, not RUNNING")), GROWS,
     Requeue(f"{LOST2}; {NO_ROOM}; no node grown (job 5 is PENDING, not RUNNING): the job lets "
             "go of node2 and is requeued by bv", ("node2",), {"node2": CLOSED})),
    ("grown too few: requeue, saying nothing of the grow",
     res(StepEnd.LOST, "two", lost={"node2": CLOSED, "node3": CLOSED}),
     at(nodes=("node1", "node5"), grown=Grown(("node5",), 2.0, released=("node2", "node3"))),
     GROWS,
     Requeue(f"two; {NO_ROOM}: the job lets go of node[2-3] and is requeued by bv", (),
             {"node2": CLOSED, "node3": CLOSED})),
]


@pytest.mark.parametrize(("result", "alloc", "opts", "want"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_next_action(result: StepResult, alloc: Allocation, opts: PolicyOptions,
                     want: Action) -> None:
    assert next_action(result, alloc, opts) == want


def test_every_step_end_has_a_row() -> None:
    assert {c[1].kind for c in CASES} == set(StepEnd)


def test_the_policy_keeps_no_state() -> None:
    """Asking twice gives the same answer and changes nothing it was given."""
    alloc = at()
    result = res(StepEnd.HANG, HANG, hang_node="node2")
    assert next_action(result, alloc, FIXED) == next_action(result, alloc, FIXED)
    assert alloc.excluded == {} and result.lost == {}


# -- the job's signal, whenever it came (issue 33): Allocation.signal ---------------------------

SIGNAL_CASES: list[tuple[str, StepResult, Allocation, PolicyOptions, Action]] = [
    ("a node lost in the checkpoint window is let go of at the requeue",
     res(StepEnd.SIGNAL, "checkpoint signal", 0, lost={"node2": CLOSED}), at(), FIXED,
     Requeue("checkpoint signal", ("node2",), {"node2": CLOSED})),
    ("SIGTERM during a grow (or any time after the step): exit, never requeue",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}),
     at(nodes=STEP, grown=Grown(why="the job is ending (SIGTERM): grow stopped"),
        signal=JobSignal.STOP), GROWS,
     Exit(STOP_RC, f"{LOST2}; SIGTERM from Slurm while the step ended: the job ends here (not "
          "relaunched, not requeued by bv)")),
    ("SIGTERM after a hang: exit, not a relaunch in place",
     res(StepEnd.HANG, HANG, hang_node="node2"), at(signal=JobSignal.STOP), FIXED,
     Exit(STOP_RC, f"{HANG}; SIGTERM from Slurm while the step ended: the job ends here (not "
          "relaunched, not requeued by bv)")),
    ("SIGUSR1 while the step ended: requeue (letting go of the lost node), not a relaunch",
     res(StepEnd.LOST, LOST2, lost={"node2": CLOSED}), at(signal=JobSignal.CHECKPOINT), FIXED,
     Requeue(f"{LOST2}; the checkpoint signal came while the step ended: requeued by bv",
             ("node2",), {"node2": CLOSED})),
    ("a finished step is never requeued, whatever signal followed",
     res(StepEnd.OK, "exit 0", 0), at(signal=JobSignal.CHECKPOINT), FIXED, Exit(0, "exit 0")),
    ("a rank failure keeps its status after SIGTERM",
     res(StepEnd.FAILED, "exit 3", 3), at(signal=JobSignal.STOP), FIXED, Exit(3, "exit 3")),
]


@pytest.mark.parametrize(("result", "alloc", "opts", "want"), [c[1:] for c in SIGNAL_CASES],
                         ids=[c[0] for c in SIGNAL_CASES])
def test_next_action_after_a_signal(result: StepResult, alloc: Allocation,
                                    opts: PolicyOptions, want: Action) -> None:
    assert next_action(result, alloc, opts) == want
