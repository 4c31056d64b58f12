"""Progress heartbeat for bv's hang watchdog (`bv submit --hang-timeout S`).

A rank calls `progress(step)` once per training step. That call only records the step and the
time (no syscall); the first call also starts a daemon thread that sends ONE small UDP
datagram per second to its node's agent, which sends the supervisor one aggregate of its
ranks' beats (address in ``BV_HEARTBEAT``, set by bv inside the job: the agent's loopback
port; checkpoint records go to ``BV_CHECKPOINT_ADDR``, the supervisor's, when it is set; every ``BV_HEARTBEAT_INTERVAL_S`` seconds when the supervisor sets it, for a long
hang timeout on a big job). Each datagram says: this rank, its node, its last step, how long ago that was, and
where its main thread is right now (innermost frame, and whether it waits inside
``torch.distributed``). When a rank hangs, its peers soon wait in the next collective; the one
that is NOT in a collective is the one that stopped first, which is what bv reports.
It never blocks, never raises and is a no-op outside a bv job.

Why UDP: nodes share no file system, a datagram costs one syscall and cannot stall a training
loop (no connect, no back-pressure), and a lost datagram only delays one beat of many (the
hang timeout is tens of seconds; beats go out every second or every eighth of it). A beat is one signed ASCII line
(`Beat`, bluevela/protocol/messages.py), and so is the datagram `checkpoint_saved()` sends,
both with a key from the step's secret, ``BV_JOB_SECRET``. Without that secret nothing is
sent: the supervisor believes only signed datagrams, because anyone on the network can send
it one.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping

from bluevela.protocol.keys import beat_key, secret_from_env
from bluevela.protocol.messages import (
    TIER_BITS,
    Beat,
    CkptBgMsg,
    CkptMsg,
    ResumeMsg,
    format_beat,
    format_ckpt,
    format_ckpt_bg,
    format_resume,
)
from bluevela.runtime.checkpoint import ended_unasked

logger = logging.getLogger(__name__)

ENV_ADDR = "BV_HEARTBEAT"
# Where checkpoint datagrams go when not to BV_HEARTBEAT: the node's agent takes the beats
# (bluevela/launch/agent.py, `Aggregator`), the supervisor the checkpoint records.
CKPT_ENV = "BV_CHECKPOINT_ADDR"
INTERVAL_S = 1.0
INTERVAL_ENV = "BV_HEARTBEAT_INTERVAL_S"  # seconds between beats, 0.2-60 (the supervisor's)


def interval(env: Mapping[str, str] | None = None) -> float:
    """Seconds between beats: ``BV_HEARTBEAT_INTERVAL_S`` when it is a number in 0.2-60,
    else INTERVAL_S."""
    text = (os.environ if env is None else env).get(INTERVAL_ENV, "")
    try:
        value = float(text) if 0 < len(text) <= 12 else INTERVAL_S
    except ValueError:
        return INTERVAL_S
    return value if 0.2 <= value <= 60 else INTERVAL_S


def parse_addr(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def main_thread_position() -> tuple[bool, str]:
    """(waiting inside torch.distributed, innermost `file:line:function`) of the main thread."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return False, "?"
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}"
    in_coll = False
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in name:
            in_coll = True
            break
        frame = frame.f_back
    return in_coll, where


