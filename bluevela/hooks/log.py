"""One syslog line per hook run: what an admin reads with `journalctl -t bluevela`.

slurmd shows a hook's output only at debug2 when it exits 0 (and the hooks nearly always exit
0), so drains, breaker holds, audit verdicts and "hook error, nothing checked" would be
invisible at default log levels. Each run therefore sends one line, as key=value pairs:

    bluevela[4242]: prolog job=42 node=gpu017 verdict=CRITICAL action=drained time=0.21s
        exit=1 detail="ib: mlx5_3/1 state DOWN"

`action` is one of: drained, held (the fleet breaker or an operator's drain kept it from
draining, or the drain failed), resumed, none, audit-would-drain, audit-would-resume,
off-would-drain, off-would-resume (the kill switch), off (the node's hooks are switched off:
nothing checked), skipped (a healthcheck while another hook runs), hook-error (nothing
checked; the hook failed open).

Sent as an RFC 3164 datagram to `$BV_SYSLOG_SOCKET` (hook.env; default `/dev/log`, which both
journald and rsyslog serve; `off` sends nothing) with facility `$BV_SYSLOG_FACILITY` (daemon
by default, or local0..local7, user). The socket is non-blocking: a missing `/dev/log`, a
stalled journald or a full receive queue drops the line, never the hook (libc's syslog(3)
blocks when the receiver's queue is full, which is why this is not the `syslog` module); a
stream socket in its place gets one try bounded at 0.2 s. When Python cannot run at all, the
shims write a line of the same fields through /usr/bin/logger (prolog_epilog/prolog).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.hooks.phases import HookOutcome

DEFAULT_SOCKET = "/dev/log"
TAG = "bluevela"
MAX_VALUE = 400  # characters of one field
MAX_LINE = 2048  # bytes of message; journald and rsyslog take more, RFC 3164 says 1024
FACILITIES = {"daemon": 3, "user": 1, **{f"local{i}": 16 + i for i in range(8)}}
# syslog severities
ERR, WARNING, NOTICE, INFO = 3, 4, 5, 6


def facility(environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    return FACILITIES.get((env.get("BV_SYSLOG_FACILITY") or "daemon").strip().lower(), 3)


def socket_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The socket lines go to; None: none (`BV_SYSLOG_SOCKET=off`, or not an absolute path)."""
    env = os.environ if environ is None else environ
    value = (env.get("BV_SYSLOG_SOCKET") or DEFAULT_SOCKET).strip()
    return value if value.startswith("/") else None


def _value(value: object) -> str:
    """One field's value on one line: printable, quoted when it has a space or a quote."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(value)[:MAX_VALUE])
    if not text or any(ch in text for ch in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def format_fields(phase: str, fields: Mapping[str, object]) -> str:
    """`<phase> key=value ...` (None values left out), bounded to MAX_LINE bytes."""
    parts = [_value(phase)]
    parts += [f"{k}={_value(v)}" for k, v in fields.items() if v is not None]
    line = " ".join(parts)
    data = line.encode("utf-8", "replace")
    if len(data) > MAX_LINE:
        line = data[:MAX_LINE - 3].decode("utf-8", "ignore") + "..."
    return line


def send(message: str, severity: int = INFO, environ: Mapping[str, str] | None = None) -> bool:
    """Send one line to syslog; True if the socket took it. Never raises, never blocks."""
    path = socket_path(environ)
    if path is None:
        return False
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime())
    pri = facility(environ) * 8 + severity
    data = f"<{pri}>{stamp} {TAG}[{os.getpid()}]: {message}".encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            try:
                s.sendto(data, path)
                return True
            except OSError as exc:
                if exc.errno != errno.EPROTOTYPE:
                    return False  # no socket, nobody listening, queue full: dropped
        # A stream socket at the path (some rsyslog set-ups): one bounded try.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            s.connect(path)
            s.sendall(data + b"\n")
            return True
    except OSError:
        return False


def hook_line(phase: str, fields: Mapping[str, object], severity: int = INFO,
              environ: Mapping[str, str] | None = None) -> str:
    """Format and send a hook run's line; returns the line (without the syslog header)."""
    line = format_fields(phase, fields)
    send(line, severity, environ)
    return line


def run_line(phase: str, who: Mapping[str, object], started: float, action: str, *,
             verdict: str = "none", exit_code: int = 0, detail: str | None = None) -> str:
    """The line of a run that checked nothing (off, skipped, hook-error)."""
    severity = ERR if action == "hook-error" else NOTICE if action == "off" else INFO
    return hook_line(phase, {**who, "verdict": verdict, "action": action,
                             "time": f"{time.monotonic() - started:.2f}s", "exit": exit_code,
                             "detail": detail}, severity)


def action_of(outcome: HookOutcome) -> tuple[str, str | None]:
    """(action, its note) of a finished run."""
    drain = outcome.drain
    if drain.drained:
        return "drained", None
    if drain.gated:
        return f"{drain.gated}-would-drain", drain.why_not
    if drain.attempted:
        return "held", drain.why_not or drain.error
    if outcome.resumed:
        return "resumed", outcome.resume_note
    if outcome.resume_gated:
        return f"{outcome.resume_gated}-would-resume", outcome.resume_note
    return "none", None


def outcome_line(outcome: HookOutcome, started: float, mode: str = "enforce") -> str:
    """The line of a run that checked: verdict, action, the drain detail or what held it."""
    report = outcome.report
    action, note = action_of(outcome)
    detail = report.drain_detail() or "; ".join(
        f"{c.name} {c.status.name}: {c.summary}" for c in report.checks if int(c.status)) or None
    if note:
        detail = f"{detail}; {note}" if detail else note
    severity = (WARNING if action in ("drained", "held") or report.status.severity >= 2
                else NOTICE if action != "none" else INFO)
    return hook_line(outcome.phase, {
        "job": outcome.job_id, "node": outcome.node, "verdict": report.status.name,
        "action": action, "time": f"{time.monotonic() - started:.2f}s",
        "exit": outcome.exit_code, "mode": None if mode == "enforce" else mode,
        "detail": detail}, severity)
