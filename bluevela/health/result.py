"""Check results: Nagios statuses, a frozen `CheckResult`, and a run's `HealthReport`.

"Worst" is explicit: by severity OK < WARNING < UNKNOWN < CRITICAL. This is the Nagios
convention for a host verdict: a CRITICAL outranks an UNKNOWN (a check that could not run
says nothing about the node, a CRITICAL says the node is broken). The exit code of a run is
the numeric value of its worst status (so CRITICAL+UNKNOWN exits 2, UNKNOWN alone 3).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

logger = logging.getLogger(__name__)


class Status(IntEnum):
    """Nagios plugin statuses; the value is the exit code."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    UNKNOWN = 3

    @property
    def severity(self) -> int:
        """Rank for worst-wins: OK 0 < WARNING 1 < UNKNOWN 2 < CRITICAL 3."""
        return _SEVERITY[self]

    @classmethod
    def parse(cls, value: str | int) -> Status:
        """A Status from its name ("critical") or its value (2)."""
        if isinstance(value, int):
            return cls(value)
        return cls[value.strip().upper()]


_SEVERITY = {Status.OK: 0, Status.WARNING: 1, Status.UNKNOWN: 2, Status.CRITICAL: 3}


def worst(statuses: Iterable[Status]) -> Status:
    """The worst of `statuses` by severity (CRITICAL > UNKNOWN > WARNING > OK); OK when empty."""
    result = Status.OK
    for status in statuses:
        if status.severity > result.severity:
            result = status
    return result


def summarize(problems: Sequence[tuple[Status, str]]) -> tuple[Status, str | None]:
    """The worst status of `problems` and a one-line summary of the problems at that status
    (`"a; b (+2 lesser)"`); (OK, None) when there are none."""
    status = worst(s for s, _ in problems)
    if not problems:
        return status, None
    ordered = [text for s, text in problems if s is status]
    rest = len(problems) - len(ordered)
    return status, "; ".join(ordered) + (f" (+{rest} lesser)" if rest else "")


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep finite numbers only (bools become 0/1); names must be plain identifiers."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key.replace("_", "a").isalnum():
            logger.debug("dropping metric with odd name %r", key)
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
    return out


def _clean_components(parts: Any) -> tuple[dict[str, Any], ...]:
    """Per-component readings: `{"kind": "gpu", "labels": {...}, "values": {...}}` each,
    labels as strings, values cleaned like metrics; malformed entries are dropped."""
    out: list[dict[str, Any]] = []
    for part in parts or ():
        if not isinstance(part, Mapping) or not isinstance(part.get("kind"), str):
            continue
        labels = part.get("labels") or {}
        values = part.get("values") or {}
        if not isinstance(labels, Mapping) or not isinstance(values, Mapping):
            continue
        out.append({"kind": part["kind"],
                    "labels": {str(k): str(v) for k, v in labels.items() if v is not None},
                    "values": _clean_metrics(values)})
    return tuple(out)


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict.

    Attributes:
        name: the registered check name (`gpu`, `ib`, ...).
        status: the Nagios status.
        summary: one line; for a failure it names the part and the fact,
            e.g. `mlx5_3/1 state DOWN`. It becomes the drain reason `bv: <name>: <summary>`.
        metrics: numbers with their unit in the name (`temp_max_c`, `busbw_gbs`, `energy_j`).
        duration_s: wall time of the check, probe included.
        components: per-component readings (one per GPU, per IB port), each
            `{"kind", "labels", "values"}`; bluevela.health.metrics turns them into labelled series.
        info: observed facts that are text, not numbers (`{"driver": "550.90.07"}`): kept in
            the spool report and last_results.json, a Prometheus info series.
    """

    name: str
    status: Status
    summary: str
    metrics: Mapping[str, float] = field(default_factory=dict)
    duration_s: float = 0.0
    components: tuple[dict[str, Any], ...] = ()
    info: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "summary", " ".join(str(self.summary).split()))
        object.__setattr__(self, "metrics", _clean_metrics(self.metrics))
        object.__setattr__(self, "components", _clean_components(self.components))
        object.__setattr__(self, "info", {str(k): str(v) for k, v in (self.info or {}).items()
                                          if v is not None})

    def with_duration(self, duration_s: float) -> CheckResult:
        return CheckResult(self.name, self.status, self.summary, self.metrics, duration_s,
                           self.components, self.info)

    def to_dict(self, components: bool = False) -> dict[str, Any]:
        """The result as JSON; `components` (for last_results.json, the Prometheus series)
        only when asked: the spool report keeps to the node-level metrics."""
        return {
            "name": self.name,
            "status": self.status.name,
            "status_code": int(self.status),
            "summary": self.summary,
            "metrics": dict(self.metrics),
            "duration_s": round(self.duration_s, 6),
            **({"info": dict(self.info)} if self.info else {}),
            **({"components": [dict(c) for c in self.components]}
               if components and self.components else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckResult:
        return cls(
            name=str(data["name"]),
            status=Status.parse(data.get("status_code", data.get("status", "UNKNOWN"))),
            summary=str(data.get("summary", "")),
            metrics=dict(data.get("metrics") or {}),
            duration_s=float(data.get("duration_s") or 0.0),
            components=tuple(data.get("components") or ()),
            info=dict(data.get("info") or {}),
        )


def ok(name: str, summary: str, **metrics: float) -> CheckResult:
    return CheckResult(name, Status.OK, summary, metrics)


def unknown(name: str, summary: str, **metrics: float) -> CheckResult:
    """A check that could not run: never CRITICAL (it says nothing about the node)."""
    return CheckResult(name, Status.UNKNOWN, summary, metrics)


@dataclass(frozen=True)
class HealthReport:
    """The results of one run of several checks."""

    tier: str
    checks: tuple[CheckResult, ...]
    duration_s: float = 0.0
    started_at: float = 0.0  # unix seconds

    @property
    def status(self) -> Status:
        return worst(c.status for c in self.checks)

    @property
    def exit_code(self) -> int:
        return int(self.status)

    def result(self, name: str) -> CheckResult | None:
        return next((c for c in self.checks if c.name == name), None)

    def failures(self, status: Status = Status.CRITICAL) -> list[CheckResult]:
        return [c for c in self.checks if c.status is status]

    def drain_detail(self) -> str | None:
        """`<check>: <summary>` of every CRITICAL check joined by '; ', or None when none."""
        bad = self.failures(Status.CRITICAL)
        if not bad:
            return None
        return "; ".join(f"{c.name}: {c.summary}" for c in bad)

    def to_dict(self) -> dict[str, Any]:
        """The `health` object of a spool report (see bluevela.archive.spool)."""
        status = self.status
        return {
            "status": status.name,
            "status_code": int(status),
            "tier": self.tier,
            "duration_s": round(self.duration_s, 6),
            "checks": [c.to_dict() for c in self.checks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HealthReport:
        return cls(
            tier=str(data.get("tier", "")),
            checks=tuple(CheckResult.from_dict(c) for c in data.get("checks", [])),
            duration_s=float(data.get("duration_s") or 0.0),
            started_at=float(data.get("started_at") or 0.0),
        )


def duration_text(seconds: float) -> str:
    """'45 s', '40 min', '5.2 h', '12 d': a span as a drain reason or log line names it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} d"
