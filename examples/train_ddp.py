"""A tiny real DDP training job: the smallest thing that proves a multi-node launch works.

Run under torchrun (`bv submit -N 2 --procs-per-node 2 examples/train_ddp.py`). gloo on CPU,
NCCL on GPUs. Every rank prints, at the end, exactly one line:
    rank=<R> world_size=<W> host=<hostname> loss=<final loss>
and rank 0 first prints `initial_loss=<L0> final_loss=<L>` so a caller can check the loss fell.

With `--ckpt-dir DIR` it follows bv's resilience contract (docs/resilience.md): at start every
rank loads DIR/ckpt.pt when there is one and prints
    rank=<R> attempt=<A> resumed_from_step=<S>
(S = 0 on a fresh start); rank 0 saves a checkpoint every `--ckpt-every` steps and as soon as
bv asks for one (SIGUSR1 before the time limit, SIGTERM on requeue/preemption), atomically
(a temporary file under a random name created O_EXCL|O_NOFOLLOW, fsync, rename; the load never
follows a symlink); then, on a request, every rank stops and exits 0 and bv requeues the job.
Rank 0 prints `step=<n> attempt=<A>` after each step and
    checkpoint step=<S> reason=<every|SIGUSR1|SIGTERM>
after each save.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import socket
import sys
import time
from pathlib import Path

from bluevela import runtime

# Before torch: importing it takes seconds, and a checkpoint signal arriving meanwhile must set
# the flag, not kill the process (SIGUSR1's default action).
runtime.install_signal_handler()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

CKPT = "ckpt.pt"


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fail", action="store_true", help="exit 3 after training (for tests)")
    parser.add_argument("--ckpt-dir", type=Path, default=None,
                        help="checkpoint here and resume from here (shared by all nodes)")
    parser.add_argument("--ckpt-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--step-s", type=float, default=0.0,
                        help="extra seconds per step (stands in for real work in tests)")
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
    start = 0
    if opts.ckpt_dir is not None:
        start = _load(opts.ckpt_dir, model, opt)
        _say(f"rank={rank} attempt={runtime.attempt()} resumed_from_step={start}")
    stopped = False
    for step in range(start, opts.steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if opts.step_s:
            time.sleep(opts.step_s)
        done = step + 1
        if rank == 0:
            _say(f"step={done} attempt={runtime.attempt()}")
        runtime.progress(done)
        if opts.ckpt_dir is None:
            continue
        # Agree on a request: the signal reaches the ranks at slightly different moments, and
        # all must stop after the same step.
        flag = torch.tensor([1.0 if runtime.checkpoint_requested() else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        requested = bool(flag.item())
        if rank == 0 and (requested or done % opts.ckpt_every == 0 or done == opts.steps):
            with runtime.checkpointing(done):  # its start and end go to bv's goodput ledger
                _save(opts.ckpt_dir, model, opt, done)
            reason = (runtime.requested_by() or "SIGUSR1") if requested else "every"
            _say(f"checkpoint step={done} reason={reason}")
        if requested:
            stopped = True
            break
    # Training is over: what follows (the last collectives, the group's teardown, the
    # interpreter's exit) may be slow on a loaded node, and is not a hang.
    runtime.finished()
    if stopped:
        dist.barrier()
        _say(f"rank={rank} stopping for requeue at step={done}")
        del ddp, opt
        gc.collect()
        dist.destroy_process_group()
        return 0
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


def _load(ckpt_dir: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load DIR/ckpt.pt when present (not through a symlink); return the step to resume from
    (0: fresh)."""
    try:  # never through a symlink someone planted at the name
        fd = os.open(ckpt_dir / CKPT, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    with os.fdopen(fd, "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def _save(ckpt_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Atomic: a reader (the next attempt) sees the old checkpoint or the new one, never half.
    A temporary file under an unpredictable name, created O_EXCL|O_NOFOLLOW in the directory's
    fd (a name planted there, a symlink included, is passed over, never written through),
    fsync, rename over `ckpt.pt`, fsync the directory."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dfd = os.open(ckpt_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for _ in range(8):
            tmp = f".{CKPT}.{secrets.token_hex(16)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            except FileExistsError:
                continue
            break
        else:
            raise FileExistsError(f"{ckpt_dir}: no free temporary name in 8 tries")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, CKPT, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


if __name__ == "__main__":
    sys.exit(main())
