"""The copy on another node: who keeps whose shards, and the authenticated transfer.

Partners (`choose_partners`, pure): the job's nodes in a ring ordered by switch (site.yaml
`checkpoint.switches`, where the site describes its topology) then name, each node's partner
half the ring away, so with two or more switches no node's partner shares its switch unless one
switch holds more than half the nodes (then the nearest node on another switch is taken where
there is one). A node's partner holds a copy of every shard its ranks write.

Transfer: every rank runs a `ShardServer` (a TCP port on all addresses) for the shards on its
node. A connection is one request:

    server -> client   "BVCK1 <server nonce>\\n"
    client -> server   <request JSON>\\n<mac>\\n       mac = HMAC(k, "req|" nonce | request)
    put:  client -> server   the shard file's bytes      request names step, rank, size and
          server -> client   "ok\\n" | "err <why>\\n"     the file's digest; renamed into place
                                                          only when the whole file verified and
                                                          its digest is the one MACed
    get:  server -> client   <reply JSON>\\n<mac>\\n       mac = HMAC(k, "get|" client nonce | reply)
                             then the file's bytes        reply: size, digest ("missing": none)

The key is derived from the step's secret (`BV_JOB_SECRET`, which bv hands every rank of a
step); a request whose MAC fails, that is too large, malformed or slower than its deadline is
dropped with its connection, never the server. At most `MAX_CONN` connections are served at
once (more are closed at accept). Standard library only.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bluevela.ckpt.shardfile import ShardError, ShardInfo, copy_stream, open_shard, read_stream

logger = logging.getLogger(__name__)

T = TypeVar("T")

HELLO = b"BVCK1 "
MAX_LINE = 4096
MAX_CONN = 8
IO_TIMEOUT_S = 30.0  # one blocking read or write
MIN_RATE_BPS = 20e6  # a transfer's deadline: 60 s + its size at this rate
BASE_DEADLINE_S = 60.0
MAX_SHARD_BYTES = 1 << 40  # the largest shard file a fetch takes, by default


def deadline_for(size: int) -> float:
    return BASE_DEADLINE_S + size / MIN_RATE_BPS


def choose_partners(nodes: Sequence[str], switch_of: dict[str, str] | None = None
                    ) -> dict[str, str]:
    """Each node's partner (see the module docstring); {} for fewer than two nodes."""
    switch_of = switch_of or {}
    uniq = sorted(set(nodes), key=lambda n: (switch_of.get(n, ""), n))
    n = len(uniq)
    if n < 2:
        return {}
    out: dict[str, str] = {}
    half = n // 2
    for i, node in enumerate(uniq):
        partner = uniq[(i + half) % n]
        sw = switch_of.get(node)
        if sw is not None and switch_of.get(partner) == sw:
            for d in range(1, n):
                cand = uniq[(i + half + d) % n]
                if cand != node and switch_of.get(cand) != sw:
                    partner = cand
                    break
        out[node] = partner
    return out


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join(parts), "sha256").hexdigest().encode()


class TransferError(Exception):
    """A transfer that did not happen (`reason`)."""


def _readline(f: Any) -> bytes:
    line = f.readline(MAX_LINE + 1)
    if not line.endswith(b"\n") or len(line) > MAX_LINE:
        raise TransferError("line too long or cut short")
    return line[:-1]


class _Deadline:
    """A socket whose every operation is bounded by both the per-operation timeout and the
    transfer's overall deadline."""

    def __init__(self, sock: socket.socket, deadline_s: float) -> None:
        self.sock = sock
        self.end = time.monotonic() + deadline_s

    def arm(self) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferError("deadline passed")
        self.sock.settimeout(min(IO_TIMEOUT_S, left))


class _Reader:
    """A file-like reader over a socket that re-arms the deadline before each read."""

    def __init__(self, dl: _Deadline) -> None:
        self.dl = dl
        self.f = dl.sock.makefile("rb")

    def read(self, n: int = -1) -> bytes:
        self.dl.arm()
        return self.f.read(n)

    def readline(self, limit: int = -1) -> bytes:
        self.dl.arm()
        return self.f.readline(limit)

    def readinto(self, buf: memoryview) -> int:
        self.dl.arm()
        return self.f.readinto(buf) or 0

    def close(self) -> None:
        self.f.close()


@dataclass
class ServerStats:
    received: int = 0
    sent: int = 0
    refused: int = 0


