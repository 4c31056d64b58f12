"""Ranks for the multi-process measurements: joined from the launcher's environment (torchrun,
our own local spawn, or an `srun` step), or spawned here as local processes.

Inside an `srun` step every task gets its rank from SLURM_PROCID, the world from
SLURM_STEP_NUM_TASKS and the rendezvous host from the first node of SLURM_STEP_NODELIST; the port
from BV_BENCH_PORT, which the nightly's batch script draws on that node before the step (`python
-m bluevela.bench.dist`: a port the kernel picks, free there now), as the node agent of `bv
submit` picks the rendezvous port. A port derived from the public job id (until issue 33) could
be bound first by anyone on the node: rank 0 then failed, and the other ranks joined the squatter.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bluevela.bench.result import Facts
from bluevela.errors import BenchError

logger = logging.getLogger(__name__)

PORT_BASE = 29600  # MASTER_PORT of a launcher that gives none
PORT_ENV = "BV_BENCH_PORT"  # an srun step's rendezvous port, drawn by its batch script


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in a process group."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


def from_environment(env: Mapping[str, str] | None = None) -> RankEnv | None:
    """The rank set up by a launcher, or None when this process is alone.

    torchrun's (or our spawn's) RANK/WORLD_SIZE/MASTER_ADDR win; else an srun step of more than
    one task. A batch script's own environment (no step) is "alone".

    Raises:
        BenchError: an srun step without its rendezvous port (BV_BENCH_PORT).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       env["MASTER_ADDR"], int(env.get("MASTER_PORT", str(PORT_BASE))))
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or "0")
    if ntasks > 1 and "SLURM_PROCID" in env and env.get("SLURM_STEP_NODELIST"):
        import hostlist

        head = hostlist.expand_hostlist(env["SLURM_STEP_NODELIST"])[0]
        raw = env.get(PORT_ENV, "")
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            raise BenchError(f"no rendezvous port for this srun step ({PORT_ENV}={raw!r}): the "
                             "nightly's batch script draws one on the step's first node")
        port = int(raw)
        return RankEnv(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID") or "0"),
                       head, port)
    return None


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher numbered it (0 when alone): who prints results."""
    env = os.environ if env is None else env
    for key in ("RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, the kernel's pick (a random one of its ephemeral
    range: nothing about the job predicts it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def spawn_local(nprocs: int, worker_args: Sequence[str], measurement: str, *,
                timeout_s: float = 900.0) -> Facts:
    """Run `python -m bluevela.bench.worker WORKER_ARGS` as `nprocs` local ranks.

    Rank 0 writes its Facts as JSON to a temporary file, read back here. A rank that fails or
    outlives `timeout_s` makes the measurement "could not run" (the others are killed).
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bv-bench-") as tmp:
        out = Path(tmp) / "rank0.json"
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        for rank in range(nprocs):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nprocs),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            argv = [sys.executable, "-m", "bluevela.bench.worker", *worker_args]
            if rank == 0:
                argv += ["--out", str(out)]
            log = open(Path(tmp) / f"rank{rank}.err", "wb")  # closed in the finally below
            logs.append(log)
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + timeout_s
        failed: str | None = None
        try:
            for rank, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed = f"rank {rank} still running after {timeout_s:.0f} s"
                    break
                if code != 0:
                    failed = f"rank {rank} exited {code}"
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
        if failed:
            err = (Path(tmp) / "rank0.err").read_text(errors="replace").strip().splitlines()
            tail = " | ".join(err[-3:])
            return Facts.failed(measurement, f"{failed}: {tail}" if tail else failed,
                                hosts=(socket.gethostname(),))
        try:
            return Facts.from_dict(json.loads(out.read_text()))
        except (OSError, ValueError, KeyError) as exc:
            return Facts.failed(measurement, f"rank 0 wrote no result: {exc}")


def main() -> int:
    """`python -m bluevela.bench.dist`: print a port free on every interface of this node, for
    the srun step its batch script starts next (BV_BENCH_PORT)."""
    print(free_port(""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
