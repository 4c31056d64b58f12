"""Random event orders through the real supervisor and its steps (issue 33): hellos early and
late or never, rank failures, nodes that die or fall silent or ignore the abort, SIGUSR1 and
SIGTERM at any moment, grows that add a node, fail or are stopped by SIGTERM, the connect
timeout. Seeded and bounded (a few seconds); each case checks the invariants:

- I1: a healthy node (alive, connected within --connect-timeout, answering the abort) is never
  lost nor excluded for another's failure;
- I2: a node that died in a step is named in that step's goodput `end`, and let go of when the
  job is requeued after it;
- I3: after a SIGTERM the job exits: no requeue, no later launch;
- I4: a finished job (a step that ended OK) is never requeued nor relaunched;
- I5: every launch's goodput record gets its `end`.

Uses only tests/step_script.py and the supervisor's `Options`: it runs on the code before
issue 33 as well (PYTHONPATH=<a worktree of 18227e1>), where it finds I1, I2 and I3.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from bluevela.goodput.outcome import StepEnd
from bluevela.launch.supervisor import Options
from tests.step_script import (
    CFG,
    GrowPlan,
    Launch,
    NodeScript,
    RecordingLog,
    ScriptedSupervisor,
    Stuck,
    scripted_job,
)

CASES = int(os.environ.get("BV_RANDOM_CASES", "120"))
SEED = int(os.environ.get("BV_RANDOM_SEED", "33"))


def node_script(rng: random.Random) -> NodeScript:
    r = rng.random()
    at = round(rng.uniform(0.2, 3.0), 2)
    # every training ends at some point (else a case without a failure would run forever)
    done = round(rng.uniform(0.5, 4.0) if rng.random() < 0.5 else rng.uniform(4.0, 8.0), 2)
    if r < 0.40:
        return NodeScript(done_at=done)
    if r < 0.52:
        return NodeScript(fail_at=at)
    if r < 0.62:
        return NodeScript(die_at=at)
    if r < 0.70:
        return NodeScript(mute_at=at)
    if r < 0.85:
        return NodeScript(hello_at=round(rng.uniform(0.3, 5.0), 2), done_at=done)
    if r < 0.90:
        return NodeScript(hello_at=None if rng.random() < 0.5 else CFG.connect_timeout + 20)
    if r < 0.95:
        return NodeScript(abort_s=None, done_at=done)
    return NodeScript(hello_at=at, fail_at=at + 0.3, done_at=done)


def job_case(seed: int) -> tuple[list[str], dict[str, object], list[Launch], GrowPlan]:
    rng = random.Random(seed)
    n, spare = rng.choice((2, 3)), rng.choice((0, 0, 1))
    alloc = [f"n{i}" for i in range(1, n + spare + 1)]
    opts: dict[str, object] = {"spare_nodes": spare, "max_relaunches": 3,
                               "grow_deadline": rng.choice((0, 60))}
    launches = []
    for _ in range(4):
        sigs: list[tuple[float, int]] = []
        if rng.random() < 0.3:
            sigs.append((round(rng.uniform(0, 4), 2), signal.SIGUSR1))
        if rng.random() < 0.2:
            sigs.append((round(rng.uniform(0, 4), 2), signal.SIGTERM))
        scripts = {node: node_script(rng) for node in [*alloc, "g1", "g2", "g3"]}
        launches.append(Launch(scripts, sigs))
    grow = rng.choice((GrowPlan(), GrowPlan(ok=False), GrowPlan(sigterm=True)))
    return alloc, opts, launches, grow


def healthy(script: NodeScript) -> bool:
    return script.healthy(CFG.connect_timeout) and script.abort_s is not None


def run_case(seed: int) -> tuple[ScriptedSupervisor, RecordingLog, GrowPlan]:
    alloc, opts, launches, grow = job_case(seed)
    nodes = len(alloc) - int(opts["spare_nodes"])  # type: ignore[call-overload]

    def launch(i: int, _: object) -> Launch:
        return launches[min(i, len(launches)) - 1]

    with scripted_job() as log:
        sup = ScriptedSupervisor(
            Options(nodes=nodes, torchrun=["torchrun", "t.py"], **opts),  # type: ignore[arg-type]
            alloc, launch, grow)
        sup.run()
    return sup, log, grow


def check_job(seed: int) -> list[str]:
    """The invariants this case breaks (empty: none)."""
    sup, log, grow = run_case(seed)
    broken: list[str] = []
    calls = sup.slurm.calls  # type: ignore[attr-defined]
    requeued = "requeue" in calls
    unhealthy: set[str] = set()
    for i, (driver, result) in enumerate(zip(sup.drivers, sup.results, strict=True)):
        scripts = {n: a.script for n, a in driver.agents.items()}
        unhealthy |= {n for n, s in scripts.items() if not healthy(s)}
        good = {n for n, s in scripts.items() if healthy(s)}
        if set(result.lost) & good:
            broken.append(f"I1 healthy node(s) {sorted(set(result.lost) & good)} lost in "
                          f"step {i + 1} ({result.cause})")
        died = {n for n, a in driver.agents.items() if a.sock is not None and a.gone
                and a.exit_at is None}
        reported = set(log.ends[i][1]) if i < len(log.ends) else set()
        if died - reported:
            broken.append(f"I2 node(s) {sorted(died - reported)} died in step {i + 1} and "
                          f"its goodput end does not name them ({result.kind.value})")
        last = i == len(sup.results) - 1
        if last and requeued and died and not sup.grows and not calls[0].startswith("keep_only"):
            broken.append(f"I2 node(s) {sorted(died)} died and the requeue did not let go of "
                          "them")
        if any(s == signal.SIGTERM for _, s in driver.delivered) and (requeued or not last):
            broken.append(f"I3 SIGTERM in step {i + 1} and the job was "
                          f"{'requeued' if requeued else 'relaunched'}")
        if result.kind is StepEnd.OK and (requeued or not last):
            broken.append(f"I4 step {i + 1} finished and the job went on")
    if grow.sigterm and sup.grows and requeued:
        broken.append("I3 SIGTERM during a grow and the job was requeued")
    if set(sup.excluded) - unhealthy:
        broken.append(f"I1 healthy node(s) {sorted(set(sup.excluded) - unhealthy)} excluded")
    if len(log.ends) != len(log.launches):
        broken.append(f"I5 {len(log.launches)} launches, {len(log.ends)} ends")
    return broken


def test_random_event_orders_keep_the_invariants(capsys: pytest.CaptureFixture[str]) -> None:
    failures = {}
    for seed in range(SEED, SEED + CASES):
        try:
            broken = check_job(seed)
        except Stuck as exc:
            broken = [f"I0 {exc}"]
        if broken:
            failures[seed] = broken
    capsys.readouterr()  # the banners and end lines of every case
    found: dict[str, list[int]] = {}
    for seed, broken in failures.items():
        for line in broken:
            found.setdefault(line[:2], []).append(seed)
    assert not failures, "\n".join(
        [f"{inv}: {len(seeds)} case(s), e.g. seed {seeds[0]}: "
         f"{next(b for b in failures[seeds[0]] if b.startswith(inv))}"
         for inv, seeds in sorted(found.items())])


def test_the_cases_reach_every_kind_of_end() -> None:
    """The generator is not vacuous: its cases end steps in each way the step can."""
    kinds: set[StepEnd] = set()
    grew = 0
    for seed in range(SEED, SEED + 60):
        sup, _, _ = run_case(seed)
        kinds |= {r.kind for r in sup.results}
        grew += bool(sup.grows)
    assert kinds >= {StepEnd.OK, StepEnd.FAILED, StepEnd.LOST, StepEnd.SIGNAL,
                     StepEnd.TERMINATED}, kinds
    assert grew
