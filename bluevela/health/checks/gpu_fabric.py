"""The gpu check's issue-11 parts: pure evaluators of NVLink, NVLink fabric, ECC by location,
the row remapper histogram, throttling rates, expected settings and NVSwitch SXids.

Each takes one GPU's NVML values (`GPUInfo`), the class's thresholds (site.yaml `gpu:`) and,
where a rate is judged, the previous reading kept in the node's state dir
(`gpu_counters.json`, written by the gpu probe). A value that is None (an older snapshot, or
NVML that does not support the call on this GPU) is not judged; `not_reported()` names those
the class would have judged, for the check's summary.

Verdicts (docs/health.md, "NVLink, fabric, ECC by location, throttling"):
CRITICAL: an NVLink down, fewer NVLinks than `gpu.nvlinks`, no NVLink state at all in a live
NVML reading of a class with `gpu.nvlinks` (WARNING in a recorded snapshot); on an NVSwitch class
(`gpu.nvswitch`) a GPU whose fabric is not COMPLETED or whose fabric status is not
NVML_SUCCESS; SRAM uncorrectable ECC (volatile) over `gpu.max_sram_uncorrected` (0); a fatal
NVSwitch SXid within `gpu.xid_window_s`.
WARNING: an NVLink error counter risen more than `gpu.nvlink_max_increase` since the last
reading; lifetime (aggregate) SRAM uncorrectable; corrected ECC (volatile) over
`gpu.max_sram_corrected_volatile` / `max_dram_corrected_volatile`; row-remapper banks with
low or no spare rows over `gpu.max_row_remap_low_banks`; a throttle share since the last
reading over `gpu.max_throttle_pct`; an enforced power limit or application clock other than
the class's; a non-fatal SXid in the window.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bluevela.health.kmsg import SXid
from bluevela.health.nvml_fields import FABRIC_COMPLETED, FABRIC_STATES
from bluevela.health.nvml_snapshot import GPUInfo
from bluevela.health.result import Status, duration_text

if TYPE_CHECKING:
    from bluevela.site import GPUThresholds

logger = logging.getLogger(__name__)

GPU_COUNTERS = "gpu_counters.json"  # in the node's state dir
# nvml.h nvmlReturn_t names, for a fabric status that is not NVML_SUCCESS.
NVML_RETURN = {
    0: "SUCCESS", 1: "UNINITIALIZED", 2: "INVALID_ARGUMENT", 3: "NOT_SUPPORTED",
    4: "NO_PERMISSION", 5: "ALREADY_INITIALIZED", 6: "NOT_FOUND", 7: "INSUFFICIENT_SIZE",
    8: "INSUFFICIENT_POWER", 9: "DRIVER_NOT_LOADED", 10: "TIMEOUT", 11: "IRQ_ISSUE",
    12: "LIBRARY_NOT_FOUND", 13: "FUNCTION_NOT_FOUND", 14: "CORRUPTED_INFOROM",
    15: "GPU_IS_LOST", 16: "RESET_REQUIRED", 17: "OPERATING_SYSTEM",
    18: "LIB_RM_VERSION_MISMATCH", 19: "IN_USE", 20: "MEMORY", 21: "NO_DATA",
    22: "VGPU_ECC_NOT_SUPPORTED", 23: "INSUFFICIENT_RESOURCES", 24: "FREQ_NOT_SUPPORTED",
    25: "ARGUMENT_VERSION_MISMATCH", 26: "DEPRECATED", 27: "NOT_READY", 28: "GPU_NOT_FOUND",
    29: "INVALID_STATE", 999: "UNKNOWN",
}
Problem = tuple[Status, str]


@dataclass(frozen=True)
class Baseline:
    """One GPU's previous reading (state dir): NVLink error counters and violation counters."""

    nvlink_errors: tuple[Mapping[str, int] | None, ...] | None = None
    clocks_violation: Mapping[str, tuple[int | None, int]] | None = None
    age_s: float | None = None  # wall-clock time since that reading


