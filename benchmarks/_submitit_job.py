"""The recovery benchmark's submitit job (benchmarks/bench_recovery.py, BV_BENCH_SUBMITIT=1):
examples/plain_ddp.py run as submitit's docs show a multi-node torch job, one task per node,
each task's rank and rendezvous from `submitit.helpers.TorchDistributedEnvironment`.

    python3 benchmarks/_submitit_job.py FOLDER SCRIPT ARGS...   # prints the Slurm job id

Requeued by Slurm after a node failure (`--requeue`; submitit then runs the same pickled call
again, which resumes from the script's own checkpoint). Task 0's output is
FOLDER/<job>_0_log.out, appended across attempts (`--open-mode=append`). Needs `pip install
submitit` (not installed by CI: a benchmark only).
"""

from __future__ import annotations

import os
import runpy
import sys


def train(script: str, args: list[str]) -> None:
    import submitit

    dist = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ["LOCAL_RANK"] = str(dist.local_rank)
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> int:
    import submitit

    folder, script, args = argv[0], argv[1], argv[2:]
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
    executor.update_parameters(nodes=2, ntasks_per_node=1, time=20,
                               additional_parameters={"requeue": True})
    job = executor.submit(train, script, args)
    print(job.job_id, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
