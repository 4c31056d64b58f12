"""What bluevela reads of a GPU through NVML: one table row per snapshot field.

`GPU_FIELDS` is the one list of a GPU's fields. Each row says

- `name`: the key in the snapshot's GPU object and the attribute of `GPUInfo`;
- `parse`: the snapshot's JSON value -> the `GPUInfo` value (None where it is unusable);
- `call`: the NVML call that answers it, as `read(nv, handle)` with `nv` the pynvml module.
  Fields that one call answers together (the remapped-row counts, memory total and used,
  fabric state and status, NVLink state and counters) share one `Call`: it runs once per GPU
  and its failure is recorded once, under its `key`;
- `record`: NVML's answer (never None) -> the snapshot's JSON value.

The snapshot parser (`nvml_snapshot.parse_gpu`) applies the `parse` column; the live recorder
(`nvml_live.read_gpu_fields`) runs the `call` and `record` columns. A new GPU field is one row here and its
typed attribute on `GPUInfo` (tests/health/test_health_nvml_fields.py holds the two together).

Every pynvml function and constant called as `nv.<name>` (and every `"NVML_*"` name below)
is in the oldest binding supported, nvidia-ml-py 12.535.77; newer ones are looked up with
`getattr`/`hasattr` and a fallback (tests/health/test_health_nvml_errors.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

# nvmlDeviceGetNvLinkErrorCounter counters (nvml.h nvmlNvLinkErrorCounter_t), by our name.
NVLINK_COUNTERS = {"replay": "NVML_NVLINK_ERROR_DL_REPLAY",
                   "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
                   "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                   "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA"}
# nvmlDeviceGetViolationStatus policies (nvml.h nvmlPerfPolicyType_t), by our name.
VIOLATION_POLICIES = {"power": "NVML_PERF_POLICY_POWER",
                      "thermal": "NVML_PERF_POLICY_THERMAL",
                      "sync_boost": "NVML_PERF_POLICY_SYNC_BOOST",
                      "board_limit": "NVML_PERF_POLICY_BOARD_LIMIT",
                      "low_utilization": "NVML_PERF_POLICY_LOW_UTILIZATION",
                      "reliability": "NVML_PERF_POLICY_RELIABILITY",
                      "total_app_clocks": "NVML_PERF_POLICY_TOTAL_APP_CLOCKS",
                      "total_base_clocks": "NVML_PERF_POLICY_TOTAL_BASE_CLOCKS"}
ROW_REMAP_BANKS = ("max", "high", "partial", "low", "none")
# GpuFabricInfo.state (nvml.h NVML_GPU_FABRIC_STATE_*)
FABRIC_STATES = {0: "NOT_SUPPORTED", 1: "NOT_STARTED", 2: "IN_PROGRESS", 3: "COMPLETED"}
FABRIC_COMPLETED = 3
# ECC counters by location: (our field, error type, counter type, location), nvml.h names.
ECC_LOCATIONS = tuple(
    (f"ecc_{loc}_{kind}_{counter}", f"NVML_MEMORY_ERROR_TYPE_{kind.upper()}",
     f"NVML_{counter.upper()}_ECC", f"NVML_MEMORY_LOCATION_{loc.upper()}")
    for loc in ("sram", "dram") for kind in ("uncorrected", "corrected")
    for counter in ("volatile", "aggregate"))


# -- the snapshot's JSON values -> the model's ---------------------------------------------------


def as_int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def as_bool(v: Any) -> bool | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return bool(v)
    return None


def as_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    used_memory_bytes: int | None = None


def as_processes(raw: Any) -> tuple[ProcessInfo, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple(ProcessInfo(int(p["pid"]), as_int(p.get("used_memory_bytes")))
                 for p in raw if isinstance(p, dict) and isinstance(p.get("pid"), int))


def _as_link_states(raw: Any) -> tuple[bool | None, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple(as_bool(v) for v in raw)


def _as_link_errors(raw: Any) -> tuple[Mapping[str, int] | None, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple({k: int(v) for k, v in e.items() if k in NVLINK_COUNTERS and as_int(v) is not None}
                 if isinstance(e, dict) else None for e in raw)


def _as_histogram(raw: Any) -> Mapping[str, int] | None:
    if not isinstance(raw, dict):
        return None
    out = {k: v for k in ROW_REMAP_BANKS if (v := as_int(raw.get(k))) is not None}
    return out or None


def _as_violations(raw: Any) -> Mapping[str, tuple[int | None, int]] | None:
    if not isinstance(raw, dict):
        return None
    out: dict[str, tuple[int | None, int]] = {}
    for name, v in raw.items():
        if name in VIOLATION_POLICIES and isinstance(v, dict):
            ns = as_int(v.get("violation_ns"))
            if ns is not None:
                out[name] = (as_int(v.get("reference_us")), ns)
    return out or None


# -- NVML's answers -> the snapshot's JSON values ------------------------------------------------


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _same(value: Any) -> Any:
    return value


def _memory(value: Any) -> int | None:
    # NVML reports "not available" (no privilege, MIG) as a huge sentinel value.
    if not isinstance(value, int) or value < 0 or value >= (1 << 63):
        return None
    return value


def process_list(procs: Any) -> list[dict[str, Any]]:
    return [{"pid": int(p.pid), "used_memory_bytes": _memory(getattr(p, "usedGpuMemory", None))}
            for p in procs]


# -- guarded NVML calls ---------------------------------------------------------------------------


def nvml_errors(nv: Any) -> tuple[type[Exception], ...]:
    """NVML's errors: `NVMLError`, and where the binding has it `NVMLLibraryMismatchError`
    (nvidia-ml-py 13: an unversioned call whose versioned function the driver lacks)."""
    mismatch = getattr(nv, "NVMLLibraryMismatchError", None)
    return (nv.NVMLError, mismatch) if mismatch is not None else (nv.NVMLError,)


def guarded_call(nv: Any, where: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or None with NVML's error in `where[key]` when NVML refuses (not supported, no
    permission, a function the driver lacks: `NVMLError_FunctionNotFound`,
    `NVMLLibraryMismatchError`).

    Only NVML's own errors are a null field. An AttributeError or TypeError is a bug here (a
    misspelt function, wrong arguments) and goes up: caught, it would be a field that is
    always null and looks like a GPU that does not answer.
    """
    try:
        return fn()
    except nvml_errors(nv) as exc:
        where[key] = str(exc)
    return None