class ShardServer:
    """Serves this node's shards to the job's other nodes and takes their copies.

    Args:
        key: the transfer key (`transfer_key`).
        held_dir: `(step) -> directory fd` where a partner's copy of that step goes
            (created; the caller closes nothing: the fd is closed here).
        find: `(step, rank) -> (directory fd, name) | None`, a shard this node holds.
        admit: `(step, rank, size) -> reason | None`: room for a copy (the budget), or why not.
        max_bytes: the largest shard file taken.
    """

    def __init__(self, key: bytes, held_dir: Callable[[int], int],
                 find: Callable[[int, int], tuple[int, str] | None],
                 admit: Callable[[int, int, int], str | None], max_bytes: int,
                 host: str = "0.0.0.0") -> None:
        self.key = key
        self.held_dir = held_dir
        self.find = find
        self.admit = admit
        self.max_bytes = max_bytes
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.slots = threading.BoundedSemaphore(MAX_CONN)
        self.stats = ServerStats()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="bv-ckpt-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            if not self.slots.acquire(blocking=False):
                conn.close()  # over the cap: the client retries or takes the next place
                self.stats.refused += 1
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="bv-ckpt-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._one(conn)
        except (TransferError, ShardError, OSError, ValueError, KeyError, TypeError) as exc:
            self.stats.refused += 1
            logger.info("bv ckpt: dropped a transfer: %s", exc)
            try:
                conn.sendall(b"err " + str(exc).encode()[:200].replace(b"\n", b" ") + b"\n")
            except OSError:
                pass
        finally:
            conn.close()
            self.slots.release()

    def _one(self, conn: socket.socket) -> None:
        dl = _Deadline(conn, BASE_DEADLINE_S)
        nonce = secrets.token_hex(16).encode()
        dl.arm()
        conn.sendall(HELLO + nonce + b"\n")
        r = _Reader(dl)
        try:
            req, step, rank = self._request(r, nonce)
            if req["op"] == "put":
                self._receive(conn, dl, r, req, step, rank)
            elif req["op"] == "get":
                self._send(conn, dl, req, step, rank)
            else:
                raise TransferError("unknown op")
        finally:
            r.close()

    def _request(self, r: _Reader, nonce: bytes) -> tuple[dict[str, Any], int, int]:
        """The client's request, its MAC over our nonce checked, and its step and rank."""
        req_raw = _readline(r)
        mac = _readline(r)
        if not hmac.compare_digest(mac, _mac(self.key, b"req", nonce, req_raw)):
            raise TransferError("bad MAC")
        req = json.loads(req_raw)
        step, rank = int(req["step"]), int(req["rank"])
        if not (0 <= step < 10**12 and 0 <= rank < 10**7):
            raise TransferError("step or rank out of range")
        return req, step, rank

    def _receive(self, conn: socket.socket, dl: _Deadline, r: _Reader, req: dict[str, Any],
                 step: int, rank: int) -> None:
        """Receive a partner's shard into this node's held copies (size capped, admitted,
        its digest verified as it is written)."""
        size, digest = int(req["size"]), str(req["digest"])
        if not 0 < size <= self.max_bytes:
            raise TransferError(f"size {size} over {self.max_bytes}")
        if (why := self.admit(step, rank, size)) is not None:
            raise TransferError(why)
        dl.end = time.monotonic() + deadline_for(size)
        dfd = self.held_dir(step)
        try:
            from bluevela.ckpt.layout import shard_name

            copy_stream(r, size, dfd, shard_name(rank),  # type: ignore[arg-type]
                        expect={"step": step, "rank": rank}, digest=digest)
        finally:
            os.close(dfd)
        self.stats.received += size
        dl.arm()
        conn.sendall(b"ok\n")

    def _send(self, conn: socket.socket, dl: _Deadline, req: dict[str, Any], step: int,
              rank: int) -> None:
        """Send a shard this node has (its own or a held copy), or say it is missing; the
        reply is MACed over the client's nonce."""
        cnonce = str(req["nonce"]).encode()[:64]
        found = self.find(step, rank)
        if found is None:
            reply = json.dumps({"missing": True}).encode()
            conn.sendall(reply + b"\n" + _mac(self.key, b"get", cnonce, reply) + b"\n")
            return
        dfd, name = found
        try:
            fd = open_shard(dfd, name)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size - 32)
            digest = f.read(32).hex()
            f.seek(0)
            reply = json.dumps({"size": size, "digest": digest}).encode()
            dl.end = time.monotonic() + deadline_for(size)
            dl.arm()
            conn.sendall(reply + b"\n" + _mac(self.key, b"get", cnonce, reply) + b"\n")
            self.stats.sent += _send_file(dl, f, size)


def _send_file(dl: _Deadline, f: Any, size: int) -> int:
    """The first `size` bytes of the open file `f` to the socket, by sendfile(2) where the
    system has it (from the page cache to the socket: no copy through this process's memory,
    which the spare's fetch of a large shard paid for twice), the deadline re-armed every
    4 MiB. Returns the bytes sent.

    Raises:
        TransferError: the file ended before `size` bytes (it shrank meanwhile).
        OSError: the socket failed or timed out.
    """
    sent = 0
    while sent < size:
        dl.arm()
        n = dl.sock.sendfile(f, sent, min(4 << 20, size - sent))
        if n <= 0:
            raise TransferError(f"the file ended after {sent} of {size} bytes")
        sent += n
    return sent


