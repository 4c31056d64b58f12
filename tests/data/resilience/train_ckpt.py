"""A tiny checkpointing gloo job for the recovery tests and benchmark (not an example).

Each step: sleep --step-time, all_reduce one tensor, report progress. Rank 0 checkpoints the
step counter every --ckpt-every steps (atomically) into --ckpt-dir, and when bv asks for a
checkpoint (SIGUSR1). Lines (one write each):
    rank=R attempt=A start_step=K host=H          at start (K > 0: resumed from a checkpoint)
    step=S                                         rank 0, every step
    rank=R done steps=N                           at the end
--hang-rank R --hang-step S: on attempt 1, rank R sleeps forever at step S.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from bluevela import runtime

runtime.install_signal_handler()  # before the slow imports: a checkpoint signal may come early

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.5)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=5)
    o = p.parse_args()
    Path(o.ckpt_dir).mkdir(parents=True, exist_ok=True)
    ckpt = Path(o.ckpt_dir) / "ckpt.json"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    attempt = runtime.attempt()
    say(f"rank={rank} attempt={attempt} start_step={start} host={socket.gethostname()}")
    t = torch.ones(1)
    step = start
    while step < o.steps:
        if attempt == 1 and rank == o.hang_rank and step == o.hang_step:
            while True:
                time.sleep(3600)
        time.sleep(o.step_time)
        dist.all_reduce(t)
        step += 1
        runtime.progress(step)
        if rank == 0:
            say(f"step={step}")
        stop = torch.tensor([1 if runtime.checkpoint_requested() else 0])
        dist.all_reduce(stop)
        if rank == 0 and (step % o.ckpt_every == 0 or stop.item()):
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, ckpt)
        if stop.item():
            say(f"rank={rank} checkpointed at step={step}")
            dist.barrier()
            return 0
    say(f"rank={rank} done steps={step}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
