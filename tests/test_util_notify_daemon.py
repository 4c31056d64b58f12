"""bluevela.util.sdnotify (systemd's notify datagrams) and bluevela.util.daemon (the double fork),
against a real datagram socket and a real daemonized interpreter."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.util.sdnotify import Notifier, notify_address, watchdog_period_s
from tests.conftest import unix_dgram_listener

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "notify.sock"
    sock = unix_dgram_listener(path, 2.0)
    yield sock, path
    sock.close()


def test_notifier_sends_one_datagram_per_call(listener: tuple[socket.socket, Path]) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    n.send("READY=1", "STATUS=sampling every 10 s")
    assert sock.recv(4096) == b"READY=1\nSTATUS=sampling every 10 s"
    n.ping()  # no watchdog asked for: nothing sent
    n.send("STOPPING=1")
    assert sock.recv(4096) == b"STOPPING=1"
    n.close()
    n.send("READY=1")  # closed: a no-op, no error


def test_notifier_abstract_socket_and_watchdog() -> None:
    name = f"bv-test-notify-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000",
                      "WATCHDOG_PID": str(os.getpid())})
        assert n.watchdog_s == 3.0
        n.ping()
        assert sock.recv(4096) == b"WATCHDOG=1"
        n.close()
    finally:
        sock.close()


def test_watchdog_and_address_from_the_environment() -> None:
    assert watchdog_period_s({"WATCHDOG_USEC": "500000"}, pid=7) == 0.5
    assert watchdog_period_s({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "0"}, pid=7) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "-5"}, pid=7) is None
    assert watchdog_period_s({}, pid=7) is None
    assert notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}) == "/run/systemd/notify"
    assert notify_address({"NOTIFY_SOCKET": "@x"}) == "\0x"
    assert notify_address({"NOTIFY_SOCKET": "relative/sock"}) is None
    assert notify_address({}) is None
    silent = Notifier({})
    assert silent.sock is None and silent.watchdog_s is None
    silent.send("READY=1")
    silent.ping()


def test_notifier_without_a_listener_warns_once_per_run_of_failures(
        listener: tuple[socket.socket, Path], caplog: pytest.LogCaptureFixture) -> None:
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"})
    sock.close()
    path.unlink()  # the manager went away
    caplog.set_level(logging.WARNING, logger="bluevela.util.sdnotify")
    for _ in range(5):
        n.ping()  # never raises
    assert len(caplog.records) == 1 and "not sent" in caplog.records[0].getMessage()
    back = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    back.bind(str(path))
    back.settimeout(2.0)
    try:
        n.ping()
        assert back.recv(4096) == b"WATCHDOG=1"
        back.close()
        path.unlink()
        n.ping()
        assert len(caplog.records) == 2  # a new run of failures: one more line
    finally:
        back.close()
        n.close()


DAEMON = """
import os, sys, time
from pathlib import Path
from bluevela.util.daemon import daemonize
pidfile, log = Path(sys.argv[1]), Path(sys.argv[2])
daemonize(pidfile, log)
print(f"daemon {os.getpid()} sid {os.getsid(0)} stdin {os.readlink('/proc/self/fd/0')}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_daemonize_returns_at_once_and_detaches(tmp_path: Path) -> None:
    pidfile, log = tmp_path / "d.pid", tmp_path / "d.log"
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", DAEMON, str(pidfile), str(log)],
                       cwd=REPO, capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p
    assert time.monotonic() - t < 20  # the starter came back; the daemon sleeps 60 s
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "to stderr" not in (
            log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    try:
        text = log.read_text()
        assert f"daemon {pid} " in text and "stdin /dev/null" in text and "to stderr" in text
        sid = os.getsid(pid)
        assert sid != os.getsid(0) and sid != pid  # its own session, never its leader
        assert oct(os.stat(log).st_mode & 0o777) == oct(0o640 & ~_umask())
        fds = sorted(int(f) for f in os.listdir(f"/proc/{pid}/fd"))
        assert fds == [0, 1, 2], fds  # no stray copies of /dev/null or the log
    finally:
        os.kill(pid, signal.SIGTERM)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