def gpu_key(g: GPUInfo) -> str:
    """Which stored reading is this GPU's: its UUID (stable when indexes move), else its bus."""
    return g.uuid or g.pci_bus_id or f"index{g.index}"


def counters_record(g: GPUInfo) -> dict[str, Any]:
    """What the state dir keeps of `g` for the next reading."""
    rec: dict[str, Any] = {}
    if g.nvlink_errors is not None:
        rec["nvlink_errors"] = [dict(e) if e is not None else None for e in g.nvlink_errors]
    if g.clocks_violation is not None:
        rec["clocks_violation"] = {k: {"reference_us": r, "violation_ns": v}
                                   for k, (r, v) in g.clocks_violation.items()}
    return rec


def parse_baseline(raw: Any, age_s: float | None) -> Baseline | None:
    """A stored record (`counters_record`) back; None when it is not one."""
    if not isinstance(raw, dict):
        return None
    from bluevela.health.nvml_snapshot import parse_gpu

    g = parse_gpu({"nvlink_errors": raw.get("nvlink_errors"),
                   "clocks_violation": raw.get("clocks_violation")}, 0)
    return Baseline(g.nvlink_errors, g.clocks_violation, age_s)


def _increase(now: int, before: int) -> int:
    """Counter increase; a counter that went down was reset (driver reload, GPU reset)."""
    return now - before if now >= before else now


def _in(age_s: float | None) -> str:
    return f"in {duration_text(age_s)}" if age_s is not None else "since the last reading"


def interval_s(g: GPUInfo, base: Baseline | None) -> float | None:
    """Time between the previous reading and this one: from NVML's referenceTime (µs) of the
    violation counters when both readings have it, else the stored reading's age."""
    if base is None:
        return None
    now, before = g.clocks_violation or {}, base.clocks_violation or {}
    for name, (ref, _) in now.items():
        ref0 = before[name][0] if name in before else None
        if ref is not None and ref0 is not None and ref > ref0:
            return (ref - ref0) / 1e6
    return base.age_s


def _links(links: list[int], most: int = 6) -> str:
    """'NVLink 7', 'NVLinks 2,7,9', 'NVLinks 0,1,2,3,4,5... (18)': one reason per GPU."""
    if len(links) == 1:
        return f"NVLink {links[0]}"
    shown = ",".join(str(x) for x in links[:most])
    return f"NVLinks {shown}" + (f"... ({len(links)})" if len(links) > most else "")


def nvlink_problems(g: GPUInfo, t: GPUThresholds, base: Baseline | None) -> list[Problem]:
    """Every link up (the first `gpu.nvlinks` must exist); error counters not rising fast."""
    p: list[Problem] = []
    states = g.nvlink_state
    if states is not None and t.nvlinks > 0:
        down = [link for link, up in enumerate(states[:t.nvlinks]) if up is False]
        unread = [link for link, up in enumerate(states[:t.nvlinks]) if up is None]
        if down:
            p.append((Status.CRITICAL, f"{g.where} {_links(down)} down"))
        if unread:
            p.append((Status.CRITICAL, f"{g.where} {_links(unread)} state unreadable"))
        if len(states) < t.nvlinks:
            p.append((Status.CRITICAL, f"{g.where} {len(states)} of {t.nvlinks} NVLinks"))
    errs = g.nvlink_errors
    if errs is not None and base is not None and base.nvlink_errors is not None:
        for link, (now, before) in enumerate(zip(errs, base.nvlink_errors, strict=False)):
            if now is None or before is None:
                continue
            for name, allowed in t.nvlink_max_increase.items():
                if name in now and name in before:
                    inc = _increase(now[name], before[name])
                    if inc > allowed:
                        p.append((Status.WARNING, f"{g.where} NVLink {link} {name} +{inc} "
                                  f"{_in(interval_s(g, base))} (allowed +{allowed})"))
    return p


