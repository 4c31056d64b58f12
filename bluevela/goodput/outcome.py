"""How a training step ended, and why a node was lost: one vocabulary for the supervisor that
decides, the goodput record that keeps it and the ledger that reads it.

A step ends one of six ways (`StepEnd`). A node is lost for one of a few reasons (`Loss`: a
`LossKind` and the words the job output shows). Readers act on the kind, never on the words,
so rewording a message changes no figure. In a goodput event record a kind travels as its
enum's ``.value`` string (`StepEnd` in the end's ``kind``; a node's `LossKind` in a field
beside the cause's text, `loss_kinds`); a record written before the kinds existed has only
the text (bluevela/goodput/events.py reads those by prefix, in one legacy function). What the
supervisor makes of a step from them (`StepResult`, the failure's time) is
bluevela/launch/step_result.py.

Standard library only, and a leaf: the supervisor, the hooks and the ledger import it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class StepEnd(enum.StrEnum):
    """How one srun step ended."""

    OK = "ok"  # every node's torchrun exited 0
    FAILED = "failed"  # a rank failed on nodes that all answered (or srun/torchrun would not start)
    LOST = "lost"  # a node is gone: relaunch without it, grow or requeue
    HANG = "hang"  # the hang watchdog aborted the step
    SIGNAL = "signal"  # the checkpoint signal (SIGUSR1): requeue once the step has ended
    TERMINATED = "terminated"  # SIGTERM/SIGINT from Slurm: the job is ending, let it

    @property
    def by_signal(self) -> bool:
        """Ended because a signal reached the supervisor (then the signal is the failure)."""
        return self in (StepEnd.SIGNAL, StepEnd.TERMINATED)


class LossKind(enum.StrEnum):
    """Why a node left the step. The comment says when the failure happened, as the ledger
    dates it (launch.step_result.failure_time)."""

    CLOSED = "closed"  # its agent's connection closed: when the supervisor saw it
    SILENT = "silent"  # no agent message for --node-timeout: at its last message
    NEVER_CONNECTED = "never-connected"  # no agent in --connect-timeout: at the step's start
    NO_ABORT_ANSWER = "no-abort-answer"  # silent after the abort: when the abort was sent
    PROTOCOL = "protocol"  # its agent broke the protocol: when the supervisor saw it
    HUNG = "hung"  # alive, but its rank hung: a spare takes its place (never a lost node)
    BATCH_NODE = "batch-node"  # the supervisor's own node died with it (the copy's record)


@dataclass(frozen=True)
class Loss:
    """Why a node left the step: the kind readers act on, and the words the job output shows
    (``<node> lost (<text>)``)."""

    kind: LossKind
    text: str

    def __str__(self) -> str:
        return self.text

    @classmethod
    def closed(cls) -> Loss:
        return cls(LossKind.CLOSED,
                   "its agent's connection closed: the node or its processes died")

    @classmethod
    def silent(cls, seconds: float) -> Loss:
        return cls(LossKind.SILENT, f"silent for {seconds:.0f} s (no agent ping)")

    @classmethod
    def never_connected(cls, timeout_s: float) -> Loss:
        return cls(LossKind.NEVER_CONNECTED, f"its agent never connected in {timeout_s:.0f} s")

    @classmethod
    def no_abort_answer(cls) -> Loss:
        return cls(LossKind.NO_ABORT_ANSWER, "did not answer the abort")

    @classmethod
    def protocol(cls, why: str) -> Loss:
        return cls(LossKind.PROTOCOL, f"its agent broke the protocol ({why})")

    @classmethod
    def hung(cls) -> Loss:
        return cls(LossKind.HUNG, "its rank hung")


def loss_kinds(lost: Mapping[str, Loss]) -> dict[str, str]:
    """The serialised form beside the text in an event record: node -> `LossKind` value."""
    return {node: loss.kind.value for node, loss in lost.items()}
