"""Where probes read from: the roots that tests (and the dev cluster) point at recorded fixtures.

- `BV_SYSFS_ROOT` (default `/`): a directory that stands for `/`. The ib probe reads
  `<root>/sys/class/infiniband/...`; the node probe reads `<root>/proc/meminfo`,
  `<root>/proc/mounts`, and checks required paths and devices under `<root>`.
- `BV_NVML_SNAPSHOT`: a JSON file (format in docs/health.md and `bluevela.health.nvml`)
  replayed instead of live NVML.
- `BV_KMSG`: a text file of kernel log lines (dmesg) searched for NVIDIA XIDs instead of
  `/dev/kmsg`. With a snapshot, the snapshot's own `kmsg` lines are used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluevela.site import NodeClass

logger = logging.getLogger(__name__)

PHASES = ("manual", "prolog", "epilog", "healthcheck")


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
    """

    node_class: NodeClass
    class_name: str
    root: Path = Path("/")
    nvml_snapshot: Path | None = None
    kmsg: Path | None = None
    state_dir: Path | None = None
    phase: str = "manual"

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
        """Roots from `BV_SYSFS_ROOT`, `BV_NVML_SNAPSHOT`, `BV_KMSG` (empty means unset)."""
        env = os.environ if env is None else env
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        root = Path(env.get("BV_SYSFS_ROOT") or "/")
        snap = env.get("BV_NVML_SNAPSHOT") or None
        kmsg = env.get("BV_KMSG") or None
        return cls(
            node_class=node_class,
            class_name=class_name,
            root=root,
            nvml_snapshot=Path(snap) if snap else None,
            kmsg=Path(kmsg) if kmsg else None,
            state_dir=state_dir,
            phase=phase,
        )
