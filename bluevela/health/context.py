"""Where probes read from: the roots that tests (and the dev cluster) point at recorded fixtures.

- `BV_SYSFS_ROOT` (default `/`): a directory that stands for `/`. The ib probe reads
  `<root>/sys/class/infiniband/...`; the node probe reads `<root>/proc/meminfo`,
  `<root>/proc/mounts`, and checks required paths and devices under `<root>`.
- `BV_NVML_SNAPSHOT`: a JSON file (format in docs/health.md and `bluevela.health.nvml`)
  replayed instead of live NVML.
- `BV_KMSG`: a text file of kernel log lines (dmesg) searched for NVIDIA XIDs instead of
  `/dev/kmsg`. With a snapshot, the snapshot's own `kmsg` lines are used.

In the prolog and epilog, `SLURM_JOB_GPUS` (the GPU indexes Slurm gave the job on this node;
`CUDA_VISIBLE_DEVICES` when only that is set: Slurm 22.05 gives the prolog both for a job with
GPUs, the same global indexes) narrows the leftover-process check and the prolog's nccl to the
job's own GPUs; `SLURM_JOB_ID` names the hook's own job (`job_id`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

PHASES = ("manual", "prolog", "epilog", "healthcheck")
_GPU_LIST = re.compile(r"^[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,1023}$")


def parse_gpu_list(value: str | None) -> tuple[int, ...] | None:
    """`SLURM_JOB_GPUS` ("0,1,4-5") -> (0, 1, 4, 5); None when unset or not a plain list
    (then every GPU of the node is looked at, as before)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not _GPU_LIST.match(text):
        logger.warning("SLURM_JOB_GPUS %r is not a list of GPU indexes: ignored", text[:64])
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class ProbeContext:
    """Everything a probe may look at besides the hardware itself.

    Attributes:
        node_class: the node class (its thresholds and expectations).
        class_name: its name in site.yaml.
        root: stands for `/` (BV_SYSFS_ROOT).
        nvml_snapshot: replayed instead of live NVML when set (BV_NVML_SNAPSHOT).
        kmsg: kernel log text file searched for XIDs (BV_KMSG); None: `/dev/kmsg` when readable.
        state_dir: where baselines (previous IB counters) are kept; None: no baseline.
        phase: who runs the checks (prolog, epilog, healthcheck, manual).
        job_gpus: the GPU indexes the job was given (SLURM_JOB_GPUS); None: all of them.
        runner_pid: the process running the checks (set by the runner in each check's
            child): processes below it are this run's own, not leftovers.
        job_id: the job of the prolog or epilog running the checks; None otherwise.
    """

    node_class: NodeClass
    class_name: str
    root: Path = Path("/")
    nvml_snapshot: Path | None = None
    kmsg: Path | None = None
    state_dir: Path | None = None
    phase: str = "manual"
    job_gpus: tuple[int, ...] | None = None
    runner_pid: int | None = None
    job_id: int | None = None

    def under_root(self, path: str | os.PathLike[str]) -> Path:
        """`path` (absolute, as on a real node) below the root."""
        rel = os.fspath(path).lstrip("/")
        return self.root / rel if rel else self.root

    @classmethod
    def from_env(
        cls,
        node_class: NodeClass,
        class_name: str,
        *,
        env: Mapping[str, str] | None = None,
        state_dir: Path | None = None,
        phase: str = "manual",
    ) -> ProbeContext:
        """Roots from `BV_SYSFS_ROOT`, `BV_NVML_SNAPSHOT`, `BV_KMSG` (empty means unset), and
        the job's GPUs from `SLURM_JOB_GPUS` in the prolog and epilog."""
        env = os.environ if env is None else env
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        root = Path(env.get("BV_SYSFS_ROOT") or "/")
        snap = env.get("BV_NVML_SNAPSHOT") or None
        kmsg = env.get("BV_KMSG") or None
        in_job = phase in ("prolog", "epilog")
        gpus = env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES")
        raw_job = (env.get("SLURM_JOB_ID") or "").strip()
        return cls(
            node_class=node_class,
            class_name=class_name,
            root=root,
            nvml_snapshot=Path(snap) if snap else None,
            kmsg=Path(kmsg) if kmsg else None,
            state_dir=state_dir,
            phase=phase,
            job_gpus=parse_gpu_list(gpus) if in_job else None,
            job_id=int(raw_job) if in_job and raw_job.isdigit() and len(raw_job) <= 12 else None,
        )
