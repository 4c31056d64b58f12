"""Slurm job and node states as Enums with an explicit table from Slurm's names."""

from __future__ import annotations

from enum import Enum


class JobState(Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESIZING = "RESIZING"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    REVOKED = "REVOKED"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def from_slurm(cls, name: str) -> JobState:
        """Map a Slurm state name (`CANCELLED by 0`, `cancelled`, `CA`) to a JobState."""
        word = name.strip().split()[0].upper() if name.strip() else ""
        word = _SHORT.get(word, word)
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    def is_terminal(self) -> bool:
        """True when the job will not run again by itself."""
        return self in _TERMINAL

    def succeeded(self) -> bool:
        return self is JobState.COMPLETED

    def may_requeue(self) -> bool:
        """An end that Slurm follows with a requeue when the job is requeueable (`--requeue`):
        such a job is not final yet, whatever its state says for a moment."""
        return self in _MAY_REQUEUE

    def requeued_record(self) -> bool:
        """A completion record written for an attempt that was requeued: jobcomp/filetxt writes
        the state after the requeue (PENDING), slurmdbd `sacct -D` writes REQUEUED."""
        return self in _REQUEUED_RECORD


_TERMINAL = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.TIMEOUT,
        JobState.NODE_FAIL,
        JobState.PREEMPTED,
        JobState.OUT_OF_MEMORY,
        JobState.BOOT_FAIL,
        JobState.DEADLINE,
        JobState.REVOKED,
    }
)

_MAY_REQUEUE = frozenset({JobState.NODE_FAIL, JobState.PREEMPTED, JobState.REQUEUED,
                          JobState.REQUEUE_FED, JobState.REQUEUE_HOLD})
_REQUEUED_RECORD = frozenset({JobState.PENDING, JobState.REQUEUED, JobState.REQUEUE_FED,
                              JobState.REQUEUE_HOLD})

# squeue/sacct compact codes.
_SHORT = {
    "PD": "PENDING",
    "CF": "CONFIGURING",
    "R": "RUNNING",
    "CG": "COMPLETING",
    "S": "SUSPENDED",
    "RQ": "REQUEUED",
    "RH": "REQUEUE_HOLD",
    "RF": "REQUEUE_FED",
    "RS": "RESIZING",
    "SI": "SIGNALING",
    "SO": "STAGE_OUT",
    "ST": "STOPPED",
    "CD": "COMPLETED",
    "F": "FAILED",
    "CA": "CANCELLED",
    "TO": "TIMEOUT",
    "NF": "NODE_FAIL",
    "PR": "PREEMPTED",
    "OOM": "OUT_OF_MEMORY",
    "BF": "BOOT_FAIL",
    "DL": "DEADLINE",
    "SE": "SPECIAL_EXIT",
    "RV": "REVOKED",
}
