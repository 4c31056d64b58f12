"""Issue 11's GPU parts of the health fixtures (called by make_fixtures.py).

`extend(nvml)` adds the NVML fields the gpu check reads since issue 11 (VBIOS, NVLink state
and error counters, GpuFabricInfo, ECC by location, the row remapper histogram, the
violation counters, application clocks) to the healthy H100 snapshot, where they are absent:
typical values of an idle HGX H100 (SYNTHETIC, not recorded; a real recording that has them
keeps its own). `FAILURES` are the healthy node with ONE change each, all SYNTHETIC
(tests/data/README.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

NVLINKS = 18  # NVLink 4 links of an H100 SXM GPU
COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")
# 2026-01-15T09:00:00Z (the healthy snapshot's recorded_at) in µs: NVML's referenceTime.
REFERENCE_US = 1_768_467_600_000_000
STORED_TIME = 1_768_467_000.0  # a stored reading 10 min before (state/gpu_counters.json)
TEN_MIN_NS = 600 * 10**9


def _violations(i: int) -> dict[str, dict[str, int]]:
    # Cumulative ns since the driver loaded (~1 day idle): low utilization dominates.
    base = {"power": 0, "thermal": 0, "sync_boost": 0, "board_limit": 0,
            "low_utilization": 81_234_567_890_123 + i * 1_000_003, "reliability": 0,
            "total_app_clocks": 0, "total_base_clocks": 0}
    return {k: {"reference_us": REFERENCE_US + i * 211, "violation_ns": v} for k, v in base.items()}


def healthy_fields(i: int) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "vbios_version": "96.00.74.00.0D",
        "nvlink_state": [True] * NVLINKS,
        "nvlink_errors": [dict.fromkeys(COUNTERS, 0) for _ in range(NVLINKS)],
        "fabric_state": 3,  # NVML_GPU_FABRIC_STATE_COMPLETED
        "fabric_status": 0,  # NVML_SUCCESS
        "row_remap_histogram": {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0},
        "clocks_violation": _violations(i),
        "app_clock_sm_mhz": 1980,
        "app_clock_mem_mhz": 2619,
    }
    for loc in ("sram", "dram"):
        for kind in ("uncorrected", "corrected"):
            for counter in ("volatile", "aggregate"):
                fields[f"ecc_{loc}_{kind}_{counter}"] = 0
    return fields


def extend(nvml: dict[str, Any]) -> None:
    """Add the issue-11 fields where the snapshot lacks them (idempotent)."""
    for i, g in enumerate(nvml.get("gpus") or ()):
        if "error" in g:
            continue
        errors = g.pop("errors", None)
        for key, value in healthy_fields(i).items():
            g.setdefault(key, value)
        if errors is not None:
            g["errors"] = errors  # keep `errors` last, as gather_live writes it


Change = Callable[[Path, dict[str, Any], Path], None]


def set_gpu(index: int, **values: Any) -> Change:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["gpus"][index].update(values)

    return change


def nvlink(index: int, link: int, up: bool | None = None, **counters: int) -> Change:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        g = nvml["gpus"][index]
        if up is not None:
            g["nvlink_state"][link] = up
        g["nvlink_errors"][link].update(counters)

    return change


def stored(index: int, *, nvlink_errors: dict[int, dict[str, int]] | None = None,
           violation_ns: dict[str, int] | None = None) -> Change:
    """state/gpu_counters.json: every GPU's reading 10 min before, with GPU `index`'s NVLink
    counters / violation counters as given."""

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        gpus = {}
        for i, g in enumerate(nvml["gpus"]):
            errs = [dict(e) for e in g["nvlink_errors"]]
            viol = {k: {"reference_us": v["reference_us"] - 600 * 10**6,
                        "violation_ns": v["violation_ns"]} for k, v in g["clocks_violation"].items()}
            if i == index:
                for link, values in (nvlink_errors or {}).items():
                    errs[link].update(values)
                for name, ns in (violation_ns or {}).items():
                    viol[name]["violation_ns"] = ns
            gpus[g["uuid"]] = {"nvlink_errors": errs, "clocks_violation": viol}
        state.mkdir(parents=True, exist_ok=True)
        (state / "gpu_counters.json").write_text(
            json.dumps({"time": STORED_TIME, "gpus": gpus}, indent=1, sort_keys=True) + "\n")

    return change


def throttled(index: int, name: str, share: float) -> list[Change]:
    """GPU `index` throttled by `name` for `share` of the 10 min since the stored reading."""
    now = 5_000_000_000_000 + int(share * TEN_MIN_NS)

    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["gpus"][index]["clocks_violation"][name]["violation_ns"] = now

    return [change, stored(index, violation_ns={name: 5_000_000_000_000})]


def kmsg(*lines: str) -> Change:
    def change(root: Path, nvml: dict[str, Any], state: Path) -> None:
        nvml["kmsg"] = [*nvml["kmsg"], *lines]

    return change


SXID_FATAL = ("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, Fatal, Link 30 sourcetrack "
              "timeout error (First)")
SXID_NONFATAL = ("nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 28 RX "
                 "Short Error Rate")

FAILURES: dict[str, tuple[str, list[Change]]] = {
    "h100-gpu-nvlink-down": ("GPU3 (5D:00) NVLink 7 down (nvmlDeviceGetNvLinkState 0)",
                             [nvlink(3, 7, up=False)]),
    "h100-gpu-nvlink-recovery-rising": (
        "GPU2 NVLink 5 recovery 0 -> 4 and replay 12 -> 2051 since the stored reading 10 min "
        "before", [nvlink(2, 5, recovery=4, replay=2051),
                   stored(2, nvlink_errors={5: {"recovery": 0, "replay": 12}})]),
    "h100-gpu-fabric-in-progress": ("GPU0 GpuFabricInfo state IN_PROGRESS (Fabric Manager has "
                                    "not finished registering it)",
                                    [set_gpu(0, fabric_state=2, fabric_status=0)]),
    "h100-gpu-sram-uncorrectable": ("GPU6 1 SRAM uncorrectable ECC error (volatile and "
                                    "aggregate; the total uncorrected counts include it)",
                                    [set_gpu(6, ecc_sram_uncorrected_volatile=1,
                                             ecc_sram_uncorrected_aggregate=1,
                                             ecc_uncorrected_volatile=1,
                                             ecc_uncorrected_aggregate=1)]),
    "h100-gpu-dram-corrected-high": ("GPU1 4211 DRAM corrected ECC errors since the driver "
                                     "loaded (over the class's 1000)",
                                     [set_gpu(1, ecc_dram_corrected_volatile=4211,
                                              ecc_dram_corrected_aggregate=5310)]),
    "h100-gpu-row-remap-low-spares": ("GPU4 row remapper histogram: 2 banks low, 1 bank with no "
                                      "spare rows left",
                                      [set_gpu(4, row_remap_histogram={
                                          "max": 2548, "high": 6, "partial": 3, "low": 2,
                                          "none": 1})]),
    "h100-gpu-thermal-throttled": ("GPU5 thermal violation counter +180 s in the 10 min since "
                                   "the stored reading (30%)", throttled(5, "thermal", 0.30)),
    "h100-gpu-power-limit-lowered": ("GPU7 enforced power limit 500 W (class 700 W)",
                                     [set_gpu(7, power_limit_w=500.0)]),
    "h100-gpu-app-clock-low": ("GPU1 application SM clock 1410 MHz (class 1980 MHz)",
                               [set_gpu(1, app_clock_sm_mhz=1410)]),
    "h100-gpu-sxid-fatal": ("NVSwitch SXid 24007 Fatal (sourcetrack timeout) in the kernel log",
                            [kmsg(SXID_FATAL)]),
    "h100-gpu-sxid-nonfatal": ("NVSwitch SXid 20009 Non-fatal (RX short error rate) in the "
                               "kernel log", [kmsg(SXID_NONFATAL)]),
}