# -- the calls that are more than one NVML function ----------------------------------------------


def _reasons(nv: Any, h: Any) -> Any:
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return (fn or nv.nvmlDeviceGetCurrentClocksThrottleReasons)(h)


def _nvml_code(exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _link_states(nv: Any, h: Any, errs: dict[str, str]) -> list[bool | None]:
    """Link states 0.. until NVML says the link does not exist (Not Supported, or Invalid
    Argument past the GPU's last link)."""
    end = {getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nv, "NVML_ERROR_INVALID_ARGUMENT", 2)}
    enabled = nv.NVML_FEATURE_ENABLED
    states: list[bool | None] = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            states.append(nv.nvmlDeviceGetNvLinkState(h, link) == enabled)
        except nv.NVMLError as exc:
            if _nvml_code(exc) in end:
                if link == 0:
                    errs["nvlink_state"] = str(exc)
                break
            states.append(None)
            errs[f"nvlink_state[{link}]"] = str(exc)
    return states


def _link_errors(nv: Any, h: Any, links: int, errs: dict[str, str]) -> list[dict[str, int] | None]:
    counters = {name: getattr(nv, const, None) for name, const in NVLINK_COUNTERS.items()}
    per_link: list[dict[str, int] | None] = []
    for link in range(links):
        found: dict[str, int] = {}
        for name, counter in counters.items():
            if counter is None:
                continue
            try:
                found[name] = int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
            except nv.NVMLError as exc:
                errs[f"nvlink_errors[{link}].{name}"] = str(exc)
            except (AttributeError, TypeError, ValueError) as exc:
                errs[f"nvlink_errors[{link}].{name}"] = f"{type(exc).__name__}: {exc}"
        per_link.append(found or None)
    return per_link


def _nvlinks(nv: Any, h: Any, errs: dict[str, str]) -> tuple[Any, Any] | None:
    """(each link's state, each link's error counters); None for a binding without NVLink."""
    try:
        states = _link_states(nv, h, errs)
    except (AttributeError, TypeError, ValueError) as exc:
        errs["nvlink_state"] = f"{type(exc).__name__}: {exc}"
        return None
    return states, _link_errors(nv, h, len(states), errs)