def nvlink_unreported_problems(gpus: Sequence[GPUInfo], t: GPUThresholds, live: bool
                               ) -> list[Problem]:
    """A class that declares `gpu.nvlinks` and GPUs whose NVML reading has no NVLink state at
    all. Live, NVML answered every other call: the GPU has no NVLink to report (a PCIe card
    in an SXM class) or the NVLink calls fail (a broken fabric): CRITICAL. In a recorded
    snapshot it may only be older than the field: WARNING."""
    if t.nvlinks <= 0:
        return []
    silent = [g for g in gpus if g.nvlink_state is None]
    if not silent:
        return []
    which = ("every GPU" if len(silent) == len(gpus) and len(gpus) > 1
             else "GPU " + ",".join(str(g.index) for g in silent))
    if live:
        return [(Status.CRITICAL, f"NVLink state not reported by NVML on {which} (class has "
                 f"{t.nvlinks} NVLinks per GPU): a PCIe card in an SXM class, or a broken "
                 "NVLink fabric")]
    return [(Status.WARNING, f"NVLink state not in the recorded snapshot for {which} (class has "
             f"{t.nvlinks} NVLinks per GPU): an older recording, or no NVLink")]


def fabric_problems(g: GPUInfo, t: GPUThresholds) -> list[Problem]:
    """On an NVSwitch class the GPU's fabric registration is COMPLETED with NVML_SUCCESS (else
    CUDA cannot use NVLink: Fabric Manager down, or an NVSwitch/NVLink fault)."""
    if not t.nvswitch or g.fabric_state is None:
        return []
    state = FABRIC_STATES.get(g.fabric_state, str(g.fabric_state))
    if g.fabric_state != FABRIC_COMPLETED:
        return [(Status.CRITICAL, f"{g.where} NVLink fabric {state} (Fabric Manager has not "
                 "registered the GPU)")]
    if g.fabric_status is not None and g.fabric_status != 0:
        why = NVML_RETURN.get(g.fabric_status, str(g.fabric_status))
        return [(Status.CRITICAL, f"{g.where} NVLink fabric COMPLETED with status {why}")]
    return []


def ecc_location_problems(g: GPUInfo, t: GPUThresholds) -> list[Problem]:
    """SRAM uncorrectable errors drain (the GPU's on-chip memory cannot be repaired by a row
    remap); corrected errors over the class's ceilings warn."""
    p: list[Problem] = []
    vol = g.ecc_sram_uncorrected_volatile
    if vol is not None and vol > t.max_sram_uncorrected:
        p.append((Status.CRITICAL, f"{g.where} {vol} SRAM uncorrectable ECC errors (volatile): "
                  "reset the GPU; RMA if it recurs"))
    agg = g.ecc_sram_uncorrected_aggregate
    if agg is not None and agg > t.max_sram_uncorrected and not (vol and vol > t.max_sram_uncorrected):
        p.append((Status.WARNING, f"{g.where} {agg} SRAM uncorrectable ECC errors (aggregate)"))
    for where, value, ceiling in (
            ("SRAM", g.ecc_sram_corrected_volatile, t.max_sram_corrected_volatile),
            ("DRAM", g.ecc_dram_corrected_volatile, t.max_dram_corrected_volatile)):
        if value is not None and ceiling is not None and value > ceiling:
            p.append((Status.WARNING, f"{g.where} {value} {where} corrected ECC errors "
                      f"(volatile) > {ceiling}"))
    return p


def row_remap_problems(g: GPUInfo, t: GPUThresholds) -> list[Problem]:
    """Banks with low or no spare rows left: the next uncorrectable error there cannot be
    remapped (row remap failure, XID 64), so the GPU is warned before it fails."""
    h = g.row_remap_histogram
    if h is None:
        return []
    low, none = h.get("low", 0), h.get("none", 0)
    if low + none > t.max_row_remap_low_banks:
        return [(Status.WARNING, f"{g.where} {low + none} memory banks with few spare rows "
                 f"(low {low}, none {none}) > {t.max_row_remap_low_banks}")]
    return []


