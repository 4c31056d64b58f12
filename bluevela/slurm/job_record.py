"""Slurm's own record of one job, as root's epilog reads it: state, restart count, submit,
start and end times (issue 33 section 4).

The epilog's environment has none of the times and a restart count that a requeue has
already moved on (SLURM_JOB_RESTART_COUNT is the next attempt's in the ended attempt's
epilog, 22.05). So an epilog that needs them asks slurmctld once, bounded:

    squeue -h -t all -j JOB -O JobID:|,State:|,RestartCnt:|,SubmitTime:|,StartTime:|,EndTime:|

squeue prints exactly these fields, each followed by `|`, and none of them holds text of the
job's owner (`scontrol show job -o` prints the job's name and paths as typed, `=` and field
names included: see slurm/cli_client.py `JOB_FIELDS`). What 22.05 shows while the epilogs of
an attempt run (seen on the dev cluster):

| the attempt ended | State | RestartCnt | SubmitTime | EndTime |
|---|---|---|---|---|
| the job ended | COMPLETING, then COMPLETED/FAILED/... | this attempt's | this attempt's queue start | set |
| Slurm requeued the job | COMPLETING, then PENDING | already the next attempt's | this attempt's queue start (the next one's only once the epilogs are done) | NONE |

So SubmitTime read in an epilog is when the ended attempt began to wait: the job's submission
for attempt 0, the previous requeue for a later one; and a requeued attempt is told by its
missing end. Standard library only (the hooks import it).
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FIELDS = ("JobID", "State", "RestartCnt", "SubmitTime", "StartTime", "EndTime")
SEP = "|"
MAX_RESTART = 65535
_STATE = re.compile(r"[A-Z_]{1,32}")
_TIME = "%Y-%m-%dT%H:%M:%S"


@dataclass(frozen=True)
class JobRecord:
    """What slurmctld says of a job now.

    Attributes:
        job_id: the job.
        state: Slurm's state name (COMPLETING, PENDING, RUNNING, COMPLETED, ...).
        restarts: Slurm's restart count now.
        submit, start, end: unix seconds, None when Slurm shows none.
    """

    job_id: int
    state: str
    restarts: int
    submit: float | None
    start: float | None
    end: float | None

    @property
    def requeued(self) -> bool:
        """Slurm requeued the job at the end of the attempt whose epilogs run now: a job that
        is not running and has no end time (module docstring)."""
        return self.end is None and self.state != "RUNNING" and self.restarts > 0

    def ended_attempt(self, most: int) -> int:
        """The restart count of the attempt whose epilog runs now: Slurm's count, less one
        when the job was requeued; at most `most` (the epilog's SLURM_JOB_RESTART_COUNT)."""
        k = self.restarts - 1 if self.requeued else self.restarts
        return max(0, min(k, most))

    def to_report(self) -> dict[str, Any]:
        """The fields a node report keeps (`slurm_job`): Slurm's word on the attempt."""
        return {"state": self.state, "restarts": self.restarts, "requeued": self.requeued,
                "submit": self.submit, "start": self.start, "end": self.end}


def argv(job_id: int) -> list[str]:
    """`squeue` for `job_id`'s FIELDS, each ended by SEP, in any state squeue still knows."""
    return ["squeue", "-h", "-t", "all", "-j", str(job_id), "-O",
            ",".join(f"{f}:{SEP}" for f in FIELDS)]


def _time(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), _TIME))  # Slurm prints local time
    except (ValueError, OverflowError):
        return None  # NONE, Unknown, N/A


def parse(text: str, job_id: int) -> JobRecord | None:
    """`argv(job_id)`'s output as a JobRecord; None when no line is that job's or a line is
    not what squeue prints (never raises)."""
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(SEP)]
        if len(parts) != len(FIELDS) + 1 or parts[-1] or parts[0] != str(job_id):
            continue
        state, restarts = parts[1], parts[2]
        if not _STATE.fullmatch(state) or not restarts.isdigit() or len(restarts) > 5 \
                or int(restarts) > MAX_RESTART:
            return None
        return JobRecord(job_id, state, int(restarts), _time(parts[3]), _time(parts[4]),
                         _time(parts[5]))
    return None


def read(job_id: int, timeout_s: float) -> JobRecord | None:
    """Ask slurmctld for `job_id`'s record, once, within `timeout_s`; None when it did not
    answer, the job is gone or the answer did not parse (logged). Never raises."""
    try:
        proc = subprocess.run(argv(job_id), capture_output=True, text=True, check=False,
                              timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("job %d: Slurm's record not read (squeue: %s)", job_id, exc)
        return None
    found = parse(proc.stdout, job_id) if proc.returncode == 0 else None
    if found is None:
        err = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        logger.warning("job %d: Slurm's record not read (squeue exit %d%s)", job_id,
                       proc.returncode, f": {err}" if err else "")
    return found