def _fabric(nv: Any, h: Any) -> tuple[int, int]:
    """GpuFabricInfo (state, status): the versioned call where the binding has it."""
    import ctypes  # only a live gather needs it; the prolog's replay path does not

    if hasattr(nv, "nvmlDeviceGetGpuFabricInfoV") and hasattr(nv, "c_nvmlGpuFabricInfoV_t"):
        info: Any = nv.c_nvmlGpuFabricInfoV_t()
        nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    else:
        info = nv.c_nvmlGpuFabricInfo_t()
        nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    return int(info.state), int(info.status)


def _violations(nv: Any, h: Any, errs: dict[str, str]) -> dict[str, dict[str, int]] | None:
    """Each policy's violation counters; a policy NVML refuses is left out (its error kept)."""
    viol: dict[str, dict[str, int]] = {}
    for name, const in VIOLATION_POLICIES.items():
        v = guarded_call(nv, errs, f"clocks_violation.{name}",
                         partial(nv.nvmlDeviceGetViolationStatus, h, getattr(nv, const)))
        if v is not None:
            viol[name] = {"reference_us": int(v.referenceTime), "violation_ns": int(v.violationTime)}
    return viol or None


def _ecc_reader(kind: str, counter: str, loc: str) -> Callable[[Any, Any], Any]:
    return lambda nv, h: nv.nvmlDeviceGetMemoryErrorCounter(
        h, getattr(nv, kind), getattr(nv, counter), getattr(nv, loc))


# -- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One NVML call per GPU.

    Attributes:
        key: where its failure is recorded in the GPU's `errors`.
        read: `(nv, handle) -> answer`, NVML's errors making the fields it answers null; or,
            with `guards_itself`, `(nv, handle, errors) -> answer` for a call of many NVML
            functions that records each one's failure itself.
    """

    key: str
    read: Callable[..., Any]
    guards_itself: bool = False


@dataclass(frozen=True)
class GPUField:
    """One snapshot field of a GPU (module docstring)."""

    name: str
    parse: Callable[[Any], Any] | None  # None: recorded, not in the model (`serial`)
    call: Call
    record: Callable[[Any], Any] = _same
    late: bool = False  # added after the first recordings: older snapshots lack it


def _one(name: str, parse: Callable[[Any], Any] | None, read: Callable[[Any, Any], Any],
         record: Callable[[Any], Any] = _same, late: bool = False) -> GPUField:
    """A field answered by a call of its own, its failure under the field's name."""
    return GPUField(name, parse, Call(name, read), record, late)


_REMAPPED = Call("remapped_rows", lambda nv, h: nv.nvmlDeviceGetRemappedRows(h))
_MEMORY = Call("memory", lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h))
_NVLINKS = Call("nvlink_state", _nvlinks, guards_itself=True)
_FABRIC = Call("fabric", _fabric)
_UNC, _VOL, _AGG = "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC"
_SBE = "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"
_DBE = "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"


def _kilo(mw: Any) -> Any:
    return mw / 1000


def _bool_at(i: int) -> Callable[[Any], bool]:
    return lambda v: bool(v[i])


def _attr(name: str) -> Callable[[Any], Any]:
    return lambda v: getattr(v, name, None)