def _connect(addr: tuple[str, int], key: bytes, deadline_s: float,
             request: dict[str, Any]) -> tuple[socket.socket, _Deadline, _Reader]:
    try:
        sock = socket.create_connection(addr, timeout=min(IO_TIMEOUT_S, deadline_s))
    except OSError as exc:
        raise TransferError(f"cannot connect to {addr[0]}:{addr[1]}: "
                            f"{exc.strerror or exc}") from None
    dl = _Deadline(sock, deadline_s)
    r = _Reader(dl)
    try:
        hello = _readline(r)
        if not hello.startswith(HELLO):
            raise TransferError("not a bv shard server")
        nonce = hello[len(HELLO):]
        raw = json.dumps(request, sort_keys=True).encode()
        dl.arm()
        sock.sendall(raw + b"\n" + _mac(key, b"req", nonce, raw) + b"\n")
    except (OSError, TransferError) as exc:
        r.close()
        sock.close()
        raise TransferError(f"{addr[0]}:{addr[1]}: {exc}") from None
    return sock, dl, r


def send_shard(addr: tuple[str, int], key: bytes, dir_fd: int, name: str, step: int,
               rank: int) -> int:
    """Send a shard file to a partner's server; returns the bytes sent once it answered ok.

    Raises:
        TransferError: not sent, or the partner refused it (with its reason).
    """
    try:
        fd = open_shard(dir_fd, name)
    except ShardError as exc:
        raise TransferError(f"local shard: {exc.reason}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - 32)
        digest = f.read(32).hex()
        f.seek(0)
        sock, dl, r = _connect(addr, key, deadline_for(size),
                               {"op": "put", "step": step, "rank": rank, "size": size,
                                "digest": digest})
        try:
            _send_file(dl, f, size)
            answer = _readline(r)
        except OSError as exc:
            raise TransferError(f"{addr[0]}:{addr[1]}: {exc.strerror or exc}") from None
        finally:
            r.close()
            sock.close()
    if answer != b"ok":
        raise TransferError(f"partner refused: {answer.decode(errors='replace')[:200]}")
    return size


def _get(addr: tuple[str, int], key: bytes, step: int, rank: int, max_bytes: int,
         take: Callable[[Any, int, str], T]) -> T:
    """Ask a node's server for rank `rank`'s shard of `step`; `take(reader, size, digest)`
    reads the file that follows the MACed reply.

    Raises:
        TransferError: the server does not have it, refused, announced a size out of
            (0, `max_bytes`], or the connection failed.
        ShardError: what came is torn or corrupt (from `take`).
    """
    cnonce = secrets.token_hex(16)
    sock, dl, r = _connect(addr, key, BASE_DEADLINE_S,
                           {"op": "get", "step": step, "rank": rank, "nonce": cnonce})
    try:
        reply_raw = _readline(r)
        if reply_raw.startswith(b"err "):
            raise TransferError(reply_raw.decode(errors="replace")[:200])
        mac = _readline(r)
        if not hmac.compare_digest(mac, _mac(key, b"get", cnonce.encode(), reply_raw)):
            raise TransferError("bad MAC on the reply")
        reply = json.loads(reply_raw)
        if reply.get("missing"):
            raise TransferError("the node does not hold it")
        size = int(reply["size"])
        if not 0 < size <= max_bytes:
            raise TransferError(f"size {size} over {max_bytes}")
        dl.end = time.monotonic() + deadline_for(size)
        return take(r, size, str(reply["digest"]))
    except (OSError, ValueError, KeyError) as exc:
        raise TransferError(f"{addr[0]}:{addr[1]}: {exc}") from None
    finally:
        r.close()
        sock.close()


def fetch_shard(addr: tuple[str, int], key: bytes, step: int, rank: int, dst_dir_fd: int,
                name: str, max_bytes: int = MAX_SHARD_BYTES) -> ShardInfo:
    """Fetch rank `rank`'s shard of `step` (a file of at most `max_bytes`) from a node's
    server into `dst_dir_fd`/`name`, verified (its digest, and the one the server MACed)
    before it is renamed into place.

    Raises:
        TransferError: the server does not have it, refused, or the connection failed.
        ShardError: what came is torn or corrupt.
    """
    return _get(addr, key, step, rank, max_bytes,
                lambda r, size, digest: copy_stream(r, size, dst_dir_fd, name,
                                                    expect={"step": step, "rank": rank},
                                                    digest=digest))


def fetch_payload(addr: tuple[str, int], key: bytes, step: int, rank: int,
                  max_bytes: int = MAX_SHARD_BYTES,
                  expect: dict[str, Any] | None = None) -> tuple[ShardInfo, memoryview]:
    """Fetch rank `rank`'s shard of `step` (a file of at most `max_bytes`: the buffer is
    allocated before a byte arrives) from a node's server into memory, verified (its
    digest, and the one the server MACed): a resume loads it at once, and keeps a node-local
    copy of it afterwards, off its critical path. `expect`: header fields the shard must have
    besides its step and rank (its checkpoint's name), checked before its payload is read.

    Raises:
        TransferError: the server does not have it, refused, or the connection failed.
        ShardError: what came is torn or corrupt.
    """
    return _get(addr, key, step, rank, max_bytes,
                lambda r, size, digest: read_stream(
                    r, size, expect={"step": step, "rank": rank, **(expect or {})},
                    digest=digest))
