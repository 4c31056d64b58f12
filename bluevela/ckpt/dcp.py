"""torch.distributed.checkpoint (DCP) over the checkpoint store: `StoreWriter` and
`StoreReader`, so torchtitan and any DCP user takes the node-local tier, the partner copy and
the drain by configuration:

    store = runtime.checkpoint_store("/shared/ckpt/run1")
    dcp.save(state_dict, storage_writer=StoreWriter(store, step))     # blocks for staging only
    dcp.load(state_dict, storage_reader=StoreReader(store))          # newest verified step

Each rank's write items go into its one shard of the step (`dcp.save` returns once they are
staged; the store writes in the background). The coordinator's shard carries DCP's metadata
(DCP's own pickle, as its FileSystemWriter keeps it, unpickled only from a verified shard of
this job). DCP reads a replicated item from the rank that wrote it: the reader takes that
rank's shard from its fastest verified place too (this node, the node that holds it, shared).

Resharding (a job of another size: a shrink, a grow) is DCP's planner over the store's
shards: `StoreReader` resumes the newest step complete somewhere whatever the number of ranks
that saved it (`load_latest(any_world=True)`: each rank verifies its share of the saved
shards, from this node, the node holding a copy, or shared storage), and DCP reads each item
from the saved rank that wrote it. This module imports torch: load it only in a training
process.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from bluevela.ckpt.store import CheckpointStore, Restored

META = "dcp_metadata"


class StoreWriter(StorageWriter):
    """DCP's writer into `store` at `step`."""

    def __init__(self, store: CheckpointStore, step: int, drain: bool | None = None) -> None:
        super().__init__()
        self.store, self.step, self.drain = store, step, drain
        self.coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id).isdigit():
            self.step = int(str(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items: dict[str, Any] = {}
        results = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = str(i)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                value: Any = data.getvalue()
                size = len(value)
            else:
                value = data.detach() if isinstance(data, torch.Tensor) else data
                size = value.numel() * value.element_size()
            items[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=(self.store.rank, key)))
        self.store.save(self.step, {"items": items}, drain=self.drain, hold=self.coordinator)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.coordinator:
            # Where each item lies, as DCP's FileSystemWriter records it.
            metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
            self.store.commit({META: pickle.dumps(metadata)})


class StoreReader(StorageReader):
    """DCP's reader of the newest step every rank can read from `store`."""

    def __init__(self, store: CheckpointStore) -> None:
        super().__init__()
        self.store = store
        self.restored: Restored | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.shards: dict[int, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.restored = None
        self.shards = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.restored is None:
            self.restored = self.store.load_latest(any_world=True)
            if self.restored is None:
                raise FileNotFoundError("bv ckpt: no checkpoint to resume from")
            self.shards.update(self.restored.state)  # saved rank -> its state
        raw = self.restored.extra.get(META) if self.store.rank == 0 else None
        raw = self.store.coll.all_gather(raw)[0]
        if raw is None:
            raise FileNotFoundError("bv ckpt: the step has no DCP metadata")
        meta = pickle.loads(raw)  # noqa: S301 - a verified shard of this job (see the docstring)
        assert isinstance(meta, Metadata)
        return meta

    @property
    def step(self) -> int | None:
        return self.restored.step if self.restored else None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _shard(self, rank: int) -> Any:
        if rank not in self.shards:
            assert self.restored is not None
            got = self.store.load_rank(self.restored.step, rank)
            if got is None:
                raise FileNotFoundError(f"bv ckpt: rank {rank}'s shard of step "
                                        f"{self.restored.step}: "
                                        + "; ".join(self.store.last_skips))
            self.shards[rank] = got[0]
        return self.shards[rank]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for req in plan.items:
            rank, key = self.storage_data[req.storage_index]
            value = self._shard(int(rank))["items"][key]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(value))
            else:
                tensor = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"bv ckpt: {req.storage_index}: shape {tuple(tensor.size())}"
                                     f" where {tuple(target.size())} was expected")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
