"""Job control from inside a running job: the in-job supervisor's Slurm calls.

Two calls on the job itself (bluevela/launch/supervisor.py): ``scontrol requeue JOB``, and
``scontrol update JobId=JOB NodeList=...`` to let go of lost nodes before it. The supervisor
must outlive a hung or restarting slurmctld, and must not outlive the job, so unlike
`CliSlurmClient` (which raises after its budget) a call here never raises: it goes through
the job side's one seam to Slurm (bluevela/slurm/command.py: each try bounded by `timeout_s`,
retried with backoff while slurmctld is unreachable, hung or busy, within `retry_for_s` cut to
the job's remaining time; a permanent refusal ends it at once), and the `wait` between tries
can stop them (Slurm's SIGTERM: the job is ending, nothing is left to retry for). The first
try is immediate.

One read: the job's time left at the checkpoint signal (`JobControl.time_left`: one bounded
``squeue``, no retry; the wait for a worker's handler follows it, bluevela/launch/usr1_wait.py).

Standard library only: it runs as the job's main process.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence

from bluevela.slurm.command import (
    SLURM_RETRY_FOR_S,
    SLURM_TIMEOUT_S,
    SlurmCall,
    Wait,
    plain_wait,
    run_slurm,
)

logger = logging.getLogger(__name__)

TIME_LEFT_TIMEOUT_S = 5.0  # the one squeue at the checkpoint signal (the loop waits for it)
# squeue's durations: [days-][hours:]minutes:seconds (Slurm's secs2time_str); UNLIMITED,
# NOT_SET, INVALID and anything else are no duration.
_DURATION = re.compile(r"(?:(\d{1,5})-)?(?:(\d{1,2}):)?(\d{1,2}):(\d{2})")


def slurm_duration(text: str) -> int | None:
    """Seconds of one of squeue's durations (``59:58``, ``1:59:58``, ``2-00:00:00``), or None
    for anything else (``UNLIMITED``, ``INVALID``, a minute or second of 60 or more)."""
    m = _DURATION.fullmatch(text)
    if m is None:
        return None
    days, hours, mins, secs = (int(g) if g else 0 for g in m.groups())
    if hours > 23 or mins > 59 or secs > 59:
        return None
    return ((days * 24 + hours) * 60 + mins) * 60 + secs


def parse_time_left(stdout: str) -> tuple[float, float | None] | None:
    """(time left, time limit) from ``squeue -h -j JOB -o %L|%l``: one line, the time left a
    duration (else None), the limit a duration or None (UNLIMITED)."""
    lines = stdout.splitlines()
    if len(stdout) > 100 or len(lines) != 1:
        return None
    words = lines[0].strip().split("|")
    if len(words) != 2:
        return None
    left, limit = slurm_duration(words[0]), slurm_duration(words[1])
    if left is None:
        return None
    return float(left), None if limit is None else float(limit)


class JobControl:
    """The Slurm calls of one job on itself.

    Args:
        job: the job's id.
        env: the job's environment (``SLURM_JOB_END_TIME`` bounds the retries).
        timeout_s: one try.
        retry_for_s: all tries of one call.
        wait: sleeps between tries; returns True to stop (the job is ending).
    """

    def __init__(self, job: str, env: Mapping[str, str], *, timeout_s: float = SLURM_TIMEOUT_S,
                 retry_for_s: float = SLURM_RETRY_FOR_S, wait: Wait = plain_wait) -> None:
        self.job = job
        self.env = env
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.wait = wait

    def requeue(self) -> SlurmCall:
        """``scontrol requeue JOB``: same id, restart count + 1."""
        return self.run(["scontrol", "requeue", self.job])

    def keep_only(self, nodelist: str) -> SlurmCall:
        """``scontrol update JobId=JOB NodeList=...``: the job lets go of every other node."""
        return self.run(["scontrol", "update", f"JobId={self.job}", f"NodeList={nodelist}"])

    def time_left(self) -> tuple[float, float | None] | None:
        """The job's (time left, time limit) in seconds: slurmctld's own count from one
        ``squeue -h -j JOB -o %L|%l`` (one try, TIME_LEFT_TIMEOUT_S at most; no clock of
        ours), else the time left from ``SLURM_JOB_END_TIME`` (Slurm 23.02+; limit unknown);
        None when neither says (no limit, or slurmctld unreachable on an older Slurm).
        Never raises."""
        call = run_slurm(["squeue", "-h", "-j", self.job, "-o", "%L|%l"],
                         timeout_s=min(self.timeout_s, TIME_LEFT_TIMEOUT_S))
        got = parse_time_left(call.stdout) if call.ok else None
        if got is not None:
            return got
        if call.status is None:  # timed out, or no squeue
            logger.warning("squeue -j %s: %s", self.job, call.why)
        end = self.env.get("SLURM_JOB_END_TIME", "")
        if end.isdigit() and len(end) <= 12:
            return max(0.0, int(end) - time.time()), None
        return None

    def run(self, argv: Sequence[str]) -> SlurmCall:
        """One Slurm command, tried and retried as bluevela/slurm/command.py says. Never raises; the
        caller says what a failed call means (each retry is logged here)."""
        return run_slurm(argv, timeout_s=self.timeout_s, retry_for_s=self.retry_for_s,
                         env=self.env, wait=self.wait)
