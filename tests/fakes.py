"""The only fakes in the suite: a clock and a sleep that advance without waiting.

Slurm is never faked (tests that talk to Slurm use the real dev cluster); hardware is replayed
from recorded fixtures in tests/data/, not from objects that return what a test wants.
"""

from __future__ import annotations

import time


class FakeClock:
    """monotonic() and sleep() over a virtual time line."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class _RecordedEvent:
    def __init__(self, cuda: RecordingCuda) -> None:
        self._cuda = cuda
        self.at_ms = float("nan")

    def record(self) -> None:
        self._cuda.calls.append("record")
        self.at_ms = self._cuda.clock_ms

    def synchronize(self) -> None:
        self._cuda.calls.append("event-sync")

    def elapsed_time(self, end: _RecordedEvent) -> float:
        return end.at_ms - self.at_ms


class RecordingCuda:
    """Stands in for `torch` in a CUDA timing loop where no GPU can be had: records the order
    of event records, launches and synchronisations (`calls`); each `launch()` advances a
    virtual device clock by the next of `kernel_ms` (cycled). It measures nothing: tests use it
    to show that two timing loops make the same calls in the same order."""

    def __init__(self, kernel_ms: tuple[float, ...] = (1.0,)) -> None:
        self.calls: list[str] = []
        self.clock_ms = 0.0
        self._kernel_ms = kernel_ms
        self._n = 0
        self.cuda = self  # `torch.cuda.Event`, `torch.cuda.synchronize`

    def Event(self, enable_timing: bool = False) -> _RecordedEvent:  # noqa: N802 (torch's name)
        return _RecordedEvent(self)

    def synchronize(self) -> None:
        self.calls.append("sync")

    def launch(self) -> None:
        self.calls.append("launch")
        self.clock_ms += self._kernel_ms[self._n % len(self._kernel_ms)]
        self._n += 1


class SlowControllerSlurm:
    """A controller that answers reads and takes a breaker slot, then times out on the drain
    (slurmctld overloaded mid-storm). Only the calls `bluevela.fleet.nodestate.drain_node` makes.
    Reservations are kept as slurmctld keeps them: created ones are listed until deleted, and
    every delete is recorded (`deleted`)."""

    def __init__(self, node: str, partition: str = "debug", total: int = 16) -> None:
        from bluevela.slurm.client import NodeInfo, ReservationInfo

        self.node = node
        self.nodes_ = [NodeInfo(f"n{i}", "IDLE", "", (partition,)) for i in range(1, total)]
        self.nodes_.append(NodeInfo(node, "ALLOCATED", "", (partition,)))
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.held: dict[str, ReservationInfo] = {}

    def nodes(self, names: object = None) -> list[object]:
        return list(self.nodes_)

    def reservations(self, timeout_s: float | None = None) -> list[object]:
        return list(self.held.values())

    def create_reservation(self, name: str, node: str, *, start_in_s: float = 0.0,
                           **kw: object) -> bool:
        from bluevela.slurm.client import ReservationInfo

        if name in self.held:  # slurmctld refuses a name in use
            return False
        self.created.append(name)
        self.held[name] = ReservationInfo(name, (node,), time.time() + start_in_s)
        return True

    def delete_reservation(self, name: str, **kw: object) -> bool:
        self.deleted.append(name)
        return self.held.pop(name, None) is not None

    def drain(self, node: str, reason: str, timeout_s: float | None = None) -> None:
        from bluevela.errors import SlurmError

        raise SlurmError("scontrol update timed out after 10 s")
