"""The checkpoint store (bluevela/ckpt, docs/checkpoints.md) with real files: ranks are threads
of this process (tests/ckpt_helpers.py), each "node" a node-local directory of its own, the
partner copies sent over real loopback TCP, shared storage a directory.

The planted faults: a torn local file, a flipped byte in the partner's copy, a missing shared
copy, a node lost with its disk (the spare fetches the lost rank's shard from the partner and
reads nothing of shared storage), the partner lost together with the node, a full node-local
disk (a 64 KiB tmpfs) and a budget. Each resume loads no torn or corrupt copy, names every
skip, and takes the newest step complete somewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from bluevela.ckpt import layout
from bluevela.ckpt.partner import TransferError, choose_partners, fetch_shard, send_shard
from bluevela.ckpt.plan import NodeInv, candidates, needs_shared, places
from bluevela.ckpt.shardfile import ShardError, load_at, verify_at, write_shard
from bluevela.ckpt.stage import Stager, decode
from tests.ckpt_helpers import KEY, make_store, run_ranks

torch = pytest.importorskip("torch")


def _state(rank: int, step: int, n: int = 4096) -> dict[str, Any]:
    return {"model": {"w": torch.full((n,), float(rank * 1000 + step)),
                      "b": torch.arange(8, dtype=torch.int64) + step},
            "optim": {"state": {0: {"m": torch.ones(3, 3, dtype=torch.bfloat16) * step}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "step": step, "rng": b"\x00\x01" * 8, "nan": float("nan"), "t": (1, "a")}


def _check(state: dict[str, Any], rank: int, step: int) -> None:
    assert state["step"] == step
    assert state["model"]["w"][0].item() == rank * 1000 + step
    assert torch.equal(state["model"]["b"], torch.arange(8, dtype=torch.int64) + step)
    assert state["optim"]["state"][0]["m"].dtype == torch.bfloat16
    assert state["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert state["rng"] == b"\x00\x01" * 8 and state["t"] == (1, "a")
    assert state["nan"] != state["nan"]


def _shard(tmp: Path, node: str, kind: str, step: int, rank: int) -> Path:
    return (tmp / "local" / node / f"bv-{os.getuid()}" / "job-77" / "t" / kind
            / layout.step_dir(step) / layout.shard_name(rank))


def _save_steps(tmp: Path, world: int, steps: list[int], **kw: Any) -> list[Any]:
    def body(rank: int, coll: Any) -> Any:
        s = make_store(tmp, rank, coll, **kw)
        for step in steps:
            s.save(step, _state(rank, step))
        done = s.finalize()
        return done, dict(s.status)

    return run_ranks(world, body)


def _resume(tmp: Path, world: int, nodes: dict[int, str] | None = None,
            load: dict[str, Any] | None = None, **kw: Any) -> list[Any]:
    """Every rank's `load_latest(**load)`; `kw` for the stores."""
    def body(rank: int, coll: Any) -> Any:
        node = (nodes or {}).get(rank)
        s = make_store(tmp, rank, coll, node=node, **kw)
        try:
            return s.load_latest(**(load or {}))
        finally:
            s.close()

    return run_ranks(world, body)


def test_save_is_complete_in_local_and_partner_then_drained_at_the_end(tmp_path: Path) -> None:
    results = _save_steps(tmp_path, 2, [1, 2, 3])
    done, status = results[0]
    # Every step is complete on the node and on the partner; only the newest was drained.
    assert done == {1: ["local", "partner"], 2: ["local", "partner"],
                    3: ["local", "partner", "shared"]}
    assert status[3]["partner"] == "ok (n2)"
    # keep=2: step 1 pruned from the node-local tier (own and held copies).
    assert not _shard(tmp_path, "n1", "own", 1, 0).exists()
    assert not _shard(tmp_path, "n2", "held", 1, 0).exists()
    assert _shard(tmp_path, "n2", "held", 3, 0).is_file()
    assert (tmp_path / "shared" / "t" / layout.step_dir(3) / "manifest.json").is_file()
    restored = _resume(tmp_path, 2)
    for rank, r in enumerate(restored):
        assert r.step == 3 and r.source == "local (own copy on this node)"
        _check(r.state, rank, 3)
    assert restored[0].summary.endswith("nothing skipped")


