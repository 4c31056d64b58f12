"""The checkpoint request: SIGUSR1 from bv's supervisor sets a flag the training loop polls.

bv (its in-job supervisor) sends SIGUSR1 to every training process `signal_before` seconds
before the time limit, and when Slurm preempts or an operator requeues the job. The handler only
sets a flag: the loop finishes its current step, saves a checkpoint and exits (or keeps going:
the supervisor ends and requeues the job once the workers are gone). Nothing here imports torch.

SIGTERM (scancel, an operator's `scontrol requeue`, preemption, torchrun's agent stopping its
workers) also sets the flag, so the loop can checkpoint within Slurm's KillWait; it does not
make the process immortal: `BV_TERM_GRACE_S` seconds (default 20) after the first SIGTERM the
process ends the default way (SIGTERMs in between are absorbed: torchrun's agent forwards
Slurm's own right after it). Slurm's SIGKILL after KillWait ends it in any case.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

logger = logging.getLogger(__name__)

CHECKPOINT_SIGNAL = signal.SIGUSR1

_requested = threading.Event()
_installed: set[int] = set()
_lock = threading.Lock()


_term_timer: threading.Timer | None = None
_last_signal: int | None = None


_grace_over = threading.Event()
# This rank acted on the request (its loop saw checkpoint_requested() True, or an integration's
# ranks agreed to stop for it): how its training ended, told to bv in the last heartbeat. A
# request that came after the last step was taken is not acted on: the training simply ended,
# and bv must not requeue a finished job for it.
_acted = threading.Event()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _term_timer, _last_signal
    del frame
    if signum == signal.SIGTERM and _grace_over.is_set():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if not _requested.is_set():
        _last_signal = signum  # the signal that asked first (until the request is cleared)
    _requested.set()
    if signum == signal.SIGTERM and _term_timer is None:
        # Slurm's SIGTERM is followed at once by torchrun's agent forwarding its own: further
        # SIGTERMs are absorbed, and the process ends the default way after the grace period.
        _term_timer = threading.Timer(_term_grace_s(), _terminate)
        _term_timer.daemon = True
        _term_timer.start()


def _terminate() -> None:
    # Handlers can only be changed on the main thread: ask it (the handler re-raises with the
    # default action); if it is stuck in C code and never runs the handler, exit from here.
    _grace_over.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2.0)
    os._exit(128 + signal.SIGTERM)


def requested_by() -> str | None:
    """The name of the signal that requested the checkpoint first (`SIGUSR1`, `SIGTERM`), or
    None."""
    return signal.Signals(_last_signal).name if _last_signal is not None else None


def _term_grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get("BV_TERM_GRACE_S", "20")))
    except ValueError:
        return 20.0


def install_signal_handler(signum: int | None = None) -> bool:
    """Install the flag-setting handler (idempotent): for `signum`, or by default for SIGUSR1
    and SIGTERM.

    Returns False (and installs nothing) off the main thread, where Python cannot install
    handlers; call it once from the main thread at start-up (before the first step), so an
    early signal is not the default action (SIGUSR1's default kills the process).
    """
    wanted = [signum] if signum is not None else [CHECKPOINT_SIGNAL, signal.SIGTERM]
    with _lock:
        if all(s in _installed for s in wanted):
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("bluevela.runtime: signal handler not installed off the main thread")
            return False
        for s in wanted:
            if s not in _installed:
                signal.signal(s, _handler)
                _installed.add(s)
        return True


def checkpoint_requested() -> bool:
    """True once the checkpoint signal arrived (and until `clear_checkpoint_request()`).

    Installs the handler on first use, so a loop that only ever calls this is covered from the
    first step on. Cheap: a flag read, safe to call every step.
    """
    if CHECKPOINT_SIGNAL not in _installed:
        install_signal_handler()
    if _requested.is_set():
        _acted.set()
        return True
    return False


def clear_checkpoint_request() -> None:
    """Forget a request (for a loop that checkpoints and keeps training)."""
    _requested.clear()
    _acted.clear()


def stopping_for_checkpoint() -> None:
    """This rank stops because of the checkpoint request (an integration's agreed stop: a rank
    whose own flag was not set stops too). bv then requeues the job; without it (and without a
    True `checkpoint_requested()`), a rank whose training ended after a late signal tells bv
    it finished, and a step whose ranks all did so ends the job instead of requeueing it."""
    _acted.set()


def acted_on_request() -> bool:
    """True once this rank acted on the checkpoint request (see `stopping_for_checkpoint`)."""
    return _acted.is_set()


def ended_unasked() -> bool:
    """This rank's training, now over, was not ended by bv's request: it never acted on one,
    and bv's own handler is the one a request would have reached (a script with a SIGUSR1
    handler of its own may have stopped for it: that is not known here)."""
    return not _acted.is_set() and signal.getsignal(CHECKPOINT_SIGNAL) is _handler


def request_checkpoint() -> None:
    """Set the flag as the signal would (for tests and for in-process callers)."""
    _requested.set()


def attempt() -> int:
    """This run's attempt number, 1-based: 1 for the first run, n+1 after n requeues.

    From `BV_ATTEMPT` when bv's supervisor exports it, else Slurm's `SLURM_RESTART_COUNT`
    (absent on the first run), else 1 outside Slurm.
    """
    for name, offset in (("BV_ATTEMPT", 0), ("SLURM_RESTART_COUNT", 1)):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) + offset
    return 1
