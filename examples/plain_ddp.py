"""A plain DDP training script that knows nothing of bv: torchrun's environment, a periodic
checkpoint and a resume from it, as PyTorch's DDP tutorial writes them.

    bv submit -N 2 --spare-nodes 1 examples/plain_ddp.py --ckpt-dir DIR
    torchrun --standalone --nproc-per-node 2 examples/plain_ddp.py --ckpt-dir DIR

Rank 0 saves `DIR/ckpt.pt` every `--ckpt-every` steps (written beside, then renamed: a crash
mid-save leaves the previous one); every rank loads it at start when it is there. It prints,
per rank at the start of training, `rank=<R> resumed_from_step=<S> world_size=<W> host=<H>`,
and rank 0 `step=<S>` after each step and `done step=<S>` at the end. No signal handling, no
import of bluevela: what bv does for it comes from outside (docs/byos.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def say(line: str) -> None:
    """One write per line: the ranks share the output (print writes the newline apart when
    the stream is unbuffered, and two ranks' lines then run into each other)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-s", type=float, default=0.0, help="sleep per step")
    parser.add_argument("--ckpt-every", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    path = args.ckpt_dir / "ckpt.pt"
    start = 0
    if path.exists():
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    say(f"rank={rank} resumed_from_step={start} world_size={world} host={socket.gethostname()}")
    gen = torch.Generator().manual_seed(rank)
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 32, generator=gen).to(device)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_s:
            time.sleep(args.step_s)
        if rank == 0:
            say(f"step={step}")
            if step % args.ckpt_every == 0:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, path)
    if rank == 0:
        say(f"done step={args.steps}")
    # DDP freed before its group goes (its reducer holds gloo work), and every rank there
    # before any tears the group down: with torch 2.13 + gloo, destroying the group under a
    # live reducer ended a rank in SIGABRT at exit ("terminate called without an active
    # exception") in 3 of 38 runs of tests/integrations/test_plain_example.py under load.
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
