"""What the supervisor makes of a step: `StepResult` (how it ended, what to say about it, and
when it went wrong), the job output's words for its lost nodes (`lost_text`), and when its
failure happened (`failure_time`, the `failed` time the goodput record keeps). The kinds it is
made of (`StepEnd`, `Loss`, `LossKind`) are the goodput record's: bluevela/goodput/outcome.py.

Standard library only, and pure: the supervisor, the step and the relaunch policy import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from bluevela.goodput.outcome import Loss, LossKind, StepEnd


@dataclass(frozen=True)
class StepResult:
    """How a step ended, what to say about it, and when it went wrong."""

    kind: StepEnd
    rc: int  # the job's exit status when it ends here
    cause: str  # the end line's words
    lost: Mapping[str, Loss] = field(default_factory=dict)  # node -> why it left the step
    hang_node: str | None = None  # the node of the rank that stopped first
    failed_at: float | None = None  # monotonic: when the failure happened (the ledger's)
    detected_at: float | None = None  # monotonic: when the supervisor acted on it
    hang_rank: int | None = None  # the rank that stopped first (a hang)


def lost_text(lost: Mapping[str, Loss]) -> str:
    """The lost nodes as the job output says them: ``node2 lost (why); node3 lost (why)``."""
    return "; ".join(f"{node} lost ({loss.text})" for node, loss in lost.items())



def failure_time(lost: Mapping[str, Loss], last_seen: Mapping[str, float], started: float,
                 detected: float, hang_progress: float | None) -> float:
    """When the step's failure happened (monotonic), from each lost node's `LossKind`: a hang
    at the stuck rank's last progress; a node silent for --node-timeout at its agent's last
    message; a node that never connected at the step's start; anything else (a closed
    connection, a rank's exit) when it was seen, which is within one supervisor tick of it."""
    if hang_progress is not None:
        return min(hang_progress, detected)
    times = [detected]
    for node, loss in lost.items():
        if loss.kind is LossKind.SILENT and node in last_seen:
            times.append(last_seen[node])
        elif loss.kind is LossKind.NEVER_CONNECTED:
            times.append(started)
    return min(times)
