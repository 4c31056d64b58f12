"""One rank of a DCP job over the store, as its own process (gloo on loopback), for
tests/ckpt/test_ckpt_dcp.py's resharding test:

    python -m tests.ckpt.dcp_rank save|load RANK WORLD PORT TMP NODE

The state: a tensor sharded by rows over the job's ranks (a DTensor on a CPU mesh, FSDP's
layout), a plain tensor every rank holds (DCP saves it once) and a number. `save` saves steps 1
and 2 with `StoreWriter` (no shared tier); `load` loads into zeros with `StoreReader` and
prints one JSON line: the step, the summary, and whether every value came back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from bluevela.ckpt.collective import TorchGroup
from bluevela.ckpt.dcp import StoreReader, StoreWriter
from tests.ckpt_helpers import make_store


def _values(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.arange(60, dtype=torch.float32).reshape(12, 5) + 100 * step,
            torch.arange(7, dtype=torch.int64) * step)


def main() -> None:
    mode, rank, world, port, tmp, node = sys.argv[1:7]
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                            world_size=w)
    mesh = init_device_mesh("cpu", (w,))
    store = make_store(Path(tmp), r, TorchGroup(), node=node,  # type: ignore[arg-type]
                       shared_dir=None)
    if mode == "save":
        for step in (1, 2):
            big, small = _values(step)
            saved = {"model": {"w": distribute_tensor(big, mesh, [Shard(0)]), "b": small},
                     "epoch": step}
            dcp.save(saved, storage_writer=StoreWriter(store, step))
        store.finalize()
    else:
        big, small = _values(0)
        state: dict[str, Any] = {"model": {"w": distribute_tensor(torch.zeros_like(big), mesh, [Shard(0)]),
                           "b": torch.zeros_like(small)}, "epoch": 0}
        reader = StoreReader(store)
        dcp.load(state, storage_reader=reader)
        assert reader.restored is not None
        step = reader.step or 0
        big, small = _values(step)
        ok = (torch.equal(state["model"]["w"].full_tensor(), big)
              and torch.equal(state["model"]["b"], small) and state["epoch"] == step)
        print(json.dumps({"rank": r, "step": step, "ok": ok,
                          "summary": reader.restored.summary}), flush=True)
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
