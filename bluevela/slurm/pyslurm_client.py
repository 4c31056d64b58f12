"""SlurmClient through pyslurm, used only when pyslurm imports and matches the running Slurm.

PyPI's pyslurm tracks one Slurm release (25.11); Debian ships 22.05 (12) and 24.11 (13). A
mismatched pyslurm fails at import or, worse, misreads structures, so the versions must agree on
major.minor. Writes (submit, drain) stay on the CLI client, whose behaviour is the documented one.
"""

from __future__ import annotations

import logging
from typing import Any

from bluevela.slurm.cli_client import CliSlurmClient, _expand_nodes
from bluevela.slurm.client import JobInfo, NodeInfo, ReservationInfo
from bluevela.slurm.states import JobState

logger = logging.getLogger(__name__)


def pyslurm_matches(cli: CliSlurmClient) -> bool:
    """True when pyslurm imports and was built for the running Slurm's major.minor."""
    try:
        import pyslurm
    except Exception:  # noqa: BLE001 - a broken binding is as good as none
        return False
    version = getattr(pyslurm, "__version__", "")
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
        return (major, minor) == cli.version()
    except (ValueError, Exception):  # noqa: BLE001
        return False


class PySlurmClient:
    """Reads jobs through pyslurm; everything else goes through the CLI client."""

    def __init__(self, fallback: CliSlurmClient) -> None:
        import pyslurm

        self._pyslurm: Any = pyslurm
        self._cli = fallback

    def version(self) -> tuple[int, int]:
        return self._cli.version()

    def submit(self, script: str, *, cwd: str | None = None) -> int:
        return self._cli.submit(script, cwd=cwd)

    def job(self, job_id: int) -> JobInfo:
        try:
            j = self._pyslurm.Job.load(job_id)
        except Exception:  # noqa: BLE001 - aged out of slurmctld: ask sacct via the CLI
            return self._cli.job(job_id)
        if j.requeue_count:
            # Requeued: each attempt's record (and the requeue flag) come from the CLI path.
            return self._cli.job(job_id)
        state = JobState.from_slurm(str(j.state))
        if state is JobState.COMPLETING:
            # Slurm's node list of a completing job names only the nodes whose epilog still
            # runs; the allocation comes from squeue's job_resources on the CLI path.
            return self._cli.job(job_id)
        return JobInfo(
            job_id=int(j.id),
            state=state,
            state_name=state.value,
            exit_code=j.exit_code if state.is_terminal() else None,
            signal=(j.exit_code_signal or None) if state.is_terminal() else None,
            # pyslurm 25.11's Job has no `nodes`: `allocated_nodes` is Slurm's host list
            # (tests/slurm/test_pyslurm_cluster.py, against the real 25.11 cluster).
            nodes=_expand_nodes(str(j.allocated_nodes or "")),
            name=str(j.name or ""),
            user=str(j.user_name or ""),
            partition=str(j.partition or ""),
            reason=str(j.state_reason or ""),
            stdout=str(j.standard_output or ""),
            work_dir=str(j.working_directory or ""),
            restarts=int(j.requeue_count or 0),
        )

    def jobs(self, job_ids: list[int] | None = None) -> list[JobInfo]:
        if job_ids is None:
            return self._cli.jobs(None)
        return [self.job(j) for j in job_ids]

    def cancel(self, job_ids: list[int]) -> None:
        self._cli.cancel(job_ids)

    def signal_batch(self, job_id: int, signal_name: str) -> None:
        self._cli.signal_batch(job_id, signal_name)

    def nodes(self, names: list[str] | None = None) -> list[NodeInfo]:
        return self._cli.nodes(names)

    def drain(self, node: str, reason: str, *, timeout_s: float = 5.0) -> None:
        self._cli.drain(node, reason, timeout_s=timeout_s)

    def resume(self, node: str, *, timeout_s: float = 5.0) -> None:
        self._cli.resume(node, timeout_s=timeout_s)

    def reservations(self, *, timeout_s: float = 5.0) -> list[ReservationInfo]:
        return self._cli.reservations(timeout_s=timeout_s)

    def create_reservation(self, name: str, node: str, *, start_in_s: int, duration_min: int,
                           flags: tuple[str, ...], timeout_s: float = 5.0) -> bool:
        return self._cli.create_reservation(name, node, start_in_s=start_in_s,
                                            duration_min=duration_min, flags=flags,
                                            timeout_s=timeout_s)

    def delete_reservation(self, name: str, *, timeout_s: float = 5.0) -> bool:
        return self._cli.delete_reservation(name, timeout_s=timeout_s)
