"""How long a node agent holds bv's checkpoint signal for a training process that has no
handler for it yet (docs/byos.md, "How the checkpoint signal reaches a framework").

A worker still starting (Lightning's import takes 15-35 s on a loaded node) would be killed
by SIGUSR1, so the agent waits for its handler; a worker that never installs one gets
torchrun's SIGTERM stop instead. How long to wait:

- ``BV_USR1_WAIT_S`` in the job's environment (0-600 s): that, always.
- The time limit near (Slurm's ``--signal=B:USR1@N``, or a ``bv requeue`` as close to the
  limit): the supervisor learns the job's time left at the signal (one ``squeue``,
  `slurm.jobctl.JobControl.time_left`) and puts it in the checkpoint request (``left_s``);
  the wait is what that leaves once the stop path after it is paid for (STOP_MARGIN_S),
  at most USR1_WAIT_CAP_S: ``min(cap, left - margin)``, so at least today's 30 s unless the
  time left forces less (then down to 0: an immediate stop that still fits).
- Otherwise (an operator's ``bv requeue`` hours before the limit, the limit unknown):
  USR1_UNCAUGHT_S, 30 s, as before.

"Near" is the goodput ledger's own test for calling a SIGUSR1 the time limit's (within
max(300 s, 10% of the limit) of it: report/goodput.py). The request's field is checked as
strictly as the rest of the wire: an int within [0, MAX_LEFT_S], else it is not there.
Standard library only: the agent runs on every node of a job.
"""

from __future__ import annotations

import time
from collections.abc import Callable

USR1_UNCAUGHT_S = 30.0  # the wait without a time limit near (and the floor with one far)
USR1_WAIT_ENV = "BV_USR1_WAIT_S"  # the job's own value for it (bv submit --env), 0-600 s
USR1_WAIT_MAX_S = 600.0
# The stop path after the wait, all before the time limit (after it Slurm ends the job as
# TIMEOUT and bv's requeue is refused: the job would not come back):
# - torchrun's stop: SIGTERM forwarded to the workers, SIGKILL 30 s later (torch.distributed
#   .elastic's pcontext.close); a worker whose handler shows up at the wait's last moment
#   gets the same 30 s for its save.
TORCHRUN_STOP_GRACE_S = 30.0
# - then bv's requeue: the agent's exit report (a 0.2 s tick), srun reaped (2 s at most), the
#   end line, one `scontrol requeue` (well under a second; 10 s kept for a busy slurmctld,
#   as slurm.command.retry_budget keeps before the limit).
REQUEUE_TAIL_S = 15.0
STOP_MARGIN_S = TORCHRUN_STOP_GRACE_S + REQUEUE_TAIL_S  # 45 s
# A job whose script never installs a handler idles this long at most before its stop (and
# its requeue, and the next attempt): 2 minutes covers a framework's slow start.
USR1_WAIT_CAP_S = 120.0
TIME_LIMIT_WINDOW_S = 300.0  # the ledger's (report/goodput.py): max(this, 10% of the limit)
LEFT_FIELD = "left_s"  # the checkpoint request's time left, whole seconds
MAX_LEFT_S = 10 * 366 * 86400


def explicit_wait(text: str | None) -> float | None:
    """``BV_USR1_WAIT_S`` as seconds, or None when unset or not a number in [0, 600]."""
    if not text or len(text) > 20:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value <= USR1_WAIT_MAX_S else None


def handler_wait(explicit: float | None, left_s: float | None) -> float:
    """Seconds to hold the signal for a worker without a handler: the job's own value
    (`explicit`), else min(USR1_WAIT_CAP_S, time left - STOP_MARGIN_S) when the time limit
    is near (`left_s`, at the signal), never below 0; else USR1_UNCAUGHT_S."""
    if explicit is not None:
        return explicit
    if left_s is None:
        return USR1_UNCAUGHT_S
    return max(0.0, min(USR1_WAIT_CAP_S, left_s - STOP_MARGIN_S))


def time_limit_near(left_s: float, limit_s: float | None) -> bool:
    """A checkpoint signal with `left_s` of the job's time left is the time limit's: within
    max(TIME_LIMIT_WINDOW_S, 10% of the limit) of it (the ledger's test)."""
    return left_s <= max(TIME_LIMIT_WINDOW_S, 0.1 * (limit_s or 0.0))


def usr1_request(time_left: tuple[float, float | None] | None) -> dict[str, object]:
    """The checkpoint request to an agent: with the job's time left (whole seconds, rounded
    down) when the time limit is near, else as before."""
    msg: dict[str, object] = {"t": "usr1"}
    if time_left is not None:
        left, limit = time_left
        if time_limit_near(left, limit):
            msg[LEFT_FIELD] = min(MAX_LEFT_S, max(0, int(left)))
    return msg


def request_left(msg: dict[str, object]) -> int | None:
    """The time left a checkpoint request carries, or None: absent, or anything but an int
    in [0, MAX_LEFT_S] (a bool, a float, a string, a huge number)."""
    left = msg.get(LEFT_FIELD)
    if type(left) is not int or not 0 <= left <= MAX_LEFT_S:
        return None
    return left


class LimitClock:
    """The job's time limit as the supervisor knows it: learned at the first checkpoint
    signal (`learn`: one ``squeue``, never one per node or per step), kept as a monotonic
    end for the requests sent later (an agent that says hello after the signal)."""

    def __init__(self, learn: Callable[[], tuple[float, float | None] | None]) -> None:
        self._learn = learn
        self._asked = False
        self._end: float | None = None
        self._limit: float | None = None

    def left(self) -> tuple[float, float | None] | None:
        """(time left, time limit) in seconds now, or None when Slurm did not say."""
        if not self._asked:
            self._asked = True
            before = time.monotonic()  # the end measured from before the query: never late
            got = self._learn()
            if got is not None:
                self._end, self._limit = before + got[0], got[1]
        if self._end is None:
            return None
        return max(0.0, self._end - time.monotonic()), self._limit
