"""The step and the supervisor as state machines (issue 33): each transition is a row, driven
through the real `Step`/`Supervisor` with scripted agents, signals and grows
(tests/step_script.py); the tables themselves refuse what they do not list."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from bluevela.goodput.outcome import LossKind, StepEnd
from bluevela.launch.events_log import EventLog
from bluevela.launch.step import (
    STEP_TRANSITIONS,
    Endpoints,
    Signals,
    StepPhase,
    TransitionError,
    check_transition,
)
from bluevela.launch.supervisor import TRANSITIONS, Options, Phase
from tests.step_script import (
    CFG,
    FakeTime,
    GrowPlan,
    Launch,
    NodeScript,
    ScriptedSupervisor,
    StepDriver,
    scripted_job,
)

N3 = ("n1", "n2", "n3")
USR1, TERM = signal.SIGUSR1, signal.SIGTERM


@dataclass(frozen=True)
class Row:
    scripts: dict[str, NodeScript]
    signals: list[tuple[float, int]]
    kind: StepEnd
    lost: dict[str, LossKind]
    told: dict[str, list[str]] = field(default_factory=dict)  # node -> what it was told


S = NodeScript
STEP_ROWS = {
    "every node exits 0: ok": Row({n: S(done_at=1) for n in N3}, [], StepEnd.OK, {}),
    "a rank fails, all answer the abort: failed": Row(
        {"n1": S(fail_at=1)}, [], StepEnd.FAILED, {}, {"n2": ["go", "abort"]}),
    "a hello while the step ends gets abort, and the node is not lost": Row(
        {"n1": S(fail_at=1), "n2": S(hello_at=1.3)}, [], StepEnd.FAILED, {},
        {"n2": ["abort"]}),
    "a node still within its connect timeout at the abort is not lost": Row(
        {"n1": S(fail_at=1), "n3": S(hello_at=None)}, [], StepEnd.FAILED, {}),
    "a node never connected past --connect-timeout is lost": Row(
        {"n3": S(hello_at=None)}, [], StepEnd.LOST, {"n3": LossKind.NEVER_CONNECTED}),
    "a closed connection: lost": Row(
        {"n2": S(die_at=1)}, [], StepEnd.LOST, {"n2": LossKind.CLOSED},
        {"n1": ["go", "abort"]}),
    "a silent node: lost": Row({"n2": S(mute_at=1)}, [], StepEnd.LOST, {"n2": LossKind.SILENT}),
    "a node silent after the abort: lost": Row(
        {"n1": S(fail_at=1), "n2": S(mute_at=1.05)}, [], StepEnd.LOST,
        {"n2": LossKind.SILENT}),
    "a node that pings but does not answer the abort: lost": Row(
        {"n1": S(fail_at=1), "n2": S(abort_s=None)}, [], StepEnd.LOST,
        {"n2": LossKind.NO_ABORT_ANSWER}),
    "the checkpoint signal: signal": Row({}, [(1, USR1)], StepEnd.SIGNAL, {},
                                         {"n1": ["go", "usr1"]}),
    "a node lost in the checkpoint window is in the result": Row(
        {"n2": S(die_at=1.1)}, [(1, USR1)], StepEnd.SIGNAL, {"n2": LossKind.CLOSED}),
    "a hello after the signal gets go and the request": Row(
        {"n3": S(hello_at=0.5)}, [(0.2, USR1)], StepEnd.SIGNAL, {}, {"n3": ["go", "usr1"]}),
    "SIGTERM: terminated": Row({}, [(1, TERM)], StepEnd.TERMINATED, {}),
    "SIGTERM after SIGUSR1: terminated": Row({"n1": S(ckpt_s=2)}, [(1, USR1), (1.5, TERM)],
                                             StepEnd.TERMINATED, {}),
    "a signal while the step ends changes nothing of the step's end": Row(
        {"n1": S(fail_at=1)}, [(1.1, TERM)], StepEnd.FAILED, {}, {"n2": ["go", "abort"]}),
}


@pytest.mark.parametrize("name", list(STEP_ROWS))
def test_a_step_transition(name: str, io: tuple[Signals, Endpoints]) -> None:
    row = STEP_ROWS[name]
    signals, ends = io
    driver = StepDriver(N3, row.scripts, signals, ends, EventLog(None, "h"), FakeTime(),
                        row.signals)
    result = driver.run()
    assert result.kind is row.kind, result
    assert {n: loss.kind for n, loss in result.lost.items()} == row.lost, result
    for node, told in row.told.items():
        assert driver.agents[node].got == told, (node, driver.agents[node].got)
    assert driver.step.phase is StepPhase.DONE


def test_the_abort_waits_for_connected_agents_only(io: tuple[Signals, Endpoints]) -> None:
    """A node whose agent never connected is not waited for after an abort: the step ends
    once the agents told to abort have answered (not at --node-timeout + the grace)."""
    signals, ends = io
    driver = StepDriver(N3, {"n1": S(fail_at=1), "n3": S(hello_at=None)}, signals, ends,
                        EventLog(None, "h"), FakeTime())
    driver.run()
    assert driver.ended_at is not None and driver.ended_at < 1 + CFG.node_timeout


@pytest.mark.parametrize(("old", "new"), [
    (StepPhase.ENDING, StepPhase.RUNNING), (StepPhase.SIGNALLED, StepPhase.ENDING),
    (StepPhase.DONE, StepPhase.STARTING), (StepPhase.RUNNING, StepPhase.STARTING)])
def test_the_step_table_refuses_what_it_does_not_list(old: StepPhase, new: StepPhase) -> None:
    with pytest.raises(TransitionError, match=f"{old.name} -> {new.name}"):
        check_transition(STEP_TRANSITIONS, old, new)


@pytest.mark.parametrize(("old", "new"), [
    (Phase.REQUEUEING, Phase.LAUNCHING), (Phase.EXITING, Phase.LAUNCHING),
    (Phase.GROWING, Phase.GROWING), (Phase.LAUNCHING, Phase.GROWING)])
def test_the_supervisor_table_refuses_what_it_does_not_list(old: Phase, new: Phase) -> None:
    with pytest.raises(TransitionError):
        check_transition(TRANSITIONS, old, new)


def test_every_phase_has_a_row_and_done_and_exiting_are_final() -> None:
    assert set(STEP_TRANSITIONS) == set(StepPhase) and set(TRANSITIONS) == set(Phase)
    assert STEP_TRANSITIONS[StepPhase.DONE] == frozenset()
    assert TRANSITIONS[Phase.EXITING] == frozenset()


# --------------------------------------------------------------------------------------------
# The supervisor


@dataclass(frozen=True)
class JobRow:
    alloc: tuple[str, ...]
    launches: tuple[Launch, ...]  # one per launch; the last repeats
    grow: GrowPlan
    rc: int
    slurm: tuple[str, ...]  # the Slurm calls, in order
    kinds: tuple[StepEnd, ...]  # each step's end, as the goodput record has it
    opts: dict[str, object] = field(default_factory=dict)


DONE = Launch({n: S(done_at=1) for n in ("n1", "n2", "n3", "g1")})
N2_DIES = Launch({"n2": S(die_at=1)})
JOB_ROWS = {
    "a finished job exits 0": JobRow(N3[:2], (DONE,), GrowPlan(), 0, (), (StepEnd.OK,)),
    "a lost node, a spare: relaunched": JobRow(
        N3, (N2_DIES, DONE), GrowPlan(), 0, (), (StepEnd.LOST, StepEnd.OK),
        {"spare_nodes": 1}),
    "a lost node, no spare, growth: relaunched on the grown node": JobRow(
        N3[:2], (N2_DIES, DONE), GrowPlan(), 0, (), (StepEnd.LOST, StepEnd.OK),
        {"grow_deadline": 60}),
    "a lost node, no spare, no growth: let go of, requeued": JobRow(
        N3[:2], (N2_DIES,), GrowPlan(), 0, ("keep_only n1", "requeue"), (StepEnd.LOST,)),
    "SIGTERM during a grow: the job exits, never requeued": JobRow(
        N3[:2], (N2_DIES,), GrowPlan(sigterm=True), 143, (), (StepEnd.LOST,),
        {"grow_deadline": 60}),
    "a node lost in the checkpoint window: let go of at the requeue": JobRow(
        N3, (Launch({"n2": S(die_at=1.1)}, [(1, USR1)]),), GrowPlan(), 0,
        ("keep_only n[1,3]", "requeue"), (StepEnd.SIGNAL,)),
    "SIGTERM in a step: the job exits": JobRow(
        N3[:2], (Launch({}, [(1, TERM)]),), GrowPlan(), 143, (), (StepEnd.TERMINATED,)),
    "SIGUSR1 while the step ends: requeued, not relaunched": JobRow(
        N3, (Launch({"n2": S(die_at=1)}, [(1.1, USR1)]),), GrowPlan(), 0,
        ("keep_only n[1,3]", "requeue"), (StepEnd.LOST,), {"spare_nodes": 1}),
}


def run_job(alloc: Sequence[str], launches: Sequence[Launch], grow: GrowPlan,
            **opts: object) -> tuple[int, ScriptedSupervisor, list[tuple[StepEnd, dict]]]:
    nodes = len(alloc) - int(opts.get("spare_nodes", 0))  # type: ignore[call-overload]
    options = Options(nodes=nodes, torchrun=["torchrun", "t.py"], **opts)  # type: ignore[arg-type]
    with scripted_job() as log:
        sup = ScriptedSupervisor(options, alloc,
                                 lambda i, _: launches[min(i, len(launches)) - 1], grow)
        rc = sup.run()
    return rc, sup, log.ends


@pytest.mark.parametrize("name", list(JOB_ROWS))
def test_a_supervisor_transition(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    row = JOB_ROWS[name]
    rc, sup, ends = run_job(row.alloc, row.launches, row.grow, **row.opts)
    assert rc == row.rc, capsys.readouterr().out
    assert tuple(sup.slurm.calls) == row.slurm  # type: ignore[attr-defined]
    assert tuple(kind for kind, _ in ends) == row.kinds
    assert sup.phase is Phase.EXITING and sup.ends is None and sup.signals is None


def test_the_goodput_end_names_a_node_lost_in_the_checkpoint_window() -> None:
    _, _, ends = run_job(N3, (Launch({"n2": S(die_at=1.1)}, [(1, USR1)]),), GrowPlan())
    assert ends == [(StepEnd.SIGNAL, {"n2": ends[0][1]["n2"]})]
    assert ends[0][1]["n2"].kind is LossKind.CLOSED


def test_the_record_line_says_what_came_next(capsys: pytest.CaptureFixture[str]) -> None:
    from bluevela.launch.attempts import bv_attempts

    run_job(N3[:2], (N2_DIES, DONE), GrowPlan(), grow_deadline=60)
    got = [(a["grown"], a["grow_s"], a["slurm_requeue"])
           for a in bv_attempts(capsys.readouterr().out)]
    assert got == [("g1", 1.5, False), (None, None, False)]
