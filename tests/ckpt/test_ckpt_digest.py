"""The shard file's tree digest (bluevela/ckpt/digest.py) and the two formats it reads: format 2
(the tree, written) and format 1 (one SHA-256, written before the tree: a file recorded by
that code, tests/data/ckpt/shard-format1.bvckpt, still verifies, loads and is copied as it was).
No torch."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from bluevela.ckpt import digest as dg
from bluevela.ckpt.shardfile import (
    END,
    MAGIC,
    MAGIC_V1,
    TRAILER,
    ShardError,
    copy_stream,
    encode_header,
    load_at,
    read_stream,
    verify_at,
    write_shard,
)
from tests.conftest import DATA

LEAF = dg.LEAF
FORMAT1 = DATA / "ckpt" / "shard-format1.bvckpt"
# What the recording (the code before the tree, e55e803) wrote: 70,001 bytes (i*131+7) % 251.
FORMAT1_PAYLOAD = bytes((i * 131 + 7) % 251 for i in range(70001))
FORMAT1_DIGEST = "8fa6f44c4b1237b61fce1b70bf68d1a50bd98806126f76a142c41114792cdddf"


def _payload(n: int) -> bytes:
    return (hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1))[:n]


def _root_by_hand(head: bytes, payload: bytes | bytearray) -> bytes:
    """The tree as digest.py's docstring writes it, one leaf after another."""
    leaves = [hashlib.sha256(payload[i:i + LEAF]).digest() for i in range(0, len(payload), LEAF)]
    return hashlib.sha256(b"BVTREE01" + struct.pack(">Q", LEAF) + hashlib.sha256(head).digest()
                          + b"".join(leaves)).digest()


@pytest.mark.parametrize("n", [0, 1, LEAF - 1, LEAF, LEAF + 1, 3 * LEAF + 12345])
@pytest.mark.parametrize("chunk", [1 << 20, LEAF, 5 * LEAF, 3000001])
def test_tree_hash_is_the_tree_whatever_the_chunks(n: int, chunk: int) -> None:
    head, payload = b"BVCKPT02head", _payload(n)
    h = dg.TreeHash(head)
    for i in range(0, n, chunk):
        h.update(payload[i:i + chunk])
    assert h.digest() == _root_by_hand(head, payload)
    assert h.digest() == h.digest()  # final
    with pytest.raises(ValueError):
        h.update(b"x")


def test_tree_is_not_a_plain_sha256_and_names_every_leaf() -> None:
    head, payload = b"h", _payload(2 * LEAF)
    root = _root_by_hand(head, payload)
    assert root != hashlib.sha256(head + payload).digest()
    # a byte flipped in either leaf, or in the head, changes the root
    for at in (0, LEAF - 1, LEAF, 2 * LEAF - 1):
        bad = bytearray(payload)
        bad[at] ^= 1
        assert _root_by_hand(head, bad) != root
    assert _root_by_hand(b"H", payload) != root
    # one byte more (a new, short last leaf) changes it too
    assert _root_by_hand(head, payload + b"\0") != root


def test_hash_threads_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BV_CKPT_HASH_THREADS", "3")
    assert dg.hash_threads() == 3
    for bad in ("0", "-2", "many", ""):
        monkeypatch.setenv("BV_CKPT_HASH_THREADS", bad)
        assert 1 <= dg.hash_threads() <= 4


def test_the_hash_runs_beside_the_caller_and_holds_a_bounded_number_of_leaves() -> None:
    """Leaves are hashed on the pool's threads, not the caller's; at most 2 x threads wait."""
    _, threads = dg._executor()
    seen: set[str] = set()
    real = dg._sha

    def spy(data: bytes) -> bytes:
        seen.add(threading.current_thread().name)
        return real(data)

    # the workers look _sha up per leaf
    dg._sha = spy
    try:
        h = dg.TreeHash(b"h")
        most = 0
        for _ in range(6 * threads):
            h.update(bytes(LEAF))
            most = max(most, len(h._pending))
        h.digest()
    finally:
        dg._sha = real
    assert seen and all(name.startswith("bv-ckpt-hash") for name in seen - {"MainThread"})
    assert most <= 2 * threads


