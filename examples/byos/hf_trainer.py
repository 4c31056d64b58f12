"""A plain Hugging Face Trainer script, as HF's docs and examples show it: nothing of bv.

    bv submit -N 2 --spare-nodes 1 --procs-per-node 2 examples/byos/hf_trainer.py --out DIR

Resumes the way HF's example scripts do (run_clm.py and friends): `get_last_checkpoint()` of
`output_dir`, passed to `train(resume_from_checkpoint=...)`. Rank 0 prints `step=<global step>`
after each step; every rank prints `rank=<R> start_step=<S> world_size=<W> slurm=<...>` when
training begins.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

SLURM_NAMES = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_JOB_NODELIST")


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.tanh(self.x.sum(dim=1, keepdim=True) / 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Regression(nn.Module):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step_s = step_s

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.step_s and self.training:
            time.sleep(self.step_s)
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Report(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        seen = " ".join(f"{n}={os.environ.get(n, '-')}" for n in SLURM_NAMES)
        print(f"rank={args.process_index} start_step={state.global_step} "
              f"world_size={args.world_size} {seen}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero:
            print(f"step={state.global_step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="output_dir (shared by all nodes)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=1000, help="TrainingArguments.save_steps")
    opts = parser.parse_args()
    args = TrainingArguments(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=8,
        learning_rate=0.05, save_steps=opts.save_steps, logging_steps=1000, report_to=[],
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0,
    )
    last = get_last_checkpoint(opts.out) if os.path.isdir(opts.out) else None
    trainer = Trainer(model=Regression(opts.step_s), args=args, train_dataset=Pairs(4096),
                      callbacks=[Report()])
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        print(f"done step={trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
