"""systemd's notify protocol (sd_notify(3)) without a library: one datagram per message.

A service of `Type=notify` sends `READY=1` once started, `WATCHDOG=1` at least every
`WatchdogSec/2` while it is alive, `STATUS=...` for `systemctl status`, and `STOPPING=1` on its
way out. The manager passes the socket in `$NOTIFY_SOCKET` (a path, or `@name` in the abstract
namespace) and the watchdog period in `$WATCHDOG_USEC` (for the process `$WATCHDOG_PID` names,
when set). Standard library only; outside systemd every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)


def notify_address(env: Mapping[str, str]) -> str | None:
    """The socket address `$NOTIFY_SOCKET` names (`@x`: the abstract namespace); None when
    unset or neither a path nor an abstract name."""
    addr = env.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        return "\0" + addr[1:]
    if addr.startswith("/"):
        return addr
    return None


def watchdog_period_s(env: Mapping[str, str], pid: int | None = None) -> float | None:
    """The watchdog period in seconds, or None when there is none for this process."""
    usec, for_pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    pid = os.getpid() if pid is None else pid
    if usec.isdigit() and int(usec) > 0 and (not for_pid or for_pid == str(pid)):
        return int(usec) / 1e6
    return None


class Notifier:
    """Datagrams to `$NOTIFY_SOCKET`; silent without it. The watchdog is on when
    `$WATCHDOG_USEC` is set (and `$WATCHDOG_PID`, if set, is us). A send never blocks and
    never raises: a failure is logged once per run of failures."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.addr = notify_address(env)
        self.watchdog_s = watchdog_period_s(env)
        self.sock: socket.socket | None = None
        self._failed = False
        if self.addr is not None:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError as exc:
                logger.warning("no systemd notifications: %s", exc.strerror or exc)

    def send(self, *lines: str) -> None:
        """One datagram of `lines` (`READY=1`, `STATUS=...`), newline-separated."""
        if self.sock is None or self.addr is None:
            return
        try:
            self.sock.sendto("\n".join(lines).encode("utf-8", "replace"), socket.MSG_DONTWAIT,
                             self.addr)
            self._failed = False
        except OSError as exc:
            if not self._failed:  # once per run of failures
                logger.warning("systemd notification not sent: %s", exc.strerror or exc)
            self._failed = True

    def ping(self) -> None:
        """`WATCHDOG=1` when the watchdog is on."""
        if self.watchdog_s is not None:
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
