"""The copy of the goodput events on a second node: a record the batch node's death cannot
take (issue 28; docs/resilience.md, "Where the time went: goodput events").

The supervisor's node is the batch node, and when it dies its epilog never runs and its
events file is lost with it. So the supervisor (`CopySender`, fed by `EventLog`) also
streams every line it writes, in order, to the agent of a second node of the step
(`keeper_of`: the step's first node that is not its own) over the step's signed channel
(bluevela/protocol/channel.py: the step's secret, an HMAC per line, bounded lines:
`copy_messages` cuts an event line into parts of COPY_CHUNK characters), the lines written
so far first, at most COPY_OUT_MAX bytes ahead of the socket. The agent (`CopyWriter`, as
the job's user) appends them to ``bv-goodput.<job>.r<restart>.u<uid>.<random>.copy.jsonl``
in ITS node's events directory (bluevela/goodput/events_dir.py), with the same rules, flags,
mode and bounds; each line once and in order; and when the supervisor's connection ends
without the step's end, one `gone` line with the time. A later step's keeper gets the whole
backlog and, once caught up, removes the older copies on its node. That node's epilog reads
the copy as it reads a record (bluevela/goodput/events_epilog.py).

Standard library only: the supervisor and its agents import it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from bluevela.goodput.events import END_LINE_MAX, MAX_FILE_BYTES, MAX_LINES
from bluevela.goodput.events_dir import (
    FILE_NAME_RE,
    MAX_SCAN,
    create_file,
    events_dir,
    node_tag,
    open_user_dir,
    unlink_own,
)

logger = logging.getLogger(__name__)

COPY_CHUNK = 1200  # characters of an event line per channel message (channel.MAX_LINE: 4096)
COPY_OUT_MAX = 64 * 1024  # bytes the copy's sender queues at once (the channel's MAX_OUT: 256 KB)


def keeper_of(nodes: list[str], host: str) -> str | None:
    """The node of a step that keeps the copy of the supervisor's events: the step's first
    node other than the supervisor's (None for a step on the supervisor's node alone)."""
    return next((n for n in nodes if n != host), None)


def copy_messages(n: int, line: bytes) -> list[dict[str, Any]]:
    """Line `n` of the events file as signed-channel messages (`ev`: part `i` of `k`)."""
    text = line.decode("utf-8", "replace").rstrip("\n")
    parts = [text[i:i + COPY_CHUNK] for i in range(0, len(text), COPY_CHUNK)] or [""]
    return [{"t": "ev", "n": n, "i": i, "k": len(parts), "d": d} for i, d in enumerate(parts)]


class CopySender:
    """The supervisor's side of one keeper's copy: sends line after line, in order, and no
    more than COPY_OUT_MAX bytes ahead of the socket; then `ev_synced` once caught up."""

    def __init__(self, chan: Any) -> None:
        self.chan = chan
        self.next = 0
        self.synced = -1

    def pump(self, written: list[bytes]) -> None:
        chan = self.chan
        if chan.broken is not None:
            return
        while self.next < len(written) and len(chan.out) < COPY_OUT_MAX:
            for msg in copy_messages(self.next, written[self.next]):
                chan.send(msg)
            self.next += 1
        if self.next == len(written) and self.synced != self.next:
            self.synced = self.next
            chan.send({"t": "ev_synced", "n": self.next})


class CopyWriter:
    """The keeper agent's side (as the job's user, on its own node): appends the lines of
    the supervisor's events file it is sent to ``<dir>/bv-goodput.<job>.r<restart>.u<uid>.
    <random>.copy.jsonl`` in its node's events directory, with the supervisor's rules
    (`events_dir.create_file`: O_EXCL|O_NOFOLLOW, mode 0600) and bounds (MAX_FILE_BYTES,
    MAX_LINES, a line at most END_LINE_MAX). Lines are taken in order, each once: a repeated
    or out-of-order one changes nothing. When the supervisor vanishes (its connection ends
    without the step's end), `gone()` appends when the keeper saw it go. Once caught up
    (`ev_synced`), the copies an earlier step's keeper left on this node are removed: this
    one holds every line of them. Never raises."""

    def __init__(self, env: Mapping[str, str], node: str) -> None:
        self.env = env
        self.node = node
        self.fd: int | None = None
        self.name = ""
        self.prefix = ""
        self.failed = False
        self.next = 0  # the next line number wanted
        self.parts: list[str] = []
        self.lines = 0
        self.bytes = 0

    def feed(self, msg: Mapping[str, Any]) -> None:
        try:
            if msg.get("t") == "ev_synced":
                if msg.get("n") == self.next and self.fd is not None:
                    self._remove_older()
                return
            n, i, k, d = msg.get("n"), msg.get("i"), msg.get("k"), msg.get("d")
            if not (isinstance(n, int) and isinstance(i, int) and isinstance(k, int)
                    and isinstance(d, str)) or n != self.next or i != len(self.parts) \
                    or not 0 <= i < k <= END_LINE_MAX // COPY_CHUNK + 1:
                return
            self.parts.append(d)
            if len(self.parts) < k:
                return
            line, self.parts = "".join(self.parts), []
            self.next += 1
            self._append(line.encode() + b"\n")
        except (TypeError, ValueError, UnicodeError):
            self.parts = []

    def gone(self) -> None:
        """The supervisor's connection ended: when, in the keeper's words."""
        if self.fd is not None:
            self._append(json.dumps({"e": "gone", "t": time.time(), "on": self.node},
                                    separators=(",", ":")).encode() + b"\n")

    def _open(self, first: bytes) -> None:
        self.failed = True  # one try
        try:
            head = json.loads(first)
            job, restart = int(head["job"]), int(head["restart"])
        except (ValueError, KeyError, TypeError):
            return
        if head.get("e") != "job" or not (0 <= job < 10**12 and 0 <= restart < 10**5):
            return
        uid = os.getuid()
        # the random part begins with this node's tag: on an events directory several nodes
        # share, only this node's epilog reads it (events_dir.copy_is_from)
        name = (f"bv-goodput.{job}.r{restart}.u{uid}.{node_tag(self.node)}"
                f"{secrets.token_hex(4)}.copy.jsonl")
        try:
            self.fd = create_file(self.env, name)
        except OSError as exc:
            logger.warning("no copy of the goodput events: cannot create %s in %s: %s", name,
                           events_dir(self.env), exc.strerror or exc)
            return
        self.name, self.failed = name, False
        self.prefix = f"bv-goodput.{job}.r{restart}.u{uid}."

    def _append(self, data: bytes) -> None:
        if self.fd is None and not self.failed:
            self._open(data)
        if self.fd is None:
            return
        if (len(data) > END_LINE_MAX or self.bytes + len(data) > MAX_FILE_BYTES
                or self.lines + 1 > MAX_LINES):
            return
        try:
            os.write(self.fd, data)
        except OSError as exc:
            logger.warning("copy of the goodput events stopped: %s", exc.strerror or exc)
            os.close(self.fd)
            self.fd, self.failed = None, True
            return
        self.lines += 1
        self.bytes += len(data)

    def _remove_older(self) -> None:
        uid = os.getuid()
        try:
            dfd = open_user_dir(self.env, uid)
        except OSError:
            return
        try:
            with os.scandir(dfd) as entries:
                old = [e.name for n, e in zip(range(MAX_SCAN), entries, strict=False)
                       if e.name.startswith(self.prefix) and e.name.endswith(".copy.jsonl")
                       and e.name != self.name and FILE_NAME_RE.match(e.name)]
            for name in old:
                unlink_own(dfd, name, uid)
        except OSError:
            pass
        finally:
            os.close(dfd)
