"""The step's end after a crash, without waits that cannot help (issue 37): with a node lost,
srun cannot end on its own (it waits for the dead node's tasks), so the step kills it at once
instead of waiting 0.5 s for it first; with every node alive (a hang, a failed rank) it still
gets its 0.5 s to end by itself. The real `Step` over scripted agents (tests/step_script.py)."""

from __future__ import annotations

import pytest

from bluevela.goodput.outcome import StepEnd
from bluevela.launch.events_log import EventLog
from bluevela.launch.step import Endpoints, Signals
from tests.step_script import FakeSrun, FakeTime, NodeScript, StepDriver


class RecordingSrun(FakeSrun):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        return super().wait(timeout)


@pytest.mark.parametrize(("scripts", "kind", "first_wait"), [
    ({"n2": NodeScript(die_at=1.0)}, StepEnd.LOST, 0.0),  # a crash: killed at once
    ({"n2": NodeScript(fail_at=1.0)}, StepEnd.FAILED, 0.5),  # all alive: srun may end by itself
])
def test_srun_is_not_waited_for_once_a_node_is_lost(
        io: tuple[Signals, Endpoints], scripts: dict[str, NodeScript], kind: StepEnd,
        first_wait: float) -> None:
    signals, ends = io
    driver = StepDriver(["n1", "n2"], scripts, signals, ends, EventLog(None, "h"), FakeTime())
    srun = RecordingSrun()
    driver.srun = driver.step.srun = srun  # type: ignore[assignment]
    assert driver.run().kind is kind
    assert srun.waits and srun.waits[0] == first_wait, srun.waits
