"""The one seam for talking to Slurm: a `SlurmClient` protocol and the data it returns.

`bluevela.slurm.connect.get_client()` returns the pyslurm implementation when pyslurm imports
and matches the running Slurm, otherwise the CLI implementation (sbatch/squeue/sacct/scontrol),
which works on 22.05 and 24.11 alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from bluevela.slurm.states import JobState


@dataclass(frozen=True)
class AttemptRecord:
    """One run of a job that Slurm requeued (and the last one): what Slurm recorded at its end."""

    attempt: int  # 1-based
    state: JobState
    state_name: str
    exit_code: int | None
    nodes: tuple[str, ...]
    start_time: int | None = None
    end_time: int | None = None
    cause: str = ""  # why it ended, from bv's end line / next banner when the log was readable

    def to_dict(self) -> dict[str, object]:
        return {"attempt": self.attempt, "state": self.state_name, "exit_code": self.exit_code,
                "nodes": list(self.nodes), "start_time": self.start_time,
                "end_time": self.end_time, "cause": self.cause}


@dataclass(frozen=True)
class JobInfo:
    """What bluevela needs to know about one job."""

    job_id: int
    state: JobState
    state_name: str  # Slurm's own name, e.g. "CANCELLED"
    exit_code: int | None  # the batch script's exit status (not the raw wait status)
    signal: int | None
    nodes: tuple[str, ...]
    name: str = ""
    user: str = ""
    partition: str = ""
    reason: str = ""
    stdout: str = ""
    work_dir: str = ""
    restarts: int = 0
    start_time: int | None = None  # unix seconds
    end_time: int | None = None
    requeue: bool = False  # Slurm may requeue it (NODE_FAIL, preemption, scontrol requeue)
    # Every attempt Slurm recorded, oldest first (filled where asked for; may be empty).
    attempts: tuple[AttemptRecord, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "state": self.state_name,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "nodes": list(self.nodes),
            "name": self.name,
            "user": self.user,
            "partition": self.partition,
            "reason": self.reason,
            "stdout": self.stdout,
            "work_dir": self.work_dir,
            "restarts": self.restarts,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "terminal": self.state.is_terminal(),
            "requeue": self.requeue,
            "attempts": [a.to_dict() for a in self.attempts],
        }


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # e.g. "IDLE", "IDLE+DRAIN", "ALLOCATED"
    reason: str = ""
    partitions: tuple[str, ...] = field(default_factory=tuple)

    @property
    def drained(self) -> bool:
        """Drained or draining (the DRAIN flag is set)."""
        return "DRAIN" in self.state.upper()


@dataclass(frozen=True)
class ReservationInfo:
    """One reservation, as much of it as the fleet breaker's slots need."""

    name: str
    nodes: tuple[str, ...]
    start_time: float | None  # unix seconds
    flags: tuple[str, ...] = ()


class SlurmClient(Protocol):
    """Everything bluevela asks of Slurm."""

    def version(self) -> tuple[int, int]:
        """(major, minor), e.g. (22, 5)."""
        ...

    def submit(self, script: str, *, cwd: str | None = None) -> int:
        """Submit a batch script (text); return the job id. Retries an unreachable controller."""
        ...

    def job(self, job_id: int) -> JobInfo:
        """One job's current state. Raises SlurmError when Slurm does not know it."""
        ...

    def jobs(self, job_ids: list[int] | None = None) -> list[JobInfo]:
        """Jobs by id (all jobs slurmctld knows when None)."""
        ...

    def cancel(self, job_ids: list[int]) -> None: ...

    def signal_batch(self, job_id: int, signal_name: str) -> None:
        """Send `signal_name` (e.g. USR1) to the job's batch shell only (bv's supervisor)."""
        ...

    def nodes(self, names: list[str] | None = None) -> list[NodeInfo]: ...

    def drain(self, node: str, reason: str, *, timeout_s: float = 5.0) -> None: ...

    def resume(self, node: str, *, timeout_s: float = 5.0) -> None: ...

    def reservations(self, *, timeout_s: float = 5.0) -> list[ReservationInfo]:
        """Every reservation slurmctld knows (one RPC)."""
        ...

    def create_reservation(self, name: str, node: str, *, start_in_s: int, duration_min: int,
                           flags: tuple[str, ...], timeout_s: float = 5.0) -> bool:
        """Create reservation `name` on `node`; False when a reservation of that name exists
        (slurmctld refuses a duplicate name: an atomic compare-and-set). One RPC."""
        ...

    def delete_reservation(self, name: str, *, timeout_s: float = 5.0) -> bool:
        """Delete reservation `name`; False when there is none of that name. One RPC."""
        ...