def throttle_shares(g: GPUInfo, base: Baseline | None, min_interval_s: float
                    ) -> dict[str, float]:
    """Per violation counter, the share of time (%) throttled since the last reading; judged
    only over at least `min_interval_s` (NVML's referenceTime, else the baseline's age)."""
    now, before = g.clocks_violation, base.clocks_violation if base is not None else None
    if not now or not before:
        return {}
    out: dict[str, float] = {}
    for name, (ref, ns) in now.items():
        if name not in before:
            continue
        ref0, ns0 = before[name]
        if ref is not None and ref0 is not None and ref > ref0:
            span_ns = (ref - ref0) * 1000.0
        elif base is not None and base.age_s is not None and base.age_s > 0:
            span_ns = base.age_s * 1e9
        else:
            continue
        if span_ns < max(min_interval_s, 1.0) * 1e9:
            continue
        out[name] = min(100.0, max(0.0, (ns - ns0) / span_ns * 100.0)) if ns >= ns0 else 0.0
    return out


def throttle_problems(g: GPUInfo, t: GPUThresholds, shares: Mapping[str, float],
                      base: Baseline | None) -> list[Problem]:
    p: list[Problem] = []
    for name, cap in t.max_throttle_pct.items():
        share = shares.get(name)
        if share is not None and share > cap:
            p.append((Status.WARNING, f"{g.where} {name}-throttled {share:.0f}% of the time "
                      f"{_in(interval_s(g, base))} (> {cap:g}%)"))
    return p


def settings_problems(g: GPUInfo, t: GPUThresholds) -> list[Problem]:
    """Enforced power limit and application clocks as the class expects."""
    p: list[Problem] = []
    if t.power_limit_w is not None and g.power_limit_w is not None \
            and abs(g.power_limit_w - t.power_limit_w) > 0.5:
        p.append((Status.WARNING, f"{g.where} power limit {g.power_limit_w:g} W, class "
                  f"{t.power_limit_w:g} W"))
    for what, value, want in (("SM", g.app_clock_sm_mhz, t.app_clock_sm_mhz),
                              ("memory", g.app_clock_mem_mhz, t.app_clock_mem_mhz)):
        if want is not None and value is not None and value != want:
            p.append((Status.WARNING, f"{g.where} application {what} clock {value} MHz, class "
                      f"{want} MHz"))
    return p


def not_reported(gpus: Sequence[GPUInfo], t: GPUThresholds) -> list[str]:
    """What the class would judge but NVML did not report (None on every GPU)."""
    want: list[tuple[str, str]] = []
    if t.nvlinks > 0:
        want.append(("NVLink state", "nvlink_state"))
    if t.nvswitch:
        want.append(("fabric state", "fabric_state"))
    want += [("SRAM ECC", "ecc_sram_uncorrected_volatile"),
             ("row remapper histogram", "row_remap_histogram"),
             ("violation counters", "clocks_violation")]
    if t.app_clock_sm_mhz is not None or t.app_clock_mem_mhz is not None:
        want.append(("application clocks", "app_clock_sm_mhz"))
    return [label for label, attr in want
            if gpus and all(getattr(g, attr) is None for g in gpus)]


def sxid_problems(sxids: Sequence[SXid], uptime_s: float | None, window_s: float
                  ) -> tuple[list[Problem], int]:
    """NVSwitch SXids within the window: the driver's own `Fatal` is CRITICAL (NVIDIA's Fabric
    Manager guide: a fatal SXid needs the NVSwitch and its GPUs reset), `Non-fatal` WARNING."""
    p: list[Problem] = []
    seen: set[tuple[str, int]] = set()
    counted = 0
    for x in sxids:
        if (window_s > 0 and x.at_s is not None and uptime_s is not None
                and uptime_s - x.at_s > window_s):
            continue
        counted += 1
        if (x.pci, x.code) in seen:
            continue
        seen.add((x.pci, x.code))
        what = f": {x.text}" if x.text else ""
        where = f"{x.switch} (PCI {x.pci})"
        if x.fatal is False:
            p.append((Status.WARNING, f"{where} SXid {x.code} non-fatal{what}"))
        else:  # Fatal, or a line without the word: treat as fatal
            p.append((Status.CRITICAL, f"{where} SXid {x.code} fatal{what}; reset the NVSwitch "
                      "and its GPUs (restart Fabric Manager)"))
    return p, counted
