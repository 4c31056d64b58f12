"""Where the gpu check and the telemetry sampler read NVML from: the live node or a recording.

An `NVMLSource` gives one parsed snapshot (`nvml_snapshot.NVMLSnapshot`): `LiveNVML` records
this node's NVML now (`nvml_live`), `ReplayNVML` reads a recorded snapshot file, failures
included (a recorded hang blocks as the real call would, so the caller's timeout meets it).
Tests and the dev cluster point `BV_NVML_SNAPSHOT` at a recording instead of a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bluevela.health.nvml_live import gather_live, sample_live
from bluevela.health.nvml_snapshot import NVMLSnapshot, load_snapshot, parse_snapshot

logger = logging.getLogger(__name__)


class NVMLSource(Protocol):
    """Gives one NVML snapshot: the live node, or a recorded file (tests, the dev cluster)."""

    def read(self) -> NVMLSnapshot:
        """The snapshot; NVML that failed to start is its `init_error`, not an exception.

        Raises:
            NVMLMissingError: pynvml is not installed. OSError, ValueError: a snapshot file
                that cannot be read or parsed.
        """
        ...


@dataclass(frozen=True)
class LiveNVML:
    """This node's NVML through pynvml (`nvml_live.gather_live`)."""

    include_kmsg: bool = True
    recheck_s: float = 0.0
    process_gpus: tuple[int, ...] | None = None

    def read(self) -> NVMLSnapshot:
        data = gather_live(include_kmsg=self.include_kmsg, recheck_s=self.recheck_s,
                           raise_init_error=False, process_gpus=self.process_gpus)
        return parse_snapshot(data, "live NVML")

    def sample(self) -> tuple[NVMLSnapshot, dict[int, dict[str, float]]]:
        """One telemetry sample in one NVML session (one nvmlInit, one nvmlShutdown): the
        snapshot, without kernel log or second reading whatever this source's settings, and
        {GPU index: {"util_pct": %, "sm_clock_mhz": MHz}} (`nvml_live.sample_live`).

        For the sampler, in place of `read()` followed by a second session for utilisation
        and clocks: NVML starts once per sample instead of twice.

        Raises:
            NVMLMissingError: pynvml is not installed.
        """
        data, activity = sample_live()
        return parse_snapshot(data, "live NVML"), activity


@dataclass(frozen=True)
class ReplayNVML:
    """A recorded snapshot, failures included: a recorded `hang` blocks like the real call."""

    path: Path

    def read(self) -> NVMLSnapshot:
        snap = load_snapshot(self.path)
        if snap.hang is not None:
            where = snap.hang.get("call", "?")
            if snap.hang.get("gpu") is not None:
                where = f"{where} on GPU{snap.hang['gpu']}"
            logger.warning("replaying a hung NVML call (%s) from %s", where, self.path)
            while True:  # only the caller's timeout (a SIGKILL) ends this, as in the driver
                time.sleep(3600)
        return snap
