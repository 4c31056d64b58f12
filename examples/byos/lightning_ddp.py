"""A plain Lightning DDP script, written as Lightning's SLURM docs show it: nothing of bv.

    bv submit -N 2 --spare-nodes 1 --procs-per-node 2 examples/byos/lightning_ddp.py --root DIR

The Trainer's `num_nodes` and `devices` come from Slurm's variables (under bv they describe the
training step, not the allocation with its spare: docs/byos.md). It checkpoints and resumes as
Lightning's docs show: a `ModelCheckpoint(dirpath=..., save_last=True, every_n_train_steps=25)`
and `fit(ckpt_path="last")`, which loads the newest of that callback's `last.ckpt` (bv points it
at the checkpoint of its signal). `--ckpt-path none`: `fit()` gets no `ckpt_path`, and under
Slurm Lightning resumes from the newest `hpc_ckpt_*.ckpt` in `default_root_dir` by itself.
Rank 0 prints `step=<global step>` after each step; every rank prints, at the start of
training, `rank=<R> start_step=<S> world_size=<W> nodes=<N> slurm=<the Slurm names it sees>`.
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SLURM_NAMES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST")


class Regression(L.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step_s = step_s

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_s:
            time.sleep(self.step_s)
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        seen = " ".join(f"{n}={os.environ.get(n, '-')}" for n in SLURM_NAMES)
        print(f"rank={self.global_rank} start_step={self.global_step} "
              f"world_size={self.trainer.world_size} nodes={self.trainer.num_nodes} {seen}",
              flush=True)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.trainer.is_global_zero:
            print(f"step={self.global_step}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="default_root_dir (shared by all nodes)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--ckpt-path", default="last",
                        help='fit()\'s ckpt_path: "last" (default), "none", or a path')
    parser.add_argument("--every", type=int, default=25,
                        help="ModelCheckpoint's every_n_train_steps")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=gen)
    y = torch.tanh(x.sum(dim=1, keepdim=True) / 4)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["SLURM_NTASKS_PER_NODE"]),
        num_nodes=int(os.environ["SLURM_JOB_NUM_NODES"]),
        strategy="ddp",
        max_steps=args.steps,
        default_root_dir=args.root,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"),
                                   save_last=True, every_n_train_steps=args.every)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(args.step_s), loader,
                ckpt_path=None if args.ckpt_path == "none" else args.ckpt_path)
    if trainer.is_global_zero:
        print(f"done step={trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