def test_torn_local_file_is_skipped_for_the_partners_copy(tmp_path: Path) -> None:
    _save_steps(tmp_path, 2, [1, 2])
    torn = _shard(tmp_path, "n1", "own", 2, 0)
    with open(torn, "r+b") as f:
        f.truncate(torn.stat().st_size // 2)
    restored = _resume(tmp_path, 2)
    assert restored[0].step == 2
    assert restored[0].source == "partner (held copy on n2)"
    _check(restored[0].state, 0, 2)
    assert "rank 0 step 2 local (own copy on this node): torn" in restored[1].summary


def test_a_shard_of_another_world_size_is_skipped_on_its_header(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Refused before its payload is read: a flipped payload byte is never seen (the old code
    # read the whole shard, and said "checksum mismatch" here).
    _save_steps(tmp_path, 2, [1, 2])
    own = _shard(tmp_path, "n1", "own", 2, 0)
    data = bytearray(own.read_bytes())
    data[-41] ^= 1  # the payload's last byte, before the 40-byte trailer
    own.write_bytes(data)
    assert _resume(tmp_path, 1) == [None]
    out = capsys.readouterr().out
    for where in ("local (own copy on this node)", "shared"):
        assert (f"rank 0 step 2 {where}: saved by 2 ranks, now 1 (resharding: DCP's "
                "StoreReader)") in out, out
    assert "checksum" not in out


def test_flipped_byte_in_partner_copy_and_torn_local_falls_back_to_shared(
        tmp_path: Path) -> None:
    _save_steps(tmp_path, 2, [1, 2])  # step 2 drained at the end
    torn = _shard(tmp_path, "n2", "own", 2, 1)
    torn.write_bytes(torn.read_bytes()[:100])
    copy = _shard(tmp_path, "n1", "held", 2, 1)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    restored = _resume(tmp_path, 2)
    assert restored[1].step == 2 and restored[1].source == "shared"
    _check(restored[1].state, 1, 2)
    summary = restored[0].summary
    assert "rank 1 step 2 local (own copy on this node): torn" in summary
    assert "rank 1 step 2 partner (held copy on n1): corrupt: checksum mismatch" in summary
    assert summary.count("checksum mismatch") == 1 and summary.count("torn") == 1, summary


def test_missing_shared_copy_means_an_older_step(tmp_path: Path) -> None:
    _save_steps(tmp_path, 2, [1, 2], drain_every=1)
    # Rank 1's every copy of step 2 is gone or bad: its node file and the partner copy torn,
    # its shared copy removed. Step 1 is complete in shared storage.
    for p in (_shard(tmp_path, "n2", "own", 2, 1), _shard(tmp_path, "n1", "held", 2, 1)):
        p.write_bytes(b"BVCKPT01")
    (tmp_path / "shared" / "t" / layout.step_dir(2) / layout.shard_name(1)).unlink()
    restored = _resume(tmp_path, 2)
    assert [r.step for r in restored] == [1, 1]
    for rank, r in enumerate(restored):
        _check(r.state, rank, 1)
    assert "rank 1 step 2" in restored[0].summary and "torn" in restored[0].summary


def test_spare_fetches_the_lost_nodes_shard_from_its_partner_no_shared_read(
        tmp_path: Path) -> None:
    _save_steps(tmp_path, 2, [1, 2], shared_dir=None)
    shutil.rmtree(tmp_path / "local" / "n2")  # the node is lost with its disk
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0)  # any read of shared storage would fail (and be named as a skip)
    try:
        restored = _resume(tmp_path, 2, nodes={1: "n3"})  # the spare takes rank 1
    finally:
        os.chmod(shared, 0o755)
    assert [r.step for r in restored] == [2, 2]
    assert restored[1].source == "partner (held copy on n1)"
    _check(restored[1].state, 1, 2)
    assert restored[0].summary.endswith("nothing skipped")
    assert list(shared.iterdir()) == []
    # The fetched copy is now the spare's own node-local file.
    assert verify_at(os.open(_shard(tmp_path, "n3", "own", 2, 1).parent, os.O_RDONLY),
                     layout.shard_name(1)).step == 2


def _resume_any(tmp: Path, world: int, nodes: dict[int, str]) -> list[Any]:
    return _resume(tmp, world, nodes, load={"any_world": True})


def test_a_grown_or_shrunk_job_takes_every_saved_shard_from_node_local_copies(
        tmp_path: Path) -> None:
    """A resharding resume (DCP's StoreReader): saved by 2 ranks, resumed by 3 (a grow, node
    n2 lost with its disk); saved by 3, resumed by 2 (a shrink, n3 lost). Every saved shard
    verified once, each from its fastest place; nothing read from shared storage (made
    unreadable)."""
    grow, shrink = tmp_path / "grow", tmp_path / "shrink"
    _save_steps(grow, 2, [1, 2], shared_dir=None)
    _save_steps(shrink, 3, [1, 2], shared_dir=None)
    shutil.rmtree(grow / "local" / "n2")
    shutil.rmtree(shrink / "local" / "n3")  # its copies were on n1 (ring, half away)
    for d in (grow, shrink):
        (d / "shared").mkdir()
        os.chmod(d / "shared", 0)
    try:
        grown = _resume_any(grow, 3, {0: "n1", 1: "n3", 2: "n4"})
        shrunk = _resume_any(shrink, 2, {0: "n2", 1: "n1"})
    finally:
        for d in (grow, shrink):
            os.chmod(d / "shared", 0o755)
    assert [r.step for r in grown] == [2, 2, 2] and [r.world for r in grown] == [2, 2, 2]
    assert sorted(grown[0].state) == [0] and sorted(grown[1].state) == [1]
    assert grown[2].state == {}  # no saved shard of its own: DCP reads what it needs
    _check(grown[0].state[0], 0, 2)
    _check(grown[1].state[1], 1, 2)
    assert grown[1].source == "partner (held copy on n1)"
    assert grown[0].summary.startswith("bv ckpt: resumed step 2 (saved by 2 ranks, now 3) in ")
    assert grown[0].summary.endswith("from local (own copy on this node) x1, "
                                     "partner (held copy on n1) x1; nothing skipped")
    assert [r.step for r in shrunk] == [2, 2] and [r.world for r in shrunk] == [3, 3]
    assert sorted(shrunk[0].state) == [0, 2] and sorted(shrunk[1].state) == [1]
    for r in (0, 2):
        _check(shrunk[0].state[r], r, 2)
    _check(shrunk[1].state[1], 1, 2)
    assert shrunk[0].source == "local (held copy on this node); partner (held copy on n1)"
    assert shrunk[1].source == "partner (own copy on n2)"
    assert "(saved by 3 ranks, now 2)" in shrunk[0].summary
    assert [list((d / "shared").iterdir()) for d in (grow, shrink)] == [[], []]
    # A replicated state (DDP) in any world size: every rank reads saved rank 0's shard.
    for r in _resume(grow, 3, {0: "n1", 1: "n3", 2: "n4"}, load={"source_rank": 0}):
        assert r.step == 2
        _check(r.state, 0, 2)


def test_a_resharding_resume_skips_a_step_missing_a_saved_shard(tmp_path: Path) -> None:
    """Step 2's rank 1 shard is bad everywhere (its node's file and the partner copy torn, not
    drained): the job of another size resumes step 1 and names both skips; a step whose
    highest rank is gone everywhere (a shard's header says 2 ranks, 1 is seen) is skipped
    on that header."""
    _save_steps(tmp_path, 2, [1, 2, 3], shared_dir=None, keep=3)
    for p in (_shard(tmp_path, "n2", "own", 3, 1), _shard(tmp_path, "n1", "held", 3, 1)):
        p.unlink()  # step 3: rank 1 gone everywhere; rank 0 says it was saved by 2
    for p in (_shard(tmp_path, "n2", "own", 2, 1), _shard(tmp_path, "n1", "held", 2, 1)):
        p.write_bytes(p.read_bytes()[:-5])
    got = _resume_any(tmp_path, 3, {0: "n1", 1: "n2", 2: "n3"})
    assert [r.step for r in got] == [1, 1, 1]
    _check(got[1].state[1], 1, 1)
    summary = got[0].summary
    assert "rank 0 step 3 local (own copy on this node): saved by 2 ranks, 1 seen" in summary
    assert "rank 1 step 2 local (own copy on this node): torn" in summary
    assert "rank 1 step 2 partner (held copy on n1): " in summary
    # The same with a job of 1 (the size seen of step 3): still "seen", not "now 1".
    alone = _resume_any(tmp_path, 1, {0: "n1"})
    assert alone[0].step == 1
    assert ("rank 0 step 3 local (own copy on this node): saved by 2 ranks, 1 seen"
            in alone[0].summary), alone[0].summary


def test_partner_lost_with_the_node_resumes_from_shared(tmp_path: Path) -> None:
    # Three nodes: n1 -> n2 -> n3 -> n1 ... (ring, half away): n1's copies are on n2.
    _save_steps(tmp_path, 3, [1, 2, 3], drain_every=2)  # step 2 drained, 3 at the end
    partners = choose_partners(["n1", "n2", "n3"])
    lost = "n1"
    shutil.rmtree(tmp_path / "local" / lost)
    shutil.rmtree(tmp_path / "local" / partners[lost])
    # The end-of-job drain of step 3 is lost too (a node lost during the drain).
    (tmp_path / "shared" / "t" / layout.step_dir(3) / layout.shard_name(0)).unlink()
    restored = _resume(tmp_path, 3, nodes={0: "n4", 1: "n5"})
    assert [r.step for r in restored] == [2, 2, 2]
    assert restored[0].source == "shared"
    for rank, r in enumerate(restored):
        _check(r.state, rank, 2)


def test_full_node_local_disk_drains_that_step_from_memory(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    small = tmp_path / "local" / "n1"
    small.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                      check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        def body(rank: int, coll: Any) -> Any:
            s = make_store(tmp_path, rank, coll)
            s.save(1, _state(rank, 1, n=64 << 10))  # 256 KiB of floats: over the tmpfs
            out = s.complete()
            s.close()
            return out, dict(s.status[1])

        (done, status), (_, status1) = run_ranks(2, body)
        assert "No space left on device" in status["local"]
        assert status["partner"] == "not sent: no local shard"
        assert status["shared"] == "ok" and done[1] == []  # rank 1's step was not drained
        # rank 1's copy to the full node was refused, with the partner's reason.
        assert status1["partner"].startswith("failed (n1): partner refused"), status1
        restored = _resume(tmp_path, 2)
        assert restored[0].step == 1 and restored[0].source == "shared"
        assert restored[1].source == "local (own copy on this node)"
        _check(restored[0].state, 0, 1)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_budget_refuses_the_local_write_and_says_so(tmp_path: Path) -> None:
    def body(rank: int, coll: Any) -> Any:
        s = make_store(tmp_path, rank, coll, budget_bytes=10_000)
        s.save(1, _state(rank, 1))
        s.close()
        return dict(s.status[1])

    status = run_ranks(1, body)[0]
    assert status["local"].startswith("failed: shard of ") and "budget" in status["local"]
    assert status["shared"] == "ok"


def test_staging_reuses_one_copy_of_the_state() -> None:
    stager = Stager()
    state = {"w": torch.randn(1000), "v": [torch.zeros(10, dtype=torch.int32)]}
    first = stager.stage(state)
    ptrs = [t.data_ptr() for t in first.tensors]
    state["w"].add_(1)
    second = stager.stage(state)
    assert [t.data_ptr() for t in second.tensors] == ptrs
    assert stager.held_bytes == 1000 * 4 + 10 * 4
    # The staged copy is a copy: the loop may change its tensors after stage() returned.
    state["w"].zero_()
    payload = bytearray(b"".join(bytes(c) for c in second.chunks()))
    got, _ = decode(payload)
    assert got["w"].abs().sum().item() > 0
    # A tensor that left the state takes its buffer with it.
    stager.stage({"w": state["w"]})
    assert stager.held_bytes == 1000 * 4


def test_shard_file_faults_are_named(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        hdr = {"step": 5, "rank": 0, "payload": 10, "name": "t"}
        write_shard(fd, "a.bvck", hdr, [b"0123456789"])
        assert load_at(fd, "a.bvck")[1] == bytearray(b"0123456789")
        raw = (tmp_path / "a.bvck").read_bytes()
        cases = {"torn": raw[:-5], "corrupt: checksum mismatch":
                 raw.replace(b"0123456789", b"0123456788"), "not a bv shard": b"x" * 80}
        for why, data in cases.items():
            (tmp_path / "b.bvck").write_bytes(data)
            with pytest.raises(ShardError, match=why):
                verify_at(fd, "b.bvck")
        with pytest.raises(ShardError, match="step 5 where 6"):
            verify_at(fd, "a.bvck", expect={"step": 6})
        os.symlink(tmp_path / "a.bvck", tmp_path / "c.bvck")
        with pytest.raises(ShardError, match="symlink"):
            verify_at(fd, "c.bvck")
        # A failed write leaves nothing behind (no temporary, no target).
        with pytest.raises(ValueError):
            write_shard(fd, "d.bvck", hdr, [b"short"])
        assert sorted(os.listdir(fd)) == ["a.bvck", "b.bvck", "c.bvck"]
    finally:
        os.close(fd)


@contextmanager
def _receiving_server(tmp_path: Path, step: int) -> Iterator[tuple[Path, int, tuple[str, int]]]:
    """A shard server that takes puts into `tmp_path/held` and holds nothing to fetch, and a
    shard of `step` (rank 0, payload b"abcd") in `tmp_path` to send it: (held, the shard's
    directory fd, the server's address)."""
    from bluevela.ckpt.partner import ShardServer

    held = tmp_path / "held"
    held.mkdir()
    src = os.open(tmp_path, os.O_RDONLY)
    write_shard(src, "rank-00000.bvck", {"step": step, "rank": 0, "payload": 4}, [b"abcd"])
    server = ShardServer(KEY, lambda step: os.open(held, os.O_RDONLY),
                         lambda step, rank: None, lambda s, r, n: None, 1 << 20, "127.0.0.1")
    try:
        yield held, src, ("127.0.0.1", server.port)
    finally:
        server.close()
        os.close(src)


def test_transfer_with_a_wrong_key_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    with _receiving_server(tmp_path, 3) as (held, src, addr):
        with pytest.raises(TransferError, match="refused"):
            send_shard(addr, b"x" * 32, src, "rank-00000.bvck", 3, 0)
        assert list(held.iterdir()) == []
        # The step and rank in the request must be the file's own.
        with pytest.raises(TransferError, match="refused"):
            send_shard(addr, KEY, src, "rank-00000.bvck", 4, 0)
        assert send_shard(addr, KEY, src, "rank-00000.bvck", 3, 0) > 0
        assert [p.name for p in held.iterdir()] == ["rank-00000.bvck"]
        with pytest.raises(TransferError, match="does not hold it"):
            fetch_shard(addr, KEY, 3, 0, src, "x.bvck")


def test_a_fetch_refuses_a_size_over_its_bound_before_reading(tmp_path: Path) -> None:
    # The size in the server's (MACed) reply sizes the resume's buffer: it is bounded as a
    # put's is, and the file is not read.
    from bluevela.ckpt.partner import ShardServer, fetch_payload

    src = os.open(tmp_path, os.O_RDONLY)
    info = write_shard(src, "rank-00000.bvck", {"step": 3, "rank": 0, "payload": 4}, [b"abcd"])
    server = ShardServer(KEY, lambda step: os.open(tmp_path, os.O_RDONLY),
                         lambda step, rank: (os.open(tmp_path, os.O_RDONLY), "rank-00000.bvck"),
                         lambda s, r, n: None, 1 << 20, "127.0.0.1")
    addr = ("127.0.0.1", server.port)
    try:
        with pytest.raises(TransferError, match=f"size {info.size} over {info.size - 1}"):
            fetch_payload(addr, KEY, 3, 0, max_bytes=info.size - 1)
        with pytest.raises(TransferError, match="over"):
            fetch_shard(addr, KEY, 3, 0, src, "x.bvck", max_bytes=info.size - 1)
        assert sorted(os.listdir(src)) == ["rank-00000.bvck"]
        got, payload = fetch_payload(addr, KEY, 3, 0, max_bytes=info.size)
        assert got.digest == info.digest and payload == b"abcd"
        # Another checkpoint's shard of the same step and rank is refused on its header.
        with pytest.raises(ShardError, match="name None where 't' was expected"):
            fetch_payload(addr, KEY, 3, 0, expect={"name": "t"})
    finally:
        server.close()
        os.close(src)


def test_partners_sit_on_another_switch() -> None:
    nodes = [f"g{i}" for i in range(1, 9)]
    sw = {n: ("a" if i < 4 else "b") for i, n in enumerate(nodes)}
    got = choose_partners(nodes, sw)
    assert all(sw[n] != sw[p] for n, p in got.items())
    assert sorted(set(got.values())) == nodes  # every node keeps exactly one node's copies
    assert choose_partners(["only"]) == {}
    plain = choose_partners(["a", "b", "c"])
    assert all(n != p for n, p in plain.items())


def test_plan_prefers_local_and_lists_shared_only_when_needed() -> None:
    fs = frozenset
    n1 = NodeInv("n1", ("h1", 1), own={2: fs({0}), 3: fs({0})}, held={2: fs({1}), 3: fs({1})})
    n3 = NodeInv("n3", ("h3", 3))
    assert not needs_shared([n1, n3], 2, set())
    assert candidates([n1, n3], 2, {}, set()) == [3, 2]
    got = places(3, 1, "n3", [n1, n3], {3: fs({1})})
    assert [p.words() for p in got] == ["partner (held copy on n1)", "shared"]
    # A step newer than any complete one: shared storage may hold it only if a rank drained
    # it (its marker); else it is not worth a read of the file system.
    n1b = NodeInv("n1", ("h1", 1), own={4: fs({0}), 3: fs({0})}, held={3: fs({1})})
    assert not needs_shared([n1b], 2, set())
    n1c = NodeInv("n1", ("h1", 1), own={4: fs({0}), 3: fs({0})}, held={3: fs({1})},
                  drained=fs({4}))
    assert needs_shared([n1c], 2, set())
    assert NodeInv.from_wire(n1c.to_wire()) == n1c
    assert needs_shared([n1], 2, {3, 2})
    # A resharding resume (world None): the ranks each step was saved by, wherever seen.
    n2 = NodeInv("n2", ("h2", 2), own={3: fs({1, 2})}, held={2: fs({0})})
    assert candidates([n1, n2], None, {}, set()) == [3, 2]
    assert candidates([n1, n2], None, {}, {3}) == [2]
    assert candidates([n1, n2], None, {3: fs({4})}, set()) == [2]  # rank 3 of 5 nowhere
    assert candidates([n1, n2], None, {3: fs({0, 1, 2, 3})}, set()) == [3, 2]


def test_runtime_gives_the_store_and_nothing_imports_torch() -> None:
    code = ("import sys, bluevela.runtime as r, bluevela.ckpt.store;"
            "f = r.checkpoint_store; assert f.__name__ == 'open_store';"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_ckpt_imports_nothing_of_launch_and_no_torch_at_module_top() -> None:
    """docs/architecture.md: ckpt -> util, site, protocol.keys; torch only inside functions
    (but dcp.py, which a training process loads for DCP)."""
    import ast

    from tests.test_architecture import PKG, imports

    for path in sorted((PKG / "ckpt").glob("*.py")):
        names = imports(path)
        assert not [n for n in names if n.startswith("bluevela.launch")], path
        if path.name in ("dcp.py", "lightning.py"):
            continue
        top = [n for n in ast.parse(path.read_text()).body
               if isinstance(n, (ast.Import, ast.ImportFrom))]
        mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not [m for m in mods if m.split(".")[0] in ("torch", "numpy")], path


def test_a_node_local_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    from bluevela.errors import UnsafeValueError

    mine = tmp_path / "local" / "n1" / f"bv-{os.getuid()}"
    mine.mkdir(parents=True)
    os.chmod(mine, 0o777)
    with pytest.raises(UnsafeValueError, match="group/other-writable"):
        run_ranks(1, lambda rank, coll: make_store(tmp_path, rank, coll))


def test_garbage_and_idle_clients_do_not_stop_the_server(tmp_path: Path) -> None:
    import socket

    from bluevela.ckpt import partner

    idle: list[socket.socket] = []
    with _receiving_server(tmp_path, 1) as (_held, src, addr):
        try:
            with socket.create_connection(addr, timeout=5) as s:  # a line far over the cap
                s.recv(100)
                s.sendall(b"x" * 10_000 + b"\n")
                assert s.recv(100).startswith(b"err ")
            assert send_shard(addr, KEY, src, "rank-00000.bvck", 1, 0) > 0
            # Connections that say nothing hold a slot each until their deadline; over the cap
            # a new one is closed at once (the sender fails fast and takes the next place).
            idle = [socket.create_connection(addr, timeout=5) for _ in range(partner.MAX_CONN)]
            for s in idle:
                s.recv(100)
            with pytest.raises(TransferError):
                send_shard(addr, KEY, src, "rank-00000.bvck", 1, 0)
            for s in idle:
                s.close()
            for _ in range(50):  # the slots come back as the server sees the closes
                try:
                    assert send_shard(addr, KEY, src, "rank-00000.bvck", 1, 0) > 0
                    break
                except TransferError:
                    import time

                    time.sleep(0.1)
            else:
                raise AssertionError("the server did not recover its slots")
        finally:
            for s in idle:
                s.close()


def test_config_from_site_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from bluevela.ckpt.store import from_site
    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "site.yaml").read_text())
    cls = next(iter(data["node_classes"]))
    data["node_classes"][cls]["checkpoint"] = {"dir": str(tmp_path / "nvme"), "budget_gb": 2}
    data["checkpoint"] = {"keep_local": 3, "drain_every": 4,
                          "switches": {"a": "g[1-2]", "b": "g[3-4]"}}
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("BV_SITE", str(site))
    monkeypatch.setenv("BV_CACHE_DIR", "off")
    monkeypatch.setenv("BV_NODE_CLASS", cls)
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.delenv("BV_CKPT_LOCAL_DIR", raising=False)
    cfg = from_site(tmp_path / "shared", "run")
    assert (cfg.local_dir, cfg.budget_bytes, cfg.keep, cfg.drain_every, cfg.job) == (
        tmp_path / "nvme", 2_000_000_000, 3, 4, "123")
    assert cfg.switches == {"g1": "a", "g2": "a", "g3": "b", "g4": "b"}
    monkeypatch.setenv("BV_CKPT_LOCAL_DIR", str(tmp_path / "shm"))
    assert from_site(None, keep=1).local_dir == tmp_path / "shm"
    assert from_site(None, keep=1).keep == 1
    # %n: this node's name (several slurmd on one host: the dev cluster's nodes).
    import socket

    monkeypatch.setenv("BV_CKPT_LOCAL_DIR", str(tmp_path / "local" / "%n" / "x"))
    host = socket.gethostname().split(".")[0]
    assert from_site(None).local_dir == tmp_path / "local" / host / "x"


def test_a_state_only_rank_0_saves_is_resumed_by_every_rank(tmp_path: Path) -> None:
    """Lightning's way: rank 0 alone saves the (replicated) checkpoint; every rank loads rank
    0's shard from its fastest place, and `at_most` keeps a resume to a named older step."""
    def body(rank: int, coll: Any) -> Any:
        s = make_store(tmp_path, rank, coll)
        if rank == 0:
            for step in (4, 8):
                s.save(step, _state(0, step))
        s.wait()
        coll.all_gather(None)  # rank 0's copies are on n2 before n2 takes its inventory
        newest = s.load_latest(source_rank=0)
        older = s.load_latest(source_rank=0, at_most=7)
        s.close()
        return newest, older

    (n0, o0), (n1, o1) = run_ranks(2, body)
    assert (n0.step, n1.step, o0.step, o1.step) == (8, 8, 4, 4)
    _check(n1.state, 0, 8)
    _check(o1.state, 0, 4)
    assert n0.source == "local (own copy on this node)"
    assert n1.source == "local (held copy on this node)"


def _spare_resume_with_budget(tmp: Path, budget: int) -> list[Any]:
    def body(rank: int, coll: Any) -> Any:
        s = make_store(tmp, rank, coll, node="n3" if rank == 1 else None, budget_bytes=budget)
        try:
            return s.load_latest(), s.kept_fetched
        finally:
            s.close()

    return run_ranks(2, body)


def test_a_fetched_shard_is_kept_within_the_budget_and_removes_nothing(tmp_path: Path) -> None:
    """The spare fetches the lost node's shard of step 2 from the partner. It already holds
    that rank's step 1 (an older copy a resume may fall back to). With room for one shard
    the fetched copy is not kept (the resume goes on from memory) and step 1 stays; with
    room for both it is kept beside step 1. Nothing is ever removed for a fetch."""
    _save_steps(tmp_path, 2, [1, 2], shared_dir=None)
    older = _shard(tmp_path, "n3", "own", 1, 1)
    older.parent.mkdir(parents=True)
    shutil.copy2(_shard(tmp_path, "n2", "own", 1, 1), older)
    size = older.stat().st_size
    shutil.rmtree(tmp_path / "local" / "n2")  # the node is lost with its disk
    (r0, _), (r1, kept) = _spare_resume_with_budget(tmp_path, size + size // 2)
    assert (r0.step, r1.step) == (2, 2) and r1.source == "partner (held copy on n1)"
    _check(r1.state, 1, 2)
    assert not _shard(tmp_path, "n3", "own", 2, 1).exists()  # over the budget: not kept
    assert older.is_file()  # and nothing removed for it
    assert kept == [(2, 1, f"node-local budget ({size + size // 2} bytes) full; nothing is "
                              "removed for a fetch")], kept
    (_, _), (r1, kept) = _spare_resume_with_budget(tmp_path, 3 * size)
    assert r1.step == 2 and kept == [(2, 1, None)], kept
    assert _shard(tmp_path, "n3", "own", 2, 1).is_file() and older.is_file()