class _Sender:
    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.target: tuple[str, int] | None = None
        self.ck_target: tuple[str, int] | None = None  # checkpoint datagrams' (else target)
        self.key = b""
        self.seq = 0
        self.ck_seq = 0
        self.step = -1
        self.finished = False
        self.last_progress = time.monotonic()
        self.thread_pid: int | None = None  # the process whose thread runs (fork-safe)
        self.sock_pid: int | None = None  # the process whose socket `sock` is
        self.lock = threading.Lock()
        self.ck_lock = threading.Lock()  # one checkpoint datagram numbered and sent at a time

    def progress(self, step: int | None) -> None:
        self.step = -1 if step is None else int(step)
        self.last_progress = time.monotonic()
        if self.thread_pid != os.getpid():
            self._start()

    def _start(self) -> None:
        with self.lock:
            if self.thread_pid == os.getpid():
                return
            self.thread_pid = os.getpid()
            if not self._socket():
                return
            self.send()
            threading.Thread(target=self._loop, name="bv-heartbeat", daemon=True).start()
            # A rank whose script returned is tearing down (the process group, the interpreter),
            # which may take longer than a short hang timeout on a loaded node: say so.
            atexit.register(self.finish)

    def finish(self) -> None:
        """Training is over: every later beat says so (the watchdog stops watching this
        rank; the supervisor learns whether it ended at the checkpoint request or simply
        ended), and one goes out now. A rank that never beat starts now (an integration)."""
        if self.thread_pid != os.getpid():
            self.finished = False  # a forked child's own training
            self._start()
        if self.finished or self.thread_pid != os.getpid():
            return
        self.finished = True
        self.send()

    def _socket(self) -> bool:
        """This process's socket to the supervisor (made once per process: a forked child
        gets its own). False outside a bv job."""
        if self.sock_pid != os.getpid():
            self.sock_pid = os.getpid()
            self.target = self.ck_target = None
            value = os.environ.get(ENV_ADDR)
            if value and self._connect(value):
                self.ck_target = self.target
                ck = os.environ.get(CKPT_ENV)
                if ck:
                    self.ck_target = _resolve(ck) or self.target
        return self.target is not None

    def checkpoint(self, step: int | None, started: float, ended: float) -> None:
        """One signed datagram: a checkpoint of `step` ran from `started` to `ended`
        (monotonic). Non-blocking; a lost datagram loses this one record only. It starts no
        heartbeat: a script that never calls progress() is not watched for hangs."""
        self._send_ck(lambda seq, now: format_ckpt(CkptMsg(
            rank=_int_env("RANK", 0), step=-1 if step is None else int(step), pid=os.getpid(),
            seq=seq, start_age_s=max(0.0, now - started), end_age_s=max(0.0, now - ended)),
            self.key))

    def _send_ck(self, build: Callable[[int, float], bytes]) -> None:
        """Send the checkpoint-family datagram `build(seq, now)` makes. One sequence for the
        family (the supervisor keeps one per rank and pid), numbered and sent under a lock:
        the store's writer thread sends beside the training loop."""
        if self.sock_pid != os.getpid():
            with self.lock:
                self._socket()
        if self.ck_target is None or self.sock is None:
            return
        with self.ck_lock:
            self.ck_seq += 1
            try:
                self.sock.sendto(build(self.ck_seq, time.monotonic()), self.ck_target)
            except OSError:  # a full buffer or an unreachable supervisor: skip this record
                pass

    def _connect(self, value: str) -> bool:
        secret = secret_from_env()
        if secret is None:
            logger.warning("%s is set but the job secret is not: no heartbeat", ENV_ADDR)
            return False
        self.key = beat_key(secret)
        target = _resolve(value)
        if target is None:
            return False
        try:
            self.target = target
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.setblocking(False)
        except OSError as exc:
            logger.warning("heartbeat address %s unusable: %s", value, exc)
            return False
        return True

    def send(self) -> None:
        if self.target is None or self.sock is None:
            return
        in_coll, where = main_thread_position()
        self.seq += 1
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        beat = Beat(rank=_int_env("RANK", 0), node=node, step=self.step,
                    pid=os.getpid(), age_s=time.monotonic() - self.last_progress,
                    in_collective=in_coll, where=where, seq=self.seq, finished=self.finished,
                    at_request=self.finished and not ended_unasked())
        try:
            self.sock.sendto(format_beat(beat, self.key), self.target)
        except OSError:  # a full buffer or an unreachable supervisor: skip this beat
            pass

    def _loop(self) -> None:
        every = interval()
        while True:
            time.sleep(every)
            try:
                self.send()
            except Exception:  # noqa: BLE001 - a heartbeat must never break training
                logger.debug("heartbeat failed", exc_info=True)


