"""Records of the benchmarks: a measured `Figure`, what one measurement gathered (`Facts`), and
its judged `BenchResult` with the health checks' Nagios-valued `Status` (same severity order:
a CRITICAL outranks an UNKNOWN).

These are plain data, JSON round-trippable, so a batch job's output file, the HDF5 nightly record
and the recorded test fixtures all carry the same shapes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bluevela.health.result import Status, worst

logger = logging.getLogger(__name__)

__all__ = ["NODE", "BenchResult", "Facts", "Figure", "FigureVerdict", "Status", "worst"]

#: `Figure.device` of a node-level figure (the minimum over GPUs, or the CPU's own figure).
NODE = -1


@dataclass(frozen=True)
class Figure:
    """One measured number, its unit in both the name and `unit`.

    Args:
        name: e.g. `gemm_tflops`, `pair_busbw_gbs`; the headline names match the
            `BenchThresholds` field they are judged by.
        value: the number.
        unit: e.g. `TFLOP/s`, `GB/s` (GB = 1e9 B), `us`.
        device: GPU index, or `NODE` (-1) for the node-level figure.
        size: the sweep point (bytes, or matrix order for gemm); 0 for the headline figure.
    """

    name: str
    value: float
    unit: str
    device: int = NODE
    size: int = 0

    @property
    def headline(self) -> bool:
        """The figure the floors apply to: node level, not a sweep point."""
        return self.device == NODE and self.size == 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit,
                "device": self.device, "size": self.size}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Figure:
        return cls(name=str(d["name"]), value=float(d["value"]), unit=str(d["unit"]),
                   device=int(d.get("device", NODE)), size=int(d.get("size", 0)))


@dataclass(frozen=True)
class Facts:
    """What one measurement gathered on one node (or one pair), before any judgement.

    Args:
        measurement: registered name, e.g. `gemm`.
        figures: every figure, headline and sweep points.
        applicable: False where the measurement means nothing here (h2d on a CPU node).
        ran: False when it could not run (the error is in `note`).
        note: free text: backend, world size, why not applicable, the error.
        hosts: the hosts the ranks ran on (pair measurements: both nodes).
    """

    measurement: str
    figures: tuple[Figure, ...] = ()
    applicable: bool = True
    ran: bool = True
    note: str = ""
    hosts: tuple[str, ...] = ()

    def headline(self, name: str) -> float | None:
        """The headline value of figure `name`, or None."""
        for f in self.figures:
            if f.name == name and f.headline:
                return f.value
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"measurement": self.measurement, "figures": [f.to_dict() for f in self.figures],
                "applicable": self.applicable, "ran": self.ran, "note": self.note,
                "hosts": list(self.hosts)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Facts:
        return cls(
            measurement=str(d["measurement"]),
            figures=tuple(Figure.from_dict(f) for f in d.get("figures", ())),
            applicable=bool(d.get("applicable", True)),
            ran=bool(d.get("ran", True)),
            note=str(d.get("note", "")),
            hosts=tuple(str(h) for h in d.get("hosts", ())),
        )

    @classmethod
    def failed(cls, measurement: str, why: str, hosts: Sequence[str] = ()) -> Facts:
        """Facts of a measurement that could not run."""
        return cls(measurement=measurement, ran=False, note=why, hosts=tuple(hosts))


@dataclass(frozen=True)
class FigureVerdict:
    """One headline figure judged: against its floor (or ceiling) and its own history."""

    name: str
    value: float
    unit: str
    status: Status
    limit: float  # the floor (or ceiling); 0 = none
    ceiling: bool  # True: lower is better (latency)
    baseline: float = math.nan  # median of the last nights; NaN without history
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "unit": self.unit,
                "status": self.status.name, "limit": self.limit, "ceiling": self.ceiling,
                "baseline": None if math.isnan(self.baseline) else self.baseline,
                "message": self.message}


@dataclass(frozen=True)
class BenchResult:
    """A measurement's verdict: the worst of its figures' verdicts, with one-line message."""

    measurement: str
    status: Status
    message: str
    verdicts: tuple[FigureVerdict, ...] = ()
    applicable: bool = True
    facts: Facts | None = field(default=None, compare=False)

    @property
    def failed_figures(self) -> list[FigureVerdict]:
        return [v for v in self.verdicts if v.status is Status.CRITICAL]

    def to_dict(self) -> dict[str, Any]:
        return {"measurement": self.measurement, "status": self.status.name,
                "message": self.message, "applicable": self.applicable,
                "verdicts": [v.to_dict() for v in self.verdicts]}
