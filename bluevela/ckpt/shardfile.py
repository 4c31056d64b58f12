"""One rank's shard of one checkpoint step, as one self-verifying file (stdlib and util.fs).

Layout (all integers big-endian)::

    b"BVCKPT01"                 magic, 8 bytes
    u32 header length           at most MAX_HEADER
    header                      JSON: job, name, step, rank, world, payload (bytes), node
    payload                     exactly header["payload"] bytes
    b"BVCKEND1" + sha256        40 bytes: SHA-256 over everything before it

A file is written whole under a temporary name (O_EXCL|O_NOFOLLOW), fsynced, renamed into
place and its directory fsynced, so a reader sees either nothing or the whole file; what a
crash, a full disk or a bad disk can still leave (a short file, a flipped byte, a foreign file)
fails `verify` with a reason in words and is never loaded. The digest is computed while the
bytes are written and checked again by every reader: the partner's receiver before it renames
the copy into place, the drain before it copies a file to shared storage, a resume before it
hands the state back.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from bluevela.util.fs import atomic_fill_at, write_all

MAGIC = b"BVCKPT01"
END = b"BVCKEND1"
MAX_HEADER = 64 << 10
TRAILER = len(END) + 32
_CHUNK = 4 << 20
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class ShardError(Exception):
    """A shard that must not be loaded: torn, corrupt, foreign or unreadable (`reason`);
    `field` and `found`: the header field that is not what the reader expected, and its value."""

    def __init__(self, reason: str, field: str | None = None, found: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.field = field
        self.found = found


@dataclass(frozen=True)
class ShardInfo:
    """What a verified shard says about itself."""

    header: dict[str, Any]
    size: int  # the whole file, bytes
    digest: str  # sha256 hex of the file before its trailer

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def rank(self) -> int:
        return int(self.header["rank"])


def encode_header(header: dict[str, Any]) -> bytes:
    """The magic word and the length-prefixed header, as they start the file."""
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER:
        raise ValueError(f"shard header of {len(body)} bytes over {MAX_HEADER}")
    return MAGIC + struct.pack(">I", len(body)) + body


def file_size(header: dict[str, Any]) -> int:
    return len(encode_header(header)) + int(header["payload"]) + TRAILER


class _Hashing:
    """Writes to a fd and hashes what it wrote."""

    def __init__(self, fd: int, hashing: bool = True) -> None:
        self.fd = fd
        self.sha = hashlib.sha256()
        self.hashing = hashing
        self.count = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.hashing:
            self.sha.update(view)
        write_all(self.fd, view)
        self.count += len(view)


def write_shard(dir_fd: int, name: str, header: dict[str, Any],
                chunks: Iterable[bytes | bytearray | memoryview],
                digest_of: Callable[[], bytes] | None = None) -> ShardInfo:
    """Write one shard atomically under `dir_fd`/`name`.

    Args:
        dir_fd: the directory (opened without following a link: `util.fs.open_dir`).
        name: the file name (no separator).
        header: what the file says about itself; `payload` must be the chunks' total length.
        chunks: the payload, in order.
        digest_of: the file's digest once the chunks are consumed, when the caller computed
            it already (a verified copy: not hashed twice).

    Raises:
        OSError: any I/O failure (ENOSPC included): the temporary file is removed and `name`
            left as it was.
        ValueError: the chunks' length is not the header's `payload`.
    """
    def fill(fd: int) -> tuple[int, bytes]:
        out = _Hashing(fd, hashing=digest_of is None)
        out.write(encode_header(header))
        start = out.count
        for chunk in chunks:
            out.write(chunk)
        if out.count - start != int(header["payload"]):
            raise ValueError(f"payload of {out.count - start} bytes, header says "
                             f"{header['payload']}")
        digest = out.sha.digest() if digest_of is None else digest_of()
        write_all(fd, END + digest)
        return out.count + TRAILER, digest

    size, digest = atomic_fill_at(dir_fd, name, fill, 0o600)
    return ShardInfo(header, size, digest.hex())


def open_shard(dir_fd: int, name: str) -> int:
    """Open a shard for reading: a regular file, never through a symlink.

    Raises:
        ShardError: missing, a link, not a regular file, unreadable.
    """
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ShardError("missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ShardError("a symlink, not followed") from None
        raise ShardError(f"unreadable: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ShardError("not a regular file")
    return fd


def read_header(f: IO[bytes], size: int) -> tuple[dict[str, Any], bytes]:
    """The header of a shard file of `size` bytes open at its start, checked for shape.

    Returns the header and its raw bytes (magic and length included: they are hashed).

    Raises:
        ShardError: a short file, a foreign one, or a header that does not parse.
    """
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4:
        raise ShardError(f"torn: {size} bytes, shorter than a header")
    if head[:len(MAGIC)] != MAGIC:
        raise ShardError("not a bv shard (bad magic)")
    (hlen,) = struct.unpack(">I", head[len(MAGIC):])
    if hlen > MAX_HEADER:
        raise ShardError(f"header length {hlen} over {MAX_HEADER}")
    body = f.read(hlen)
    if len(body) < hlen:
        raise ShardError(f"torn: {size} bytes, shorter than its header")
    try:
        header = json.loads(body)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        for key in ("step", "rank", "payload"):
            if not isinstance(header.get(key), int) or header[key] < 0:
                raise ValueError(f"no valid {key}")
    except ValueError as exc:
        raise ShardError(f"corrupt header: {exc}") from None
    expected = len(head) + hlen + header["payload"] + TRAILER
    if size != expected:
        kind = "torn" if size < expected else "corrupt"
        raise ShardError(f"{kind}: {size} bytes, its header says {expected}")
    return header, head + body


def _check_expect(header: dict[str, Any], expect: dict[str, Any] | None) -> None:
    for key, value in (expect or {}).items():
        if header.get(key) != value:
            raise ShardError(f"{key} {header.get(key)!r} where {value!r} was expected",
                             key, header.get(key))


def _stream_header(f: IO[bytes], size: int,
                   expect: dict[str, Any] | None) -> tuple[dict[str, Any], hashlib._Hash]:
    """The header of a shard that arrives as a stream, checked (shape, `expect`, canonical
    form: a copy is written back from the parsed header), and the digest started over it."""
    header, raw = read_header(f, size)
    _check_expect(header, expect)
    if raw != encode_header(header):
        raise ShardError("corrupt header: not in its canonical form")
    return header, hashlib.sha256(raw)


def _check_trailer(f: IO[bytes], sha: hashlib._Hash, digest: str | None) -> None:
    """The end marker and digest that follow a streamed payload hashed into `sha`, and, with
    `digest`, that it is the file the sender vouched for."""
    trailer = _read_exact(f, TRAILER)
    if trailer != END + sha.digest():
        raise ShardError("corrupt: checksum mismatch")
    if digest is not None and sha.hexdigest() != digest:
        raise ShardError("not the file the sender vouched for (digest differs)")


def read_verified(fd: int, *, into: bool = True,
                  expect: dict[str, Any] | None = None) -> tuple[ShardInfo, bytearray | None]:
    """Read a whole shard from an open fd, check its shape and digest.

    Args:
        fd: an open shard (`open_shard`); not closed here.
        into: keep the payload (one buffer of its size) and return it; else only verify.
        expect: header fields that must match (step, rank, job, name): a file of another step
            or rank under this name is refused.

    Raises:
        ShardError: torn, corrupt, foreign, or not what `expect` says.
    """
    size = os.fstat(fd).st_size
    f = os.fdopen(os.dup(fd), "rb", buffering=0)
    try:
        header, raw = read_header(f, size)
        _check_expect(header, expect)
        sha = hashlib.sha256(raw)
        n = header["payload"]
        payload = bytearray(n) if into else None
        view = memoryview(payload) if payload is not None else None
        scratch = None if into else bytearray(min(_CHUNK, max(n, 1)))
        done = 0
        while done < n:
            want = min(_CHUNK, n - done)
            target = view[done:done + want] if view is not None else memoryview(scratch)[:want]  # type: ignore[arg-type]
            got = f.readinto(target)
            if not got:
                raise ShardError(f"torn: payload ends after {done} of {n} bytes")
            sha.update(target[:got])
            done += got
        trailer = f.read(TRAILER)
        if len(trailer) != TRAILER or trailer[:len(END)] != END:
            raise ShardError("torn: no end marker")
        if trailer[len(END):] != sha.digest():
            raise ShardError("corrupt: checksum mismatch")
        return ShardInfo(header, size, sha.hexdigest()), payload
    except OSError as exc:
        raise ShardError(f"unreadable: {exc.strerror or exc}") from None
    finally:
        f.close()


def verify_at(dir_fd: int, name: str, expect: dict[str, Any] | None = None) -> ShardInfo:
    """Verify a shard file without keeping its payload."""
    fd = open_shard(dir_fd, name)
    try:
        return read_verified(fd, into=False, expect=expect)[0]
    finally:
        os.close(fd)


def load_at(dir_fd: int, name: str,
            expect: dict[str, Any] | None = None) -> tuple[ShardInfo, bytearray]:
    """Read and verify a shard; its payload in one buffer."""
    fd = open_shard(dir_fd, name)
    try:
        info, payload = read_verified(fd, into=True, expect=expect)
    finally:
        os.close(fd)
    assert payload is not None
    return info, payload


def copy_verified(src_fd: int, dst_dir_fd: int, name: str,
                  expect: dict[str, Any] | None = None) -> ShardInfo:
    """Copy an open shard to `dst_dir_fd`/`name` atomically, verifying the source's digest on
    the way: a corrupt source is never copied (the half-written temporary is removed).

    Raises:
        ShardError: the source is torn or corrupt.
        OSError: the destination cannot be written.
    """
    size = os.fstat(src_fd).st_size
    with os.fdopen(os.dup(src_fd), "rb", buffering=0) as f:
        return copy_stream(f, size, dst_dir_fd, name, expect)


def copy_stream(f: IO[bytes], size: int, dst_dir_fd: int, name: str,
                expect: dict[str, Any] | None = None, digest: str | None = None) -> ShardInfo:
    """Write the shard file of `size` bytes that `f` reads out (a file, a socket) to
    `dst_dir_fd`/`name` atomically, verifying its shape and digest on the way; nothing is
    renamed into place unless the whole file verified.

    Raises:
        ShardError: what `f` gave is torn, corrupt, not what `expect` says, or its digest is
            not `digest` (the one the sender vouched for).
        OSError: the destination cannot be written, or `f` fails.
    """
    header, sha = _stream_header(f, size, expect)
    n = header["payload"]

    def chunks() -> Iterable[bytes]:
        left = n
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ShardError(f"torn: payload ends after {n - left} of {n} bytes")
            sha.update(chunk)
            left -= len(chunk)
            yield chunk
        _check_trailer(f, sha, digest)

    return write_shard(dst_dir_fd, name, header, chunks(), digest_of=sha.digest)


def _read_exact(f: IO[bytes], n: int) -> bytes:
    parts = []
    while n:
        chunk = f.read(n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def read_stream(f: Any, size: int, expect: dict[str, Any] | None = None,
                digest: str | None = None) -> tuple[ShardInfo, bytearray]:
    """Read a shard file of `size` bytes from a stream (a socket) into memory, verified: its
    shape, its digest (hashed once, as it arrives) and, with `digest`, that it is the file the
    sender vouched for. The payload in one buffer of its size (`f` needs `readinto`).

    Raises:
        ShardError: torn, corrupt, or not what `expect`/`digest` say.
        OSError: `f` fails.
    """
    header, sha = _stream_header(f, size, expect)
    n = header["payload"]
    payload = bytearray(n)
    view = memoryview(payload)
    done = 0
    while done < n:
        got = f.readinto(view[done:min(n, done + _CHUNK)])
        if not got:
            raise ShardError(f"torn: payload ends after {done} of {n} bytes")
        sha.update(view[done:done + got])
        done += got
    _check_trailer(f, sha, digest)
    return ShardInfo(header, size, sha.hexdigest()), payload
