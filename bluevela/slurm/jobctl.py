"""Job control from inside a running job: the in-job supervisor's Slurm calls.

Two calls on the job itself (bluevela/launch/supervisor.py): ``scontrol requeue JOB``, and
``scontrol update JobId=JOB NodeList=...`` to let go of lost nodes before it. The supervisor
must outlive a hung or restarting slurmctld, and must not outlive the job, so unlike
`CliSlurmClient` (which raises after its budget) a call here never raises: each try is bounded
(`timeout_s`), tries are retried with backoff (BACKOFF_S) while slurmctld is unreachable, hung
or busy, within `retry_for_s` cut to the job's remaining time (`retry_budget`); a refusal no
retry changes ends the call at once (PERMANENT_SLURM_ERRORS), one that may never clear is
retried briefly (SLOW_SLURM_ERRORS); and the `wait` between tries can stop them (Slurm's
SIGTERM: the job is ending, nothing is left to retry for). The first try is immediate.

One read: the job's time left at the checkpoint signal (`JobControl.time_left`: one bounded
``squeue``, no retry; the wait for a worker's handler follows it, bluevela/launch/usr1_wait.py).

Standard library only: it runs as the job's main process.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bluevela.protocol.names import printable

logger = logging.getLogger(__name__)

SLURM_TIMEOUT_S = 20.0  # one try of a Slurm command
SLURM_RETRY_FOR_S = 300.0  # all tries of one call, within the job's remaining time
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # between tries, then 15 s
# Refusals that no retry changes (the job is gone or not requeueable, the user may not).
PERMANENT_SLURM_ERRORS = ("invalid job id", "access/permission denied", "presently disabled",
                          "already completing or completed", "not requeue", "invalid user")
# "Job update not available right now, the DB index is being set": with slurmdbd it clears in
# seconds; without accounting (22.05, accounting_storage/none) a second `update NodeList=` of the
# same job is refused so for good. Retried for this long only, not the call's whole budget.
SLOW_SLURM_ERRORS = ("db index is being set",)
SLOW_SLURM_RETRY_S = 30.0
TIME_LEFT_TIMEOUT_S = 5.0  # the one squeue at the checkpoint signal (the loop waits for it)
# squeue's durations: [days-][hours:]minutes:seconds (Slurm's secs2time_str); UNLIMITED,
# NOT_SET, INVALID and anything else are no duration.
_DURATION = re.compile(r"(?:(\d{1,5})-)?(?:(\d{1,2}):)?(\d{1,2}):(\d{2})")

# Waits `seconds`; True when the job is ending (stop retrying).
Wait = Callable[[float], bool]


@dataclass(frozen=True)
class SlurmCall:
    ok: bool
    stdout: str
    why: str  # the last try's failure, one line
    tries: int
    seconds: float
    terminated: bool = False  # the wait between tries said the job is ending

    def describe(self) -> str:
        return f"{self.tries} tr{'y' if self.tries == 1 else 'ies'} in {self.seconds:.0f} s; last: {self.why}"


def permanent_slurm_error(why: str) -> bool:
    low = why.lower()
    return any(text in low for text in PERMANENT_SLURM_ERRORS)


def retry_deadline(why: str, start: float, deadline: float) -> float:
    """The deadline of a Slurm call's tries after a failure saying `why`: a refusal that may
    never clear (SLOW_SLURM_ERRORS) is retried for SLOW_SLURM_RETRY_S from the first try."""
    if any(text in why.lower() for text in SLOW_SLURM_ERRORS):
        return min(deadline, start + SLOW_SLURM_RETRY_S)
    return deadline


def retry_budget(env: Mapping[str, str], retry_for: float, now: float) -> float:
    """Seconds the tries of one Slurm call may take: `retry_for`, cut to the job's remaining
    time when Slurm says it (``SLURM_JOB_END_TIME``, epoch seconds; Slurm 23.02+), less 10 s
    so the last line is written before the time limit."""
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and len(end) <= 12:
        return max(1.0, min(retry_for, int(end) - now - 10))
    return max(1.0, retry_for)


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


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return False


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
                 retry_for_s: float = SLURM_RETRY_FOR_S, wait: Wait = _sleep) -> None:
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
        try:
            proc = subprocess.run(["squeue", "-h", "-j", self.job, "-o", "%L|%l"],
                                  capture_output=True, text=True, check=False,
                                  timeout=min(self.timeout_s, TIME_LEFT_TIMEOUT_S),
                                  stdin=subprocess.DEVNULL, errors="replace")
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("squeue -j %s: %s", self.job, printable(exc, 200))
        else:
            got = parse_time_left(proc.stdout) if proc.returncode == 0 else None
            if got is not None:
                return got
        end = self.env.get("SLURM_JOB_END_TIME", "")
        if end.isdigit() and len(end) <= 12:
            return max(0.0, int(end) - time.time()), None
        return None

    def run(self, argv: Sequence[str]) -> SlurmCall:
        """One Slurm command, tried and retried as the module says. Never raises; the
        caller says what a failed call means (each retry is logged here)."""
        start = time.monotonic()
        deadline = start + retry_budget(self.env, self.retry_for_s, time.time())
        tries, why = 0, ""
        while True:
            tries += 1
            limit = max(1.0, min(self.timeout_s, deadline - time.monotonic()))
            try:
                proc = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                                      timeout=limit, stdin=subprocess.DEVNULL, errors="replace")
            except subprocess.TimeoutExpired:
                why = f"timed out after {limit:.0f} s"
            except OSError as exc:  # no such command: no retry mends it
                return SlurmCall(False, "", f"cannot run {argv[0]}: {exc.strerror or exc}",
                                 tries, time.monotonic() - start)
            else:
                if proc.returncode == 0:
                    return SlurmCall(True, proc.stdout, "", tries, time.monotonic() - start)
                why = (f"exit {proc.returncode}: "
                       f"{printable(proc.stderr or proc.stdout, 200) or 'no message'}")
                if permanent_slurm_error(why):
                    return SlurmCall(False, "", why, tries, time.monotonic() - start)
                deadline = retry_deadline(why, start, deadline)
            delay = BACKOFF_S[min(tries - 1, len(BACKOFF_S) - 1)]
            if time.monotonic() + delay >= deadline:
                return SlurmCall(False, "", why, tries, time.monotonic() - start)
            logger.warning("%s: %s; try %d in %g s", " ".join(argv[:2]), why, tries + 1, delay)
            if self.wait(delay):
                return SlurmCall(False, "", why, tries, time.monotonic() - start,
                                 terminated=True)
