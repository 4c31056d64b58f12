"""A plain DDP script that checkpoints through bv's node-local store (docs/checkpoints.md).

    bv submit -N 2 --spare-nodes 1 examples/train_store.py --shared /shared/ckpt/run1

Every `--ckpt-every` steps it saves through `runtime.checkpoint_store` (the loop stalls only
for the copy into host memory; the shard goes to this node, a copy to the partner node, and to
shared storage at the end or at bv's checkpoint request). At start every rank resumes from the
newest step complete somewhere and prints

    rank=<R> attempt=<A> host=<H> resumed=<S> source=<where> shared_reads=<n>

(resumed=-1 on a fresh start), rank 0 also the store's summary line (`bv ckpt: resumed ...`).
`--local-base DIR` puts the node-local tier at DIR/<hostname> (the dev cluster's nodes share
one disk; a site names its NVMe or /dev/shm in site.yaml instead).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bluevela import runtime

runtime.install_signal_handler()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shared", type=Path, required=True)
    parser.add_argument("--local-base", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.3)
    parser.add_argument("--mb", type=float, default=1.0, help="state size per rank, MB")
    parser.add_argument("--drain-every", type=int, default=0)
    parser.add_argument("--hold-at", type=int, default=-1,
                        help="(tests) in attempt 1, after this step's save is written, print "
                             "'holding at step N' and wait for --hold-file to exist")
    parser.add_argument("--hold-file", type=Path, default=None)
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    rank, host = dist.get_rank(), socket.gethostname()
    overrides: dict[str, Any] = {}
    if opts.local_base is not None:
        overrides["local_dir"] = opts.local_base / host
    store = runtime.checkpoint_store(opts.shared, name="train", drain_every=opts.drain_every,
                                     **overrides)
    n = max(1, int(opts.mb * 1e6 / 4))
    state: dict[str, Any] = {"w": torch.zeros(n), "step": -1}
    restored = store.load_latest()
    start = 0
    if restored is not None:
        state["w"].copy_(restored.state["w"])
        start = restored.step + 1
        assert state["w"][0].item() == restored.step * 10 + rank, "wrong shard"
    _say(f"rank={rank} attempt={runtime.attempt()} host={host} "
         f"resumed={restored.step if restored else -1} "
         f"source={restored.source.replace(' ', '_') if restored else 'none'} "
         f"shared_reads={store.shared_reads}")
    for step in range(start, opts.steps):
        time.sleep(opts.step_s)
        state["w"].fill_(step * 10 + rank)
        dist.barrier()
        if rank == 0:
            _say(f"step={step} attempt={runtime.attempt()}")
        if step % opts.ckpt_every == 0 or runtime.checkpoint_requested():
            # The store tells bv's goodput ledger the stall (and, from its writer thread,
            # the background phase): no `runtime.checkpointing` around it.
            stats = store.save(step, {"w": state["w"], "step": step})
            if rank == 0:
                _say(f"checkpoint step={step} stall_s={stats.stall_s:.4f}")
            if runtime.checkpoint_requested():
                break
        if step == opts.hold_at and runtime.attempt() == 1 and opts.hold_file is not None:
            store.wait()
            dist.barrier()
            if rank == 0:
                _say(f"holding at step {step}")
            while not opts.hold_file.exists():
                time.sleep(0.2)
        runtime.progress(step)
    done = store.finalize()
    if rank == 0:
        newest = max(done) if done else None
        _say(f"final tiers step={newest} {','.join(done.get(newest, [])) if newest is not None else ''}")
    runtime.finished()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
