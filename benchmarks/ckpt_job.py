"""The checkpoint benchmark's training-side job (run by bench_ckpt.py under `bv submit`).

Each rank holds a state of `--mb` MB (float32) and saves it `--rounds` times with each method,
interleaved (the order rotates every round):

- torch: `torch.save` of the rank's state to the shared directory, atomically (temp, fsync,
  rename), the way examples/train_ddp.py does it: the loop waits for all of it;
- dcp: `torch.distributed.checkpoint.async_save` to the shared directory: the loop waits until
  it returns (its staging); its background write is awaited before the next method runs;
- store: bv's store (`runtime.checkpoint_store`): the loop waits for the staging; its
  background phase (node-local write + partner copy) is awaited before the next method runs.

Then the resume figures: `store.load_latest()` with the node-local files there, with rank 1's
own file deleted (its shard fetched from the partner node), and `torch.load` from shared of
the other rank's file (what a spare reads of a lost node's).
Rank 0 prints `FIG <name> <value> <unit>` lines (the max over ranks of each rank's median).
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _ckpt_job_common import fsync_save, job_parser

from bluevela import runtime


def main() -> int:
    p = job_parser()
    p.add_argument("--rounds", type=int, default=5)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    n = int(opts.mb * 1e6 / 4)
    state: dict[str, Any] = {"w": torch.randn(n), "step": 0}
    tag = f"{int(opts.mb)}MB"
    opts.shared.mkdir(parents=True, exist_ok=True)
    store = runtime.checkpoint_store(opts.shared, name=f"bench{tag}",
                                     local_dir=opts.local_base / host, drain_every=0)
    stalls: dict[str, list[float]] = {"torch": [], "dcp": [], "store": []}
    background: dict[str, list[float]] = {"dcp": [], "store": []}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    methods = list(stalls)
    for r in range(opts.rounds):
        order = methods[r % 3:] + methods[:r % 3]
        for m in order:
            state["w"].add_(1.0)
            state["step"] = r
            dist.barrier()
            t0 = time.perf_counter()
            if m == "torch":
                fsync_save(state, opts.shared / f"torch-{tag}-rank{rank}.pt")
                stalls[m].append(time.perf_counter() - t0)
            elif m == "dcp":
                fut = dcp.async_save(state, checkpoint_id=str(opts.shared / f"dcp-{tag}-{r}"))
                stalls[m].append(time.perf_counter() - t0)
                fut.result()  # type: ignore[union-attr]
                background[m].append(time.perf_counter() - t0)
            else:
                stats = store.save(r, state)
                stalls[m].append(stats.stall_s)
                store.wait()
                background[m].append(time.perf_counter() - t0)
            dist.barrier()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # Resume: node-local, then with rank 1's own files gone (the partner's copy), then the
    # torch.save file from shared storage.
    store.wait()
    dist.barrier()
    t0 = time.perf_counter()
    got = store.load_latest()
    local_s = time.perf_counter() - t0
    assert got is not None
    del got
    dist.barrier()
    if rank == 1:
        shutil.rmtree(opts.local_base / host / f"bv-{os.getuid()}" / f"job-{store.cfg.job}"
                      / store.cfg.name / "own")
    dist.barrier()
    t0 = time.perf_counter()
    got = store.load_latest()
    partner_s = time.perf_counter() - t0
    assert got is not None
    source = got.source
    del got
    dist.barrier()
    t0 = time.perf_counter()
    # The other rank's file, as a spare reads the lost node's (through this node's own mount:
    # not the page cache of the node that wrote it).
    torch.load(opts.shared / f"torch-{tag}-rank{(rank + 1) % world}.pt", weights_only=True)
    torch_load_s = time.perf_counter() - t0
    store.close()
    mine = {f"stall_{k}": statistics.median(v) for k, v in stalls.items()}
    mine.update({f"background_{k}": statistics.median(v) for k, v in background.items()})
    mine.update(resume_local=local_s, resume_partner=partner_s, resume_torch_load=torch_load_s,
                rss_growth_mb=(rss1 - rss0) / 1e6, staged_mb=store.stager.held_bytes / 1e6)
    everyone: list[dict[str, float] | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for key in mine:
            vals = [e[key] for e in everyone if e is not None]
            unit = "MB" if key.endswith("_mb") else "s"
            print(f"FIG {tag} {key} {max(vals):.6f} {unit}", flush=True)
        print(f"FIG {tag} rounds {opts.rounds} n", flush=True)
    if rank == 1:
        print(f"FIGNOTE {tag} rank 1 resumed from {source}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
