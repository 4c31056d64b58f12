"""One Slurm command from the job side: the seam every Slurm command of the in-job supervisor's
process goes through (issue 38): the requeue and the let-go (bluevela/slurm/jobctl.py), the
time left at the checkpoint signal, the job's times for the goodput events
(bluevela/launch/events_log.py) and a grow's salloc/scontrol/scancel/squeue
(bluevela/launch/grow.py).

`run_slurm` runs one argv list (no shell) and never raises for Slurm's answer:
- bounded: each try by `timeout_s`, all tries by `retry_for_s` (cut to the job's remaining
  time when ``SLURM_JOB_END_TIME`` says it, `retry_budget`);
- retried with backoff (BACKOFF_S) while slurmctld is unreachable, hung or busy; a refusal no
  retry changes ends the call at once (PERMANENT_SLURM_ERRORS), one that may never clear is
  retried briefly (SLOW_SLURM_ERRORS); a command that makes a job (ONCE: salloc, sbatch) is
  tried once, since a try whose answer was lost may have made one; `retry_for_s=0` is one try;
- the `wait` between tries can stop them (the job is ending);
- typed: a `SlurmCall` carries the command, the last try's exit status (None: it timed out or
  could not run) and why it failed on one printable line (protocol.names.printable); what the
  command printed is kept as data (salloc names its job on stderr, even when cut short), never
  pasted into a cause.

Standard library only: it runs in the job's main process.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bluevela.protocol.names import printable
from bluevela.slurm.cli_client import unreachable

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
# Commands that make a job: a try that timed out or lost its answer may have made one.
ONCE = ("salloc", "sbatch")
WHY_CHARS = 300

# Waits `seconds`; True when the job is ending (stop retrying).
Wait = Callable[[float], bool]


@dataclass(frozen=True)
class SlurmCall:
    """One Slurm command's outcome, all its tries.

    Attributes:
        argv: the command.
        ok: the last try exited 0.
        stdout: what the last try printed (also when it failed or timed out).
        why: why it failed, one printable line ("" when ok).
        tries: how many tries.
        seconds: all tries.
        status: the last try's exit status; None when it timed out or could not run.
        terminated: the wait between tries said the job is ending.
        stderr: the last try's stderr, as data (salloc's job id is there), never a cause.
        timed_out: the last try was cut at its bound.
    """

    argv: tuple[str, ...]
    ok: bool
    stdout: str
    why: str
    tries: int
    seconds: float
    status: int | None = 0
    terminated: bool = False
    stderr: str = ""
    timed_out: bool = False

    @property
    def command(self) -> str:
        """The command and its verb (``scontrol requeue``), for a log line."""
        return printable(" ".join(self.argv[:2]), 60)

    @property
    def answered(self) -> bool:
        """slurmctld answered (not cut at the bound, not unreachable or busy): a refusal is
        an answer."""
        return self.ok or (not self.timed_out and not unreachable(self.why))

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


def plain_wait(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def _text(data: str | bytes | None) -> str:
    # TimeoutExpired carries bytes even with text=True.
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def run_slurm(argv: Sequence[str], *, timeout_s: float = SLURM_TIMEOUT_S,
              retry_for_s: float = 0.0, env: Mapping[str, str] | None = None,
              wait: Wait = plain_wait, cwd: str | None = None) -> SlurmCall:
    """Run one Slurm command, tried and retried as the module says. Never raises for what
    the command does (an exception the `wait` or a signal handler raises goes through).

    Args:
        argv: the command (no shell).
        timeout_s: one try (at least 1 s).
        retry_for_s: all tries; 0: one try. Cut to the job's end by ``SLURM_JOB_END_TIME``.
        env: where ``SLURM_JOB_END_TIME`` is read (default: this process's environment).
        wait: sleeps between tries; returns True to stop (the job is ending).
        cwd: the command's working directory (scontrol writes a resize script there).
    """
    args = tuple(argv)
    once = retry_for_s <= 0 or os.path.basename(args[0]) in ONCE
    start = time.monotonic()
    budget = timeout_s if once else retry_budget(os.environ if env is None else env,
                                                 retry_for_s, time.time())
    deadline = start + max(1.0, budget)
    tries = 0
    while True:
        tries += 1
        limit = max(1.0, min(timeout_s, deadline - time.monotonic()))
        status: int | None = None
        timed_out = False
        try:
            proc = subprocess.run(list(args), capture_output=True, text=True, check=False,
                                  timeout=limit, cwd=cwd, stdin=subprocess.DEVNULL,
                                  errors="replace")
        except subprocess.TimeoutExpired as exc:
            out, err, timed_out = _text(exc.stdout), _text(exc.stderr), True
            why = f"timed out after {limit:.0f} s"
        except OSError as exc:  # no such command: no retry mends it
            return SlurmCall(args, False, "", printable(f"cannot run {args[0]}: "
                                                        f"{exc.strerror or exc}", WHY_CHARS),
                             tries, time.monotonic() - start, status=None)
        else:
            out, err, status = proc.stdout, proc.stderr, proc.returncode
            if status == 0:
                return SlurmCall(args, True, out, "", tries, time.monotonic() - start,
                                 stderr=err)
            why = f"exit {status}: {printable(err or out, WHY_CHARS) or 'no message'}"
            if permanent_slurm_error(why):
                once = True
            deadline = retry_deadline(why, start, deadline)
        delay = BACKOFF_S[min(tries - 1, len(BACKOFF_S) - 1)]
        if once or time.monotonic() + delay >= deadline:
            return SlurmCall(args, False, out, why, tries, time.monotonic() - start,
                             status=status, stderr=err, timed_out=timed_out)
        logger.warning("%s: %s; try %d in %g s", " ".join(args[:2]), why, tries + 1, delay)
        if wait(delay):
            return SlurmCall(args, False, out, why, tries, time.monotonic() - start,
                             status=status, terminated=True, stderr=err, timed_out=timed_out)
