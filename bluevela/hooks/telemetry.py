"""Per-job telemetry: the prolog keeps its readings, the epilog reports the differences.

The prolog stores the metrics of its checks in `<state>/jobs/<job_id>.json`; the epilog
subtracts them from its own (`telemetry` of the epilog report). On a node grown into the job
(no prolog of the job there) the baseline is the helper job's epilog, when the node joined
(health/state.py `take_over`). Names carry units:

    job_wall_s                                     prolog to epilog
    gpu_energy_j                                   NVML total energy, all GPUs
    gpu_temp_max_c                                 highest GPU temperature seen at prolog or epilog
                                                   (two readings, not a maximum over the job)
    gpu_ecc_uncorrected_volatile_increase_count    and the other GPU error counts below
    gpu_xid_new_count                              XIDs logged during the job
    ib_<counter>_increase_count                    every IB error/wait counter, summed over ports
    ib_port_xmit_data_bytes, ib_port_rcv_data_bytes
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from bluevela.health.result import HealthReport

logger = logging.getLogger(__name__)

GPU_COUNTS = {
    "ecc_uncorrected_volatile_total": "gpu_ecc_uncorrected_volatile_increase_count",
    "ecc_uncorrected_aggregate_total": "gpu_ecc_uncorrected_aggregate_increase_count",
    "remapped_rows_uncorrectable_total": "gpu_remapped_rows_uncorrectable_increase_count",
    "remapped_rows_correctable_total": "gpu_remapped_rows_correctable_increase_count",
    "remapped_rows_pending_count": "gpu_remapped_rows_pending_increase_count",
    "retired_pages_total": "gpu_retired_pages_increase_count",
    "xid_count": "gpu_xid_new_count",
}


def reading_of(report: HealthReport, now: float) -> dict[str, Any]:
    """What the prolog keeps for the epilog."""
    return {"time": now, "metrics": {r.name: dict(r.metrics) for r in report.checks}}


def _delta(after: float, before: float) -> float:
    """A counter's increase; one that went down was reset, so its value is the increase."""
    return after - before if after >= before else after


def job_telemetry(reading: Mapping[str, Any] | None, report: HealthReport,
                  now: float) -> dict[str, float]:
    """Per-job deltas between the prolog's `reading` and the epilog's `report`."""
    if not reading or not isinstance(reading.get("metrics"), dict):
        return {}
    before: dict[str, dict[str, float]] = reading["metrics"]
    after = {r.name: r.metrics for r in report.checks}
    out: dict[str, float] = {}
    t0 = reading.get("time")
    if isinstance(t0, int | float):
        out["job_wall_s"] = max(0.0, now - float(t0))
    gb, ga = before.get("gpu") or {}, after.get("gpu") or {}
    if "energy_j" in gb and "energy_j" in ga and ga["energy_j"] >= gb["energy_j"]:
        out["gpu_energy_j"] = ga["energy_j"] - gb["energy_j"]
    temps = [m["temp_max_c"] for m in (gb, ga) if "temp_max_c" in m]
    if temps:
        out["gpu_temp_max_c"] = max(temps)
    for src, dst in GPU_COUNTS.items():
        if src in gb and src in ga:
            out[dst] = _delta(ga[src], gb[src])
    ib_b, ib_a = before.get("ib") or {}, after.get("ib") or {}
    for name, value in ib_a.items():
        if name not in ib_b or "packets" in name:  # packet counts add nothing to the bytes
            continue
        if name.endswith("_total"):
            out[f"ib_{name.removesuffix('_total')}_increase_count"] = _delta(value, ib_b[name])
        elif name.endswith("_bytes"):
            out[f"ib_{name}"] = _delta(value, ib_b[name])
    return out
