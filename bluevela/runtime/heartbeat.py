"""Progress heartbeat for bv's hang watchdog (`bv submit --hang-timeout S`).

A rank calls `progress(step)` once per training step. Each call may send ONE small UDP
datagram to the job's supervisor (the address is in ``BV_HEARTBEAT``, set by bv inside the
job); calls within `MIN_INTERVAL_S` of the last datagram send nothing. It never blocks, never
raises and is a no-op outside a bv job.

Why UDP: nodes share no file system, a datagram costs one syscall and cannot stall a training
loop (no connect, no back-pressure), and a lost datagram only delays one beat of many (the
hang timeout is tens of seconds; beats go out every second). The wire format is one ASCII line:

    bvhb1 <rank> <node> <step> <pid>

(`step` is -1 when the caller gave none). The supervisor parses it with `parse_beat()`.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_ADDR = "BV_HEARTBEAT"
MAGIC = "bvhb1"
MIN_INTERVAL_S = 1.0
MAX_DATAGRAM = 512


@dataclass(frozen=True)
class Beat:
    """One heartbeat as the supervisor receives it."""

    rank: int
    node: str
    step: int
    pid: int


def format_beat(beat: Beat) -> bytes:
    node = "".join(c for c in beat.node if c.isalnum() or c in "-_.") or "?"
    return f"{MAGIC} {beat.rank} {node} {beat.step} {beat.pid}".encode("ascii")[:MAX_DATAGRAM]


def parse_beat(data: bytes) -> Beat | None:
    """The beat in a datagram, or None for anything that is not one (never raises)."""
    try:
        words = data.decode("ascii").split()
        if len(words) != 5 or words[0] != MAGIC:
            return None
        return Beat(rank=int(words[1]), node=words[2], step=int(words[3]), pid=int(words[4]))
    except (UnicodeDecodeError, ValueError):
        return None


def parse_addr(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


class _Sender:
    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.target: tuple[str, int] | None = None
        self.env_value: str | None = None
        self.last_sent = float("-inf")

    def send(self, step: int | None) -> None:
        value = os.environ.get(ENV_ADDR)
        if not value:
            return
        now = time.monotonic()
        if now - self.last_sent < MIN_INTERVAL_S:
            return
        if value != self.env_value:
            self.env_value, self.target = value, None
            addr = parse_addr(value)
            if addr is None:
                logger.warning("ignoring %s=%r: not HOST:PORT", ENV_ADDR, value)
                return
            try:
                info = socket.getaddrinfo(addr[0], addr[1], socket.AF_INET, socket.SOCK_DGRAM)
                host, port = info[0][4][:2]
                self.target = (str(host), int(port))
                if self.sock is None:
                    self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    self.sock.setblocking(False)
            except OSError as exc:
                logger.warning("heartbeat address %s unusable: %s", value, exc)
                return
        if self.target is None or self.sock is None:
            return
        beat = Beat(rank=_int_env("RANK", 0), node=socket.gethostname(),
                    step=-1 if step is None else int(step), pid=os.getpid())
        try:
            self.sock.sendto(format_beat(beat), self.target)
        except OSError:  # a full buffer or an unreachable supervisor: skip this beat
            return
        self.last_sent = now


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return default


_SENDER = _Sender()


def progress(step: int | None = None) -> None:
    """Tell bv's hang watchdog this rank made progress (reached `step`). Cheap; never raises."""
    try:
        _SENDER.send(step)
    except Exception:  # noqa: BLE001 - a heartbeat must never break training
        logger.debug("heartbeat failed", exc_info=True)
