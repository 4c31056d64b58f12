"""The signed line channel between a node agent and the supervisor, over TCP.

On accept the supervisor sends the challenge line ``bvch1 <nonce>`` (`challenge_line`); the
agent reads it (`read_challenge`). After that every line either way is ``<mac> <json>``: an
HMAC (`keys.mac`, the line key) over the direction, the nonce, the line's number on this
connection and the JSON text. Both ends hold a `Channel`: it numbers, signs and queues what
it sends, and verifies, bounds and parses what it reads (`receive`).
"""

from __future__ import annotations

import hmac
import json
import select
import socket
import time
from collections.abc import Mapping

from bluevela.protocol.keys import MAC_HEX, mac

CHALLENGE = b"bvch1"
CHALLENGE_MAX = 128  # bytes of the challenge line read at most
MAX_LINE = 4096  # bytes of one line (a real message is under 200)
RECV_BYTES = 65536
# Bytes a channel holds for a peer that does not read; past it the connection is dropped (a
# ping a second fills it in hours: a peer that far behind is gone).
MAX_OUT = 256 * 1024


class ChannelError(Exception):
    """The peer broke the protocol (bad MAC, oversized or garbled line): drop the peer."""


def challenge_line(nonce: bytes) -> bytes:
    return CHALLENGE + b" " + nonce.hex().encode() + b"\n"


def parse_challenge(line: bytes) -> bytes | None:
    word, _, value = line.strip().partition(b" ")
    if word != CHALLENGE or len(value) != 32:
        return None
    try:
        return bytes.fromhex(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def read_challenge(sock: socket.socket) -> bytes | None:
    """The nonce of the challenge line read from a blocking `sock` (a byte at a time: nothing
    after the line is taken from the socket); None for anything else."""
    line = b""
    while not line.endswith(b"\n") and len(line) < CHALLENGE_MAX:
        chunk = sock.recv(1)
        if not chunk:
            return None
        line += chunk
    return parse_challenge(line)


class Channel:
    """One end of the signed line channel over a connected TCP socket.

    Args:
        key: the line key (`keys.line_key`).
        nonce: the supervisor's challenge for this connection.
        outgoing: this end's direction tag, ``b"a"`` (agent -> supervisor) or ``b"s"``.
    """

    def __init__(self, sock: socket.socket, key: bytes, nonce: bytes, outgoing: bytes) -> None:
        self.sock = sock
        self.key = key
        self.nonce = nonce
        self.out_tag = outgoing
        self.in_tag = b"s" if outgoing == b"a" else b"a"
        self.sent = 0
        self.received = 0
        self.buf = b""
        self.out = bytearray()  # encoded lines the socket has not taken yet
        self.broken: str | None = None  # why the channel can no longer send, once it cannot

    def _mac(self, tag: bytes, number: int, body: bytes) -> bytes:
        return mac(self.key, b"%s|%s|%d|%s" % (tag, self.nonce, number, body))

    def encode(self, msg: Mapping[str, object]) -> bytes:
        body = json.dumps(msg, separators=(",", ":")).encode()
        line = self._mac(self.out_tag, self.sent, body) + b" " + body + b"\n"
        self.sent += 1
        return line

    def send(self, msg: Mapping[str, object]) -> None:
        """Queue `msg` and send what the socket takes now. A line is numbered (and MACed) once
        and its bytes are kept until sent in full: a partial write on a non-blocking socket
        never leaves half a line, so the peer's next MAC still verifies. A peer that stops
        reading (over MAX_OUT pending) or a send error marks the channel `broken`; the owner
        drops the connection on it."""
        if self.broken is not None:
            return
        self.out += self.encode(msg)
        if len(self.out) > MAX_OUT:
            self.broken = f"the peer read nothing of {len(self.out)} bytes"
            return
        self.flush()

    def flush(self) -> bool:
        """Send what the socket takes now; True when nothing is left pending."""
        while self.out and self.broken is None:
            try:
                sent = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                self.broken = f"send: {exc.strerror or exc}"
                return False
            del self.out[:sent]
        return not self.out

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket, first waiting up to `linger_s` for pending lines to go out."""
        deadline = time.monotonic() + linger_s
        try:
            poll = select.poll()
            poll.register(self.sock, select.POLLOUT)
            while not self.flush() and self.broken is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                poll.poll(min(left, 0.2) * 1000)
        finally:
            self.sock.close()

    def receive(self) -> list[dict[str, object]] | None:
        """The messages the socket has now: ``[]`` when it has none (non-blocking), None when
        the peer closed it or it failed. Raises ChannelError (drop the peer) as `feed`."""
        try:
            data = self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        return self.feed(data)

    def feed(self, data: bytes) -> list[dict[str, object]]:
        """The messages completed by `data`. Raises ChannelError on a line over MAX_LINE, a
        MAC that does not verify, or a verified line that is not a JSON object."""
        self.buf += data
        out: list[dict[str, object]] = []
        while (end := self.buf.find(b"\n")) >= 0:
            if end > MAX_LINE:
                raise ChannelError(f"a line over {MAX_LINE} bytes")
            line, self.buf = self.buf[:end], self.buf[end + 1:]
            out.append(self._verify(line))
        if len(self.buf) > MAX_LINE:
            raise ChannelError(f"a line over {MAX_LINE} bytes")
        return out

    def _verify(self, line: bytes) -> dict[str, object]:
        tag, _, body = line.partition(b" ")
        want = self._mac(self.in_tag, self.received, body)
        if len(tag) != MAC_HEX or not hmac.compare_digest(tag, want):
            raise ChannelError("a line without a valid MAC")
        self.received += 1
        try:
            msg = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ChannelError("a signed line that is not JSON") from exc
        if not isinstance(msg, dict):
            raise ChannelError("a signed line that is not a JSON object")
        return msg
