"""The hang watchdog, pure: every rank's last beat (`RankBeat`, from its own beats or its
node agent's aggregate) and `find_hang`, which names the rank that stopped first. No sockets,
no clock of its own: the step (launch/step.py) feeds it and asks it five times a second.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RankBeat:
    node: str
    step: int
    last_progress: float  # monotonic time of its last progress() call (receive time - age)
    in_collective: bool = False
    where: str = "?"
    finished: bool = False  # its training is over (runtime.finished()): tearing down
    at_request: bool = False  # ... maybe at the checkpoint request (else: simply ended)


@dataclass(frozen=True)
class Hang:
    rank: int
    beat: RankBeat
    silent_s: float
    waiting: int = 0  # other ranks waiting inside a collective

    def describe(self) -> str:
        b = self.beat
        state = "in a collective" if b.in_collective else "not in a collective"
        others = f"; {self.waiting} other rank(s) wait in a collective" if self.waiting else ""
        return (f"hang: rank {self.rank} on {b.node} stopped first (no progress for "
                f"{self.silent_s:.0f} s, last step {b.step}, at {b.where}, {state}){others}")


def find_hang(beats: dict[int, RankBeat], now: float, timeout: float) -> Hang | None:
    """A hang when a rank that reported is without progress for `timeout`. The watchdog arms at
    the first beat: start-up (imports, rendezvous, loading) has its own timeouts in torchrun
    and init_process_group, and may legitimately take longer than a short hang timeout. The
    rank named as stopped first: one NOT waiting in a collective (its peers wait for it
    there), then the oldest progress, lowest step, rank."""
    # A rank whose training is over may take its time to tear down (the process group, the
    # interpreter, on a loaded node): it is not watched, and not named.
    if timeout <= 0:
        return None
    # One pass without a copy first: 5 times a second over every rank of the step.
    oldest = min((b.last_progress for b in beats.values() if not b.finished), default=None)
    if oldest is None or now - oldest < timeout:
        return None
    beats = {r: b for r, b in beats.items() if not b.finished}
    rank, beat = min(beats.items(), key=lambda kv: (kv[1].in_collective, kv[1].last_progress,
                                                     kv[1].step, kv[0]))
    waiting = sum(1 for r, b in beats.items() if r != rank and b.in_collective)
    return Hang(rank, beat, now - beat.last_progress, waiting)
