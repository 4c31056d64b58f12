"""A tiny real DDP training job: the smallest thing that proves a multi-node launch works.

Run under torchrun (`bv submit -N 2 --procs-per-node 2 examples/train_ddp.py`). gloo on CPU,
NCCL on GPUs. Every rank prints, at the end, exactly one line:
    rank=<R> world_size=<W> host=<hostname> loss=<final loss>
and rank 0 first prints `initial_loss=<L0> final_loss=<L>` so a caller can check the loss fell.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fail", action="store_true", help="exit 3 after training (for tests)")
    opts = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)  # 289 params
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=opts.lr)

    # Each rank its own shard of one fixed regression problem.
    gen = torch.Generator().manual_seed(1234 + rank)
    true_w = torch.linspace(-1, 1, 16).unsqueeze(1)
    x = torch.randn(256, 16, generator=gen)
    y = torch.tanh(x @ true_w) + 0.01 * torch.randn(256, 1, generator=gen)
    x, y = x.to(device), y.to(device)

    def global_loss(model: nn.Module) -> float:
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(x), y)
            dist.all_reduce(loss)
            return loss.item() / world

    initial = global_loss(ddp)
    for _ in range(opts.steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    final = global_loss(ddp)
    # One write per line: ranks of a node share srun's stdout, and print() may write the text
    # and its newline separately, gluing two ranks' lines together.
    if rank == 0:
        _say(f"initial_loss={initial:.6f} final_loss={final:.6f}")
    _say(f"rank={rank} world_size={world} host={socket.gethostname()} loss={final:.6f}")
    # Free DDP (its reducer holds gloo work) before the group goes: tearing the group down
    # under a live reducer aborted ~1 in 8 runs at exit ("terminate called without an active
    # exception") with torch 2.13 + gloo.
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 3 if opts.fail else 0


if __name__ == "__main__":
    sys.exit(main())
