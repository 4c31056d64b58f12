"""A plain Accelerate training loop, as Accelerate's docs show it, plus bv's one line.

    bv submit -N 2 --spare-nodes 1 --procs-per-node 2 examples/byos/accelerate_loop.py --dir DIR

Checkpoints with `save_state()`/`load_state()` in DIR/state (or, `--auto-naming`, Accelerate's
automatic names in DIR/checkpoints; every `--every` steps too, when given) and stops early
with Accelerate's own `set_trigger()`/`check_trigger()` (a flag reduced across ranks). The one
line for bv (docs/byos.md) turns bv's checkpoint request into that trigger. Rank 0 prints
`step=<n>` after each step; every rank prints `rank=<R> start_step=<S> world_size=<W>` at start.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bluevela import runtime


class Steps:
    """The step counter, saved and loaded with the rest of the state."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="project_dir (shared by all nodes)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--every", type=int, default=0,
                        help="save_state() every N steps as well (0: only at the end or bv's request)")
    parser.add_argument("--auto-naming", action="store_true",
                        help="Accelerate's automatic_checkpoint_naming: DIR/checkpoints/"
                             "checkpoint_<n>, the newest loaded (the node-local tier takes these)")
    opts = parser.parse_args()
    project = ProjectConfiguration(project_dir=opts.dir, automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, **({"project_config": project} if opts.auto_naming
                                           else {}))
    # save_state(None) / load_state(None): Accelerate's automatic names under DIR/checkpoints
    state_dir = None if opts.auto_naming else os.path.join(opts.dir, "state")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=gen)
    y = torch.tanh(x.sum(dim=1, keepdim=True) / 4)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    steps = Steps()
    accelerator.register_for_checkpointing(steps)
    if os.path.isdir(state_dir or os.path.join(opts.dir, "checkpoints")):
        accelerator.load_state(state_dir)
    print(f"rank={accelerator.process_index} start_step={steps.done} "
          f"world_size={accelerator.num_processes} "
          f"SLURM_JOB_NUM_NODES={os.environ.get('SLURM_JOB_NUM_NODES', '-')} "
          f"SLURM_PROCID={os.environ.get('SLURM_PROCID', '-')}", flush=True)
    while steps.done < opts.steps:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if opts.step_s:
                time.sleep(opts.step_s)
            steps.done += 1
            if accelerator.is_main_process:
                print(f"step={steps.done}", flush=True)
            if runtime.checkpoint_requested(): accelerator.set_trigger()  # noqa: E701 - bv's one line
            if accelerator.check_trigger() or steps.done == opts.steps:
                accelerator.save_state(state_dir)
                break
            if opts.every and steps.done % opts.every == 0:
                accelerator.save_state(state_dir)
        else:
            continue
        break
    if accelerator.is_main_process:
        print(f"done step={steps.done}", flush=True)


if __name__ == "__main__":
    main()
