"""The training world in the environment: what a script sees describes the training step.

A `bv submit` job's allocation holds the training nodes and its spares; srun's environment
(`SLURM_JOB_NUM_NODES`, `SLURM_NTASKS`, ...) describes that allocation, or the agents' step
(one task per node). Frameworks and tools read these names as "the training job": Lightning's
SLURM docs set ``num_nodes`` from ``SLURM_JOB_NUM_NODES`` (with a spare, that count is wrong and
the Trainer refuses to start), submitit and NVIDIA's launcher read ``SLURM_NTASKS``/
``SLURM_PROCID``. So the node agent hands torchrun (and through it the training processes, never
srun) an environment that describes the step it launches: `training_env()`. The per-rank names
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``) are only known inside each rank, from
torchrun's ``RANK``/``LOCAL_RANK``/``GROUP_RANK``: `rank_env()` (bluevela.integrations.boot
applies it when the rank starts). docs/byos.md lists every variable.

Standard library only: the agent runs it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

# Set by the supervisor per step (bluevela/launch/supervisor.py run_step).
STEP_NODELIST_ENV = "BV_STEP_NODELIST"
STEP_NUM_NODES_ENV = "BV_STEP_NUM_NODES"
# What the allocation was, for whoever needs it (the spare included).
ALLOC_NODELIST_ENV = "BV_ALLOC_NODELIST"
ALLOC_NUM_NODES_ENV = "BV_ALLOC_NUM_NODES"
# The marker that arms bv's framework integrations in the training processes: set by the agent,
# "0" in the job's own environment (bv submit --env BV_INTEGRATIONS=0) turns them off.
INTEGRATIONS_ENV = "BV_INTEGRATIONS"
# Per-rank names: srun's values are the agent's task (one per node), wrong for a rank.
PER_RANK = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID", "SLURM_GTIDS")
_NPROC = re.compile(r"^--nproc[-_]per[-_]node(?:=(.*))?$")


def nproc_from_argv(argv: Sequence[str]) -> int | None:
    """torchrun's `--nproc-per-node` when it is a number (not `gpu`/`auto`), else None."""
    for i, word in enumerate(argv):
        m = _NPROC.match(word)
        if m is None:
            continue
        value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
        return int(value) if value.isdigit() and int(value) > 0 else None
    return None


def tasks_per_node(count: int, nodes: int) -> str:
    """Slurm's compressed form: `4(x2)` for 4 on each of 2 nodes, `4` for one node."""
    return str(count) if nodes == 1 else f"{count}(x{nodes})"


def boot_dir() -> Path:
    """The directory whose `sitecustomize.py` starts bv's integrations in each rank."""
    return Path(__file__).resolve().parent.parent / "integrations" / "_boot"


def training_env(environ: Mapping[str, str], torchrun_argv: Sequence[str]) -> dict[str, str]:
    """The environment torchrun (and so every rank) gets: `environ` (the agent's, srun's step)
    with the Slurm names describing the training step, Lightning's Trainer defaults, and bv's
    integrations armed. srun's own environment is never changed."""
    env = dict(environ)
    nodelist = (environ.get(STEP_NODELIST_ENV) or environ.get("SLURM_STEP_NODELIST")
                or environ.get("SLURM_NODELIST") or "")
    raw = environ.get(STEP_NUM_NODES_ENV) or environ.get("SLURM_STEP_NUM_NODES") or ""
    nodes = int(raw) if raw.isdigit() and int(raw) > 0 else None
    if "SLURM_JOB_NODELIST" in environ:
        env[ALLOC_NODELIST_ENV] = environ["SLURM_JOB_NODELIST"]
    if "SLURM_JOB_NUM_NODES" in environ:
        env[ALLOC_NUM_NODES_ENV] = environ["SLURM_JOB_NUM_NODES"]
    if nodelist:
        for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"):
            env[name] = nodelist
    nproc = nproc_from_argv(torchrun_argv)
    if nodes is not None:
        for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_NUM_NODES"):
            env[name] = str(nodes)
        env.setdefault("PL_TRAINER_NUM_NODES", str(nodes))
    if nodes is not None and nproc is not None:
        for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS"):
            env[name] = str(nodes * nproc)
        env["SLURM_NTASKS_PER_NODE"] = str(nproc)
        for name in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
            env[name] = tasks_per_node(nproc, nodes)
        env.setdefault("PL_TRAINER_DEVICES", str(nproc))
    else:  # each rank sets them from torchrun's counts (rank_env)
        for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_TASKS",
                     "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                     "SLURM_STEP_TASKS_PER_NODE"):
            env.pop(name, None)
    for name in PER_RANK:
        env.pop(name, None)
    if environ.get(INTEGRATIONS_ENV) != "0":
        env[INTEGRATIONS_ENV] = "1"
        boot = str(boot_dir())
        old = environ.get("PYTHONPATH", "")
        env["PYTHONPATH"] = boot + (os.pathsep + old if old else "")
    return env


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The per-rank names, from torchrun's: `SLURM_PROCID` is the global rank (what Lightning's
    SLURMEnvironment, submitit and NVIDIA's launcher take it for), `SLURM_LOCALID` the local
    rank, `SLURM_NODEID` torchrun's node rank (GROUP_RANK); the counts from WORLD_SIZE and
    LOCAL_WORLD_SIZE. Empty outside a torchrun rank."""
    names = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    values = {n: environ.get(n, "") for n in names}
    if not all(v.isdigit() for v in values.values()) or int(values["LOCAL_WORLD_SIZE"]) < 1:
        return {}
    world, local = int(values["WORLD_SIZE"]), int(values["LOCAL_WORLD_SIZE"])
    nodes = max(1, world // local)
    out = {"SLURM_PROCID": values["RANK"], "SLURM_LOCALID": values["LOCAL_RANK"],
           "SLURM_NODEID": values["GROUP_RANK"], "SLURM_NTASKS": str(world),
           "SLURM_NPROCS": str(world), "SLURM_STEP_NUM_TASKS": str(world),
           "SLURM_NTASKS_PER_NODE": str(local),
           "SLURM_TASKS_PER_NODE": tasks_per_node(local, nodes),
           "SLURM_STEP_TASKS_PER_NODE": tasks_per_node(local, nodes)}
    if "PL_TRAINER_DEVICES" not in environ:
        out["PL_TRAINER_DEVICES"] = str(local)
    return out