GPU_FIELDS: tuple[GPUField, ...] = (
    _one("name", as_str, lambda nv, h: nv.nvmlDeviceGetName(h), text),
    _one("uuid", as_str, lambda nv, h: nv.nvmlDeviceGetUUID(h), text),
    _one("pci_bus_id", as_str, lambda nv, h: nv.nvmlDeviceGetPciInfo(h).busId, text),
    _one("serial", None, lambda nv, h: nv.nvmlDeviceGetSerial(h), text),
    _one("temperature_c", as_float,
         lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
    _one("power_w", as_float, lambda nv, h: nv.nvmlDeviceGetPowerUsage(h), _kilo),
    _one("power_limit_w", as_float, lambda nv, h: nv.nvmlDeviceGetEnforcedPowerLimit(h), _kilo),
    _one("total_energy_mj", as_float, lambda nv, h: nv.nvmlDeviceGetTotalEnergyConsumption(h)),
    _one("persistence_mode", as_bool, lambda nv, h: nv.nvmlDeviceGetPersistenceMode(h), bool),
    _one("ecc_uncorrected_volatile", as_int, lambda nv, h: nv.nvmlDeviceGetTotalEccErrors(
        h, getattr(nv, _UNC), getattr(nv, _VOL))),
    _one("ecc_uncorrected_aggregate", as_int, lambda nv, h: nv.nvmlDeviceGetTotalEccErrors(
        h, getattr(nv, _UNC), getattr(nv, _AGG))),
    _one("retired_pages_sbe", as_int,
         lambda nv, h: nv.nvmlDeviceGetRetiredPages(h, getattr(nv, _SBE)), len),
    _one("retired_pages_dbe", as_int,
         lambda nv, h: nv.nvmlDeviceGetRetiredPages(h, getattr(nv, _DBE)), len),
    _one("retired_pages_pending", as_bool,
         lambda nv, h: nv.nvmlDeviceGetRetiredPagesPendingStatus(h), bool),
    GPUField("remapped_rows_correctable", as_int, _REMAPPED, itemgetter(0)),
    GPUField("remapped_rows_uncorrectable", as_int, _REMAPPED, itemgetter(1)),
    GPUField("remapped_rows_pending", as_bool, _REMAPPED, _bool_at(2)),
    GPUField("remapped_rows_failure", as_bool, _REMAPPED, _bool_at(3)),
    _one("clocks_event_reasons", as_int, _reasons),  # NVML bitmask: health.throttle
    _one("pcie_link_gen_current", as_int, lambda nv, h: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
    _one("pcie_link_gen_max", as_int, lambda nv, h: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
    _one("pcie_link_gen_gpu_max", as_int,
         lambda nv, h: nv.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)),
    _one("pcie_link_width_current", as_int, lambda nv, h: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
    _one("pcie_link_width_max", as_int, lambda nv, h: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
    _one("compute_processes", as_processes,
         lambda nv, h: nv.nvmlDeviceGetComputeRunningProcesses(h), process_list),
    GPUField("memory_total_bytes", as_int, _MEMORY, _attr("total")),
    GPUField("memory_used_bytes", as_int, _MEMORY, _attr("used")),
    _one("vbios_version", as_str, lambda nv, h: nv.nvmlDeviceGetVbiosVersion(h), text, late=True),
    GPUField("nvlink_state", _as_link_states, _NVLINKS, itemgetter(0), late=True),
    GPUField("nvlink_errors", _as_link_errors, _NVLINKS, itemgetter(1), late=True),
    GPUField("fabric_state", as_int, _FABRIC, itemgetter(0), late=True),
    GPUField("fabric_status", as_int, _FABRIC, itemgetter(1), late=True),
    *(_one(name, as_int, _ecc_reader(kind, counter, loc), late=True)
      for name, kind, counter, loc in ECC_LOCATIONS),
    _one("row_remap_histogram", _as_histogram,
         lambda nv, h: nv.nvmlDeviceGetRowRemapperHistogram(h),
         lambda hist: {k: int(getattr(hist, k)) for k in ROW_REMAP_BANKS}, late=True),
    GPUField("clocks_violation", _as_violations,
             Call("clocks_violation", _violations, guards_itself=True), late=True),
    _one("app_clock_sm_mhz", as_int,
         lambda nv, h: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM), late=True),
    _one("app_clock_mem_mhz", as_int,
         lambda nv, h: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_MEM), late=True),
)
FIELDS_BY_NAME = {f.name: f for f in GPU_FIELDS}
# The fields absent from the first recordings (tests/data/health/nvml-real-*-1gpu.json): a
# snapshot without them parses with None there.
LATE_FIELDS = tuple(f.name for f in GPU_FIELDS if f.late)
# The second reading of a GPU whose first showed a hardware slowdown or compute processes.
RECHECK_FIELDS = (FIELDS_BY_NAME["clocks_event_reasons"], FIELDS_BY_NAME["compute_processes"])

# What the telemetry sampler reads besides the snapshot (not in the snapshot format).
ACTIVITY_FIELDS: tuple[GPUField, ...] = (
    _one("util_pct", None, lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu, float),
    _one("sm_clock_mhz", None, lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
         float),
)

