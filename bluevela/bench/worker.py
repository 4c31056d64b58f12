"""One rank of a multi-process measurement: `python -m bluevela.bench.worker allreduce|mpi ...`.

Started by `bluevela.bench.dist.spawn_local` (local ranks) or as the tasks of an `srun` step in
a nightly batch job. Rank 0 writes its Facts as JSON to `--out` (atomically) or to stdout; the
others print nothing. Plain argparse: every rank starts this, so it stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bluevela.bench.worker")
    sub = p.add_subparsers(dest="what", required=True)
    ar = sub.add_parser("allreduce", help="all_reduce sweep (torch.distributed)")
    ar.add_argument("--scope", choices=("node", "pair"), default="node")
    ar.add_argument("--size-bytes", type=int, required=True)
    ar.add_argument("--warmup", type=int, default=2)
    ar.add_argument("--max-iters", type=int, default=20)
    mp = sub.add_parser("mpi", help="MPI point-to-point bandwidth and latency (mpi4py)")
    mp.add_argument("--size-bytes", type=int, required=True)
    for sp in (ar, mp):
        sp.add_argument("--budget-s", type=float, default=0.5)
        sp.add_argument("--out", default=None, help="rank 0 writes its JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="bv-worker: %(levelname)s: %(message)s")
    from bluevela.bench.dist import from_environment, launcher_rank
    from bluevela.bench.result import Facts

    facts: Facts
    if args.what == "allreduce":
        from bluevela.bench.allreduce import run_rank, sweep_config
        from bluevela.errors import BenchError

        cfg = sweep_config(args.size_bytes, args.budget_s, args.warmup, args.max_iters)
        try:
            env = from_environment()
        except BenchError as exc:  # no rendezvous port: every rank says so, rank 0 reports it
            facts = Facts.failed("allreduce" if args.scope == "node" else "allreduce-pair",
                                 str(exc))
            rank = launcher_rank()
        else:
            facts = run_rank(env, args.scope, cfg)
            rank = env.rank if env else 0
    else:
        from bluevela.bench.mpi import run_mpi

        facts = run_mpi(args.size_bytes, args.budget_s)
        rank = launcher_rank()
    if rank != 0:
        return 0
    text = json.dumps(facts.to_dict(), indent=1, sort_keys=True) + "\n"
    if args.out:
        from bluevela.util.fs import atomic_write

        atomic_write(Path(args.out), text.encode())
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
