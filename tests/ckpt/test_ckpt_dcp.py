"""torch.distributed.checkpoint through the store (bluevela/ckpt/dcp.py): `dcp.save` with
`StoreWriter` returns once the state is staged, the shard is written in the background, and
`dcp.load` with `StoreReader` puts the same values back, from the node-local tier, and from
shared storage once the node-local copy is torn."""

from __future__ import annotations

import os
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
