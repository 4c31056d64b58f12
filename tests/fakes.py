"""The only fakes in the suite: a clock and a sleep that advance without waiting.

Slurm is never faked (tests that talk to Slurm use the real dev cluster); hardware is replayed
from recorded fixtures in tests/data/, not from objects that return what a test wants.
"""

from __future__ import annotations


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