def _resolve(value: str) -> tuple[str, int] | None:
    """HOST:PORT as an IPv4 address; None (said once in the log) when it is not one."""
    addr = parse_addr(value)
    if addr is None:
        logger.warning("ignoring heartbeat address %r: not HOST:PORT", value)
        return None
    try:
        info = socket.getaddrinfo(addr[0], addr[1], socket.AF_INET, socket.SOCK_DGRAM)
    except OSError as exc:
        logger.warning("heartbeat address %s unusable: %s", value, exc)
        return None
    host, port = info[0][4][:2]
    return str(host), int(port)


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


_SENDER = _Sender()


def progress(step: int | None = None) -> None:
    """Tell bv's hang watchdog this rank made progress (reached `step`). Cheap; never raises."""
    try:
        _SENDER.progress(step)
    except Exception:  # noqa: BLE001 - a heartbeat must never break training
        logger.debug("heartbeat failed", exc_info=True)


def finished() -> None:
    """Tell bv's hang watchdog this rank's training is over (call it after the training loop,
    before the final collectives and the process group's teardown): it stops watching the
    rank, so a slow exit is not a hang. Called at interpreter exit too. Never raises."""
    try:
        _SENDER.finish()
    except Exception:  # noqa: BLE001 - a heartbeat must never break training
        logger.debug("heartbeat failed", exc_info=True)


def checkpoint_saved(step: int | None = None, *, started: float | None = None) -> None:
    """Tell bv a checkpoint of `step` was just saved (for the goodput ledger: the time since
    it is what a failure now would lose). `started`: `time.monotonic()` when the save began,
    when known (`checkpointing()` passes it). One non-blocking datagram; never raises."""
    try:
        now = time.monotonic()
        _SENDER.checkpoint(step, now if started is None else min(started, now), now)
    except Exception:  # noqa: BLE001 - a record must never break training
        logger.debug("checkpoint event failed", exc_info=True)


def checkpoint_background(step: int, started: float, ended: float,
                          tiers: Collection[str], *, rank: int | None = None) -> None:
    """Tell bv a save's background phase (the checkpoint store's writes after the loop went
    on) ran from `started` to `ended` (`time.monotonic()`), and in which places this rank's
    shard of `step` is now complete ("local", "partner", "shared"). The ledger keeps it apart
    from the stall. `rank`: the sender's (default: ``RANK``). One non-blocking datagram;
    never raises."""
    try:
        bits = sum(TIER_BITS[t] for t in set(tiers) if t in TIER_BITS)
        who = _int_env("RANK", 0) if rank is None else int(rank)
        _SENDER._send_ck(lambda seq, now: format_ckpt_bg(CkptBgMsg(
            who, int(step), os.getpid(), seq, max(0.0, now - started),
            max(0.0, now - ended), bits), _SENDER.key))
    except Exception:  # noqa: BLE001 - a record must never break training
        logger.debug("checkpoint event failed", exc_info=True)


def checkpoint_resumed(step: int, started: float, ended: float, tiers: Mapping[str, int],
                       skipped: int, *, rank: int | None = None) -> None:
    """Tell bv the job resumed `step` (one rank says it for all: the checkpoint store's rank
    0), from `started` to `ended` (`time.monotonic()`), with `tiers` how many ranks read their
    shard from each place ("local", "partner", "shared") and `skipped` how many copies were
    passed over (torn, corrupt, missing). `rank`: the sender's (default: ``RANK``). One
    non-blocking datagram; never raises."""
    try:
        who = _int_env("RANK", 0) if rank is None else int(rank)
        _SENDER._send_ck(lambda seq, now: format_resume(ResumeMsg(
            who, int(step), os.getpid(), seq, max(0.0, now - started),
            max(0.0, now - ended), int(tiers.get("local", 0)), int(tiers.get("partner", 0)),
            int(tiers.get("shared", 0)), int(skipped)), _SENDER.key))
    except Exception:  # noqa: BLE001 - a record must never break training
        logger.debug("checkpoint event failed", exc_info=True)


@contextlib.contextmanager
def checkpointing(step: int | None = None) -> Iterator[None]:
    """``with runtime.checkpointing(step): save()``: records the save's start and end, so the
    ledger knows what checkpoints cost. Nothing is recorded when the save raises."""
    started = time.monotonic()
    yield
    checkpoint_saved(step, started=started)
