"""One rank of the nccl check: `python -m bluevela.health.nccl_worker --rank R --world N ...`.

Prints one JSON line `{"rank": R, "time_s": <mean seconds per all_reduce>}`. torch is imported
here only (the prolog never imports this module itself).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    ap.add_argument("--store", required=True, help="FileStore path shared by the ranks")
    ap.add_argument("--size", type=int, required=True, help="bytes per all_reduce")
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    cuda = args.backend == "nccl"
    device = torch.device(f"cuda:{args.rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world)
    try:
        buf = torch.zeros(max(1, args.size // 4), dtype=torch.float32, device=device)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        for _ in range(args.warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        sync()
        elapsed = (time.perf_counter() - t0) / args.iters
    finally:
        dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "time_s": elapsed, "backend": args.backend}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
