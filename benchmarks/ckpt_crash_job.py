"""Crash -> first resumed step, the job side (run by bench_ckpt.py's `crash_resume` under
`bv submit -N 2 --spare-nodes 1`): a loop of `--step-s` steps over a `--mb` MB state per rank
that checkpoints every `--ckpt-every` steps, either through bv's store (`--via store`: node-local,
a copy on the partner node; the spare fetches the lost node's shard from it) or the way the
examples do it today (`--via torch`: `torch.save` of each rank's state to the shared directory,
atomically; the spare reads the lost rank's file back from there). Rank 0 prints

    resumed step=<S> via=<via> in=<seconds> source=<where>
    step=<N> attempt=<A> t=<unix time>       (after every rank finished step N: a barrier)

and the benchmark takes the first step line of the relaunched step.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

from bluevela import runtime

runtime.install_signal_handler()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ckpt_job_common import fsync_save, job_parser  # noqa: E402


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    p = job_parser()
    p.add_argument("--via", choices=("store", "torch"), required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--step-s", type=float, default=0.5)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    rank, host = dist.get_rank(), socket.gethostname()
    state: dict[str, Any] = {"w": torch.zeros(max(1, int(opts.mb * 1e6 / 4))), "step": -1}
    opts.shared.mkdir(parents=True, exist_ok=True)
    mine = opts.shared / f"torch-rank{rank}.pt"
    t0 = time.perf_counter()
    start, source = 0, "none"
    store = None
    if opts.via == "store":
        store = runtime.checkpoint_store(opts.shared, name="crash",
                                         local_dir=opts.local_base / host)
        restored = store.load_latest()
        if restored is not None:
            state["w"].copy_(restored.state["w"])
            start, source = restored.step + 1, restored.source.replace(" ", "_")
            del restored
    elif mine.exists():
        got = torch.load(mine, weights_only=True)
        state["w"].copy_(got["w"])
        start, source = int(got["step"]) + 1, "shared"
        del got
    steps = [torch.tensor(start)]
    dist.all_reduce(steps[0], op=dist.ReduceOp.MIN)  # every rank at the same step
    start = int(steps[0])
    if rank == 0:
        _say(f"resumed step={start - 1} via={opts.via} in={time.perf_counter() - t0:.3f} "
             f"source={source}")
    for step in range(start, opts.steps):
        time.sleep(opts.step_s)
        state["w"].fill_(step * 10 + rank)
        dist.barrier()
        if rank == 0:
            _say(f"step={step} attempt={runtime.attempt()} t={time.time():.3f}")
        if step % opts.ckpt_every == 0:
            if store is not None:
                store.save(step, {"w": state["w"]})
            else:
                fsync_save({"w": state["w"], "step": step}, mine)
            dist.barrier()
            if rank == 0:
                _say(f"checkpoint step={step}")
        runtime.progress(step)
    if store is not None:
        store.close()
    runtime.finished()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
