"""torch.distributed.checkpoint through the store (bluevela/ckpt/dcp.py): `dcp.save` with
`StoreWriter` returns once the state is staged, the shard is written in the background, and
`dcp.load` with `StoreReader` puts the same values back, from the node-local tier, and from
shared storage once the node-local copy is torn."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from bluevela.ckpt import layout
from tests.ckpt_helpers import make_store, run_ranks

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_dcp_round_trip_through_the_store(tmp_path: Path) -> None:
    from bluevela.ckpt.dcp import StoreReader, StoreWriter

    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "extra": {"epoch": 7, "note": "x"}}
    expect = {k: v.clone() for k, v in model.state_dict().items()}

    def save(rank: int, coll: Any) -> dict[int, list[str]]:
        store = make_store(tmp_path, rank, coll)
        dcp.save(saved, storage_writer=StoreWriter(store, 12), no_dist=True)
        return store.finalize()

    assert run_ranks(1, save)[0] == {12: ["local", "shared"]}
    for which in ("local", "shared"):
        if which == "shared":  # a torn node-local file: DCP loads the shared copy instead
            p = (tmp_path / "local" / "n1" / f"bv-{os.getuid()}" / "job-77" / "t" / "own"
                 / layout.step_dir(12) / layout.shard_name(0))
            p.write_bytes(p.read_bytes()[:-3])
        fresh = _model()
        for prm in fresh.parameters():
            prm.data.zero_()
        target = {"model": fresh.state_dict(), "extra": {"epoch": 0, "note": ""}}

        def load(rank: int, coll: Any, target: dict[str, Any] = target
                 ) -> tuple[int | None, str]:
            store = make_store(tmp_path, rank, coll)
            reader = StoreReader(store)
            dcp.load(target, storage_reader=reader, no_dist=True)
            store.close()
            assert reader.restored is not None
            return reader.step, reader.restored.summary

        step, summary = run_ranks(1, load)[0]
        assert step == 12
        assert ("torn" in summary) == (which == "shared"), summary
        for k, v in expect.items():
            assert torch.equal(fresh.state_dict()[k], v), k
        assert target["extra"] == {"epoch": 7, "note": "x"}


def _job(tmp: Path, mode: str, nodes: list[str]) -> list[dict[str, Any]]:
    """One DCP job of len(nodes) processes (tests/ckpt/dcp_rank.py), rank r on nodes[r]."""
    import json
    import subprocess
    import sys

    from bluevela.launch.agent import free_port

    port = str(free_port())
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.ckpt.dcp_rank", mode, str(r), str(len(nodes)), port,
         str(tmp), node], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r, node in enumerate(nodes)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(out, key=lambda d: d["rank"])


def test_dcp_reshards_a_grown_and_a_shrunk_job_from_node_local_copies(tmp_path: Path) -> None:
    """Saved by 2 processes (a row-sharded DTensor, FSDP's layout, and a replicated tensor),
    node n2 then lost with its disk: a job of 3 (n1 and two new nodes) and a job of 1 (n1)
    load every value back through DCP's planner from the node-local copies; the lost node's
    shard comes from n1's copy of it. No shared tier at all."""
    _job(tmp_path, "save", ["n1", "n2"])
    shutil.rmtree(tmp_path / "local" / "n2")
    grown = _job(tmp_path, "load", ["n1", "n3", "n4"])
    assert [(g["step"], g["ok"]) for g in grown] == [(2, True)] * 3, grown
    assert grown[0]["summary"].startswith("bv ckpt: resumed step 2 (saved by 2 ranks, now 3)")
    assert grown[0]["summary"].endswith("from local (own copy on this node) x1, "
                                        "partner (held copy on n1) x1; nothing skipped")
    shrunk = _job(tmp_path, "load", ["n1"])
    assert [(s["step"], s["ok"]) for s in shrunk] == [(2, True)], shrunk
    assert shrunk[0]["summary"].startswith("bv ckpt: resumed step 2 (saved by 2 ranks, now 1)")
    assert shrunk[0]["summary"].endswith("from local (held copy on this node) x1, "
                                         "local (own copy on this node) x1; nothing skipped")