def _fd(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


@pytest.mark.parametrize("n", [0, 70001, 2 * LEAF + 3])
def test_a_written_shard_is_format_2_and_its_trailer_is_the_tree(tmp_path: Path, n: int) -> None:
    payload = _payload(n)
    header = {"step": 3, "rank": 0, "payload": n, "name": "t"}
    d = _fd(tmp_path)
    info = write_shard(d, "s", header, [payload[:1000], payload[1000:]])
    raw = (tmp_path / "s").read_bytes()
    head = encode_header(header)
    assert raw.startswith(MAGIC) and info.magic == MAGIC
    assert raw[-TRAILER:] == END + _root_by_hand(head, payload)
    assert info.digest == _root_by_hand(head, payload).hex()
    got, back = load_at(d, "s", {"step": 3})
    assert back == payload and got.digest == info.digest and got.magic == MAGIC
    assert verify_at(d, "s").digest == info.digest
    # one flipped payload byte (in the last leaf) is named and never loaded
    if n:
        bad = bytearray(raw)
        bad[len(head) + n - 1] ^= 0x40
        (tmp_path / "s").write_bytes(bad)
        with pytest.raises(ShardError, match="checksum mismatch"):
            load_at(d, "s")
        with pytest.raises(ShardError, match="checksum mismatch"):
            verify_at(d, "s")


def test_a_format_1_shard_still_verifies_loads_and_is_copied_as_format_1(tmp_path: Path) -> None:
    shutil.copy(FORMAT1, tmp_path / "s")
    d = _fd(tmp_path)
    info, payload = load_at(d, "s", {"step": 12, "rank": 1})
    assert payload == FORMAT1_PAYLOAD and info.digest == FORMAT1_DIGEST
    assert info.magic == MAGIC_V1 and verify_at(d, "s").digest == FORMAT1_DIGEST
    raw = FORMAT1.read_bytes()
    # the partner's receipt and the fetch keep it format 1, its digest the sender's
    out = tmp_path / "copy"
    out.mkdir()
    got = copy_stream(io.BytesIO(raw), len(raw), _fd(out), "s", digest=FORMAT1_DIGEST)
    assert (out / "s").read_bytes() == raw and got.magic == MAGIC_V1
    fetched, body = read_stream(io.BytesIO(raw), len(raw), digest=FORMAT1_DIGEST)
    assert body == FORMAT1_PAYLOAD and fetched.magic == MAGIC_V1
    # a node-local copy of a fetched format-1 shard (the store's _keep_fetched) stays format 1
    write_shard(d, "kept", fetched.header, [body], digest_of=lambda: bytes.fromhex(FORMAT1_DIGEST),
                magic=fetched.magic)
    assert (tmp_path / "kept").read_bytes() == raw
    # and a flipped byte in it is still found by format 1's own check
    bad = bytearray(raw)
    bad[5000] ^= 1
    (tmp_path / "s").write_bytes(bad)
    with pytest.raises(ShardError, match="checksum mismatch"):
        load_at(d, "s")


def test_a_format_2_trailer_on_a_format_1_magic_is_refused(tmp_path: Path) -> None:
    """The magic decides how the file is checked: a format-2 file relabelled format 1 (or the
    other way) fails its checksum, never loads."""
    payload = _payload(5000)
    header = {"step": 1, "rank": 0, "payload": len(payload)}
    d = _fd(tmp_path)
    write_shard(d, "s", header, [payload])
    raw = bytearray((tmp_path / "s").read_bytes())
    raw[:8] = MAGIC_V1
    (tmp_path / "s").write_bytes(raw)
    with pytest.raises(ShardError, match="checksum mismatch"):
        load_at(d, "s")


def test_a_shard_written_at_interpreter_exit_and_in_a_forked_child(tmp_path: Path) -> None:
    """The last save of a job can be written from an atexit handler (a framework's end of
    training, the store's finalize) and from a rank forked by the warm start: the hash pool
    takes work in both (concurrent.futures' executor refuses it once the interpreter exits)."""
    import subprocess
    import sys

    code = f"""
import atexit, os
from bluevela.ckpt.shardfile import write_shard
from bluevela.ckpt import digest
payload = bytes(3 * digest.LEAF + 5)
d = os.open({str(tmp_path)!r}, os.O_RDONLY)
digest.TreeHash(b"warm").update(payload)  # the parent's pool exists before the fork
pid = os.fork()
if pid == 0:
    write_shard(d, "child", {{"step": 1, "rank": 1, "payload": len(payload)}}, [payload])
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
atexit.register(lambda: write_shard(d, "atexit", {{"step": 1, "rank": 0,
                                                    "payload": len(payload)}}, [payload]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    d = _fd(tmp_path)
    for name in ("child", "atexit"):
        info, body = load_at(d, name)
        assert len(body) == 3 * LEAF + 5 and info.magic == MAGIC


def test_a_payload_is_read_into_populated_anonymous_memory(tmp_path: Path) -> None:
    """load_at and read_stream read into `payload_buffer`: mapped anonymous memory, writable
    (torch views it without a copy), exactly the payload's size; an empty payload has an
    empty buffer."""
    import mmap

    from bluevela.ckpt.shardfile import payload_buffer

    buf = payload_buffer(3 * LEAF + 1)
    assert len(buf) == 3 * LEAF + 1 and not buf.readonly
    assert isinstance(buf.obj, mmap.mmap) == hasattr(mmap, "MAP_POPULATE")
    buf[-1] = 7
    assert buf[-1] == 7 and len(payload_buffer(0)) == 0
    d = _fd(tmp_path)
    payload = _payload(LEAF + 9)
    write_shard(d, "s", {"step": 1, "rank": 0, "payload": len(payload)}, [payload])
    _, got = load_at(d, "s")
    assert got == payload and not got.readonly


def test_a_leaf_across_the_callers_chunks_is_hashed_from_them_not_copied() -> None:
    """Chunks not aligned to the leaves (a save's pieces, a socket's reads): every leaf is
    hashed from views of the caller's buffers (a copy of each straddling leaf, as before,
    held up to 2 x threads x 4 MiB more: the staging figure grew from 1.04x to 1.17x the
    state), and the digest is the by-hand tree's."""
    got: list[Any] = []
    real = dg._sha

    def spy(data: Any) -> bytes:
        got.append(data)
        return real(data)

    chunks = [bytes([i]) * n for i, n in enumerate((LEAF - 3, 5, LEAF + 7, 2 * LEAF, 11))]
    dg._sha = spy
    try:
        h = dg.TreeHash(b"head")
        for c in chunks:
            h.update(c)
        digest = h.digest()
    finally:
        dg._sha = real
    leaves = [d for d in got if not isinstance(d, bytes | bytearray)]
    assert len(leaves) == len(got) - 1  # all but the head (hashed in the caller)
    for d in leaves:
        parts = d if isinstance(d, list) else [d]
        assert all(isinstance(p, memoryview) and any(p.obj is c for c in chunks) for p in parts)
    assert any(isinstance(d, list) for d in leaves)  # a leaf spanning two chunks
    assert digest == _root_by_hand(b"head", b"".join(chunks))
