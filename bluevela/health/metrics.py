"""The last result of each check as Prometheus text, for node_exporter's textfile collector.

`<metrics dir>/bluevela.prom` is rewritten atomically (temp file, fsync, rename) after every
hook run, from `last_results.json` in the state dir, so a check that the last run did not
include (nccl after a quick prolog) keeps its last value. Families::

    bluevela_check_status{check="ib"} 0          # 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN
    bluevela_check_timestamp_seconds{check="ib"} 1.7e9
    bluevela_check_duration_seconds{check="ib"} 0.004
    bluevela_ib_symbol_error_total 0              # each metric, units in its name
    bluevela_node_status 0                         # worst over the checks
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bluevela.errors import UnsafeValueError
from bluevela.health.result import CheckResult, HealthReport, Status, worst
from bluevela.health.state import LAST_RESULTS, read_json, write_json
from bluevela.util.fs import atomic_write, ensure_dir

logger = logging.getLogger(__name__)

PROM_FILE = "bluevela.prom"
_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _name(text: str) -> str:
    return _BAD.sub("_", text)


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def merge_last_results(state_dir: Path, report: HealthReport, phase: str) -> dict[str, Any]:
    """Merge `report`'s results into `last_results.json`; return the merged mapping."""
    stored = read_json(state_dir / LAST_RESULTS)
    merged: dict[str, Any] = stored if isinstance(stored, dict) else {}
    now = time.time()
    for r in report.checks:
        merged[r.name] = {**r.to_dict(), "time": now, "phase": phase}
    write_json(state_dir / LAST_RESULTS, merged)
    return merged


def render(last: Mapping[str, Mapping[str, Any]]) -> str:
    """Prometheus text exposition of the last results."""
    results: list[tuple[CheckResult, float]] = []
    for name in sorted(last):
        try:
            results.append((CheckResult.from_dict(last[name]), float(last[name].get("time", 0))))
        except (KeyError, ValueError, TypeError):
            logger.debug("skipping malformed last result %r", name)
    lines: list[str] = []

    def family(name: str, help_: str, samples: list[tuple[str, float]]) -> None:
        if not samples:
            return
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

    family("bluevela_check_status",
           "Last status of each bluevela health check (0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN).",
           [(f'{{check="{_label(r.name)}"}}', int(r.status)) for r, _ in results])
    family("bluevela_check_timestamp_seconds", "When each check last ran (unix seconds).",
           [(f'{{check="{_label(r.name)}"}}', t) for r, t in results])
    family("bluevela_check_duration_seconds", "Wall time of each check's last run.",
           [(f'{{check="{_label(r.name)}"}}', r.duration_s) for r, _ in results])
    family("bluevela_node_status", "Worst status over the last result of every check.",
           [("", int(worst(r.status for r, _ in results)) if results else int(Status.UNKNOWN))])
    for r, _ in results:
        for metric in sorted(r.metrics):
            family(f"bluevela_{_name(r.name)}_{_name(metric)}",
                   f"bluevela {r.name} check: {metric}.", [("", r.metrics[metric])])
    return "\n".join(lines) + "\n"


def write_prom(metrics_dir: Path, last: Mapping[str, Mapping[str, Any]]) -> Path | None:
    """Write `<metrics_dir>/bluevela.prom` atomically; None (logged) when it cannot."""
    path = metrics_dir / PROM_FILE
    try:
        ensure_dir(metrics_dir, 0o755)
        atomic_write(path, render(last).encode(), 0o644)
    except (OSError, UnsafeValueError) as exc:
        logger.warning("cannot write %s: %s", path, exc)
        return None
    return path
