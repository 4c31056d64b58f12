"""NVML facts: recorded live through pynvml, or replayed from a snapshot file.

The snapshot format (schema 1) is exactly what `gather_live()` records and what
`bv health snapshot --out FILE` writes; the gpu check parses both through `parse_snapshot()`,
so replaying a snapshot exercises the same code as a live node. Format (docs/health.md)::

    {
      "schema": 1, "kind": "nvml_snapshot",
      "source": "pynvml 12.535.133" | "fixture: ...",
      "recorded_at": "2026-01-01T00:00:00Z", "hostname": "gpu001",
      "driver_version": "535.129.03", "nvml_version": "12.535.129.03",
      "cuda_driver_version": 12020,
      "device_count": 8,
      "gpus": [ {GPU}, ... ],
      "uptime_s": 86400.5,                           # CLOCK_MONOTONIC when recorded
      "kmsg": ["[  812.345678] <kernel log line>", ...] | null,  # NVRM lines, for XIDs
      "errors": {"<what>": "<NVML error>"},          # calls that failed outside a GPU
      "init_error": "Driver Not Loaded",             # only when nvmlInit failed: no gpus
      "hang": {"call": "nvmlDeviceGetTemperature", "gpu": 3},   # replay blocks there
      "recheck": {"after_s": 1.0, "gpus": [RECHECK, ...]}       # second readings
    }

    GPU = {
      "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...",
      "pci_bus_id": "00000000:18:00.0", "serial": "...",
      "temperature_c": 31, "power_w": 69.8, "power_limit_w": 700.0,
      "total_energy_mj": 412872345123,
      "persistence_mode": true,
      "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
      "retired_pages_sbe": null, "retired_pages_dbe": null, "retired_pages_pending": null,
      "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
      "remapped_rows_pending": false, "remapped_rows_failure": false,
      "clocks_event_reasons": 1,                     # NVML bitmask (0x1 = GPU idle)
      "pcie_link_gen_current": 5, "pcie_link_gen_max": 5, "pcie_link_gen_gpu_max": 5,
      "pcie_link_width_current": 16, "pcie_link_width_max": 16,
      "compute_processes": [{"pid": 1234, "used_memory_bytes": 524288000}],
      "memory_total_bytes": 85520809984, "memory_used_bytes": 553648128,
      "vbios_version": "96.00.74.00.0D",
      "nvlink_state": [true, ..., false],            # per link until NVML says Not Supported
      "nvlink_errors": [{"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}, ...],
      "fabric_state": 3, "fabric_status": 0,         # GpuFabricInfo: COMPLETED, NVML_SUCCESS
      "ecc_sram_uncorrected_volatile": 0, "ecc_sram_uncorrected_aggregate": 0,
      "ecc_dram_uncorrected_volatile": 0, "ecc_dram_uncorrected_aggregate": 0,
      "ecc_sram_corrected_volatile": 0, "ecc_sram_corrected_aggregate": 0,
      "ecc_dram_corrected_volatile": 0, "ecc_dram_corrected_aggregate": 0,
      "row_remap_histogram": {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0},
      "clocks_violation": {"power": {"reference_us": 1768467600000000, "violation_ns": 0}, ...},
      "app_clock_sm_mhz": 1980, "app_clock_mem_mhz": 2619,
      "errors": {"retired_pages_sbe": "Not Supported"}   # each field NVML refused: null above
    }

The fields from `vbios_version` on (issue 11) are absent from older recordings: a snapshot
without them parses with None there, and the gpu check does not judge what is None.
`cuda_driver_version` is NVML's integer (12040), the parsed snapshot's is "12.4".

A GPU whose handle NVML cannot open (fallen off the bus) is recorded as
`{"index": i, "error": "..."}` and counts as missing.

Failures of NVML itself are part of the format, so a broken node replays like a live one:

- `init_error`: nvmlInit failed with this NVML message (`Driver Not Loaded`, `RM has detected
  an NVML/RM version mismatch.`, `NVML Shared Library Not Found`); `gpus` is empty.
- `hang`: an NVML call that never returned (`call`, and `gpu` when it was a device call). A
  replay blocks forever at that point, so the runner's timeout ends it exactly as it ends a live
  call stuck in the driver. Written by hand or by a recorder watching the call (a live recorder
  that hangs writes nothing).
- `recheck`: the GPUs whose first reading showed a hardware slowdown or compute processes,
  read again `after_s` later: `RECHECK = {"index": 5, "clocks_event_reasons": 1,
  "compute_processes": [...]}`. A slowdown or a process counts only when both readings show it.

Kernel log lines carry the record's time since boot in dmesg's `[seconds]` form; with
`uptime_s` that dates every XID (the XID window, docs/health.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bluevela.health.kmsg import bus_key, read_kmsg_nvrm, read_marked_lines
from bluevela.health.throttle import HW_SLOWDOWNS

logger = logging.getLogger(__name__)

SCHEMA = 1
KIND = "nvml_snapshot"


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
ECC_LOCATION_FIELDS = tuple(f for f, *_ in ECC_LOCATIONS)
# The GPU fields issue 11 added to the snapshot (absent from older recordings).
ISSUE11_GPU_FIELDS = ("vbios_version", "nvlink_state", "nvlink_errors", "fabric_state",
                      "fabric_status", *ECC_LOCATION_FIELDS, "row_remap_histogram",
                      "clocks_violation", "app_clock_sm_mhz", "app_clock_mem_mhz")


class NVMLInitError(RuntimeError):
    """nvmlInit failed: the node's GPU stack cannot start (no driver, version mismatch).

    Attributes:
        nvml_message: NVML's own text (`Driver Not Loaded`), as the drain reason shows it.
    """

    def __init__(self, nvml_message: str) -> None:
        super().__init__(f"NVML init failed: {nvml_message}")
        self.nvml_message = nvml_message


class NVMLMissingError(ImportError):
    """The Python binding (pynvml, package nvidia-ml-py) is not installed: bluevela's own
    installation is incomplete, which says nothing about the node."""


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    used_memory_bytes: int | None = None


@dataclass(frozen=True)
class GPUInfo:
    """One GPU's NVML values; None where NVML did not support or answer the call."""

    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    total_energy_mj: float | None = None
    persistence_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    clocks_event_reasons: int | None = None
    pcie_link_gen_current: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_gen_gpu_max: int | None = None
    pcie_link_width_current: int | None = None
    pcie_link_width_max: int | None = None
    compute_processes: tuple[ProcessInfo, ...] | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    error: str | None = None  # the handle itself could not be opened
    # Issue 11 (None: not in the snapshot, or NVML did not support it)
    vbios_version: str | None = None
    nvlink_state: tuple[bool | None, ...] | None = None  # per link: up, down, None unreadable
    nvlink_errors: tuple[Mapping[str, int] | None, ...] | None = None  # per link, NVLINK_COUNTERS
    fabric_state: int | None = None  # FABRIC_STATES
    fabric_status: int | None = None  # an NVML return code (0 NVML_SUCCESS)
    ecc_sram_uncorrected_volatile: int | None = None
    ecc_sram_uncorrected_aggregate: int | None = None
    ecc_sram_corrected_volatile: int | None = None
    ecc_sram_corrected_aggregate: int | None = None
    ecc_dram_uncorrected_volatile: int | None = None
    ecc_dram_uncorrected_aggregate: int | None = None
    ecc_dram_corrected_volatile: int | None = None
    ecc_dram_corrected_aggregate: int | None = None
    row_remap_histogram: Mapping[str, int] | None = None  # ROW_REMAP_BANKS -> banks
    # VIOLATION_POLICIES -> (referenceTime µs or None, violationTime ns, cumulative)
    clocks_violation: Mapping[str, tuple[int | None, int]] | None = None
    app_clock_sm_mhz: int | None = None
    app_clock_mem_mhz: int | None = None
    # The second reading (snapshot `recheck`), None when there was none.
    clocks_event_reasons_recheck: int | None = None
    compute_processes_recheck: tuple[ProcessInfo, ...] | None = None

    @property
    def label(self) -> str:
        return f"GPU{self.index}"

    @property
    def bus(self) -> str | None:
        return bus_key(self.pci_bus_id) if self.pci_bus_id else None

    @property
    def where(self) -> str:
        """`GPU 3 (0000:5D:00.0)`: the index and the PCI id with a 4-digit domain, as drain
        reasons name a GPU."""
        return f"GPU {self.index} ({short_pci(self.pci_bus_id)})" if self.pci_bus_id else f"GPU {self.index}"


@dataclass(frozen=True)
class NVMLSnapshot:
    """A parsed snapshot (live or replayed)."""

    gpus: tuple[GPUInfo, ...]
    device_count: int | None
    driver_version: str | None = None
    nvml_version: str | None = None
    kmsg: tuple[str, ...] | None = None
    source: str = ""
    errors: dict[str, str] = field(default_factory=dict)
    init_error: str | None = None  # nvmlInit failed with this NVML message
    hang: dict[str, Any] | None = None  # a call that never returned (replay blocks there)
    uptime_s: float | None = None  # CLOCK_MONOTONIC when recorded (dates kmsg lines)
    recheck_after_s: float | None = None
    cuda_driver_version: str | None = None  # "12.4" (NVML's 12040)


def short_pci(pci: str | None) -> str:
    """NVML's '00000000:5D:00.0' -> '0000:5D:00.0' (lspci's form); other forms unchanged."""
    if not pci:
        return "?"
    head, sep, rest = pci.partition(":")
    return f"{head[-4:]}{sep}{rest}" if sep and len(head) > 4 else pci


def cuda_version_text(value: Any) -> str | None:
    """NVML's CUDA driver version 12040 -> "12.4" (nvml.h NVML_CUDA_DRIVER_VERSION_MAJOR/MINOR);
    a string is kept."""
    if isinstance(value, str):
        return value or None
    v = _opt_int(value)
    if v is None or v <= 0:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


# -- parsing ----------------------------------------------------------------------------------


def _opt_int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _opt_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _opt_bool(v: Any) -> bool | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return bool(v)
    return None


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _procs(raw: Any) -> tuple[ProcessInfo, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple(ProcessInfo(int(p["pid"]), _opt_int(p.get("used_memory_bytes")))
                 for p in raw if isinstance(p, dict) and isinstance(p.get("pid"), int))


def _nvlink_state(raw: Any) -> tuple[bool | None, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple(_opt_bool(v) for v in raw)


def _nvlink_errors(raw: Any) -> tuple[Mapping[str, int] | None, ...] | None:
    if not isinstance(raw, list):
        return None
    return tuple({k: int(v) for k, v in e.items() if k in NVLINK_COUNTERS and _opt_int(v) is not None}
                 if isinstance(e, dict) else None for e in raw)


def _histogram(raw: Any) -> Mapping[str, int] | None:
    if not isinstance(raw, dict):
        return None
    out = {k: v for k in ROW_REMAP_BANKS if (v := _opt_int(raw.get(k))) is not None}
    return out or None


def _violations(raw: Any) -> Mapping[str, tuple[int | None, int]] | None:
    if not isinstance(raw, dict):
        return None
    out: dict[str, tuple[int | None, int]] = {}
    for name, v in raw.items():
        if name in VIOLATION_POLICIES and isinstance(v, dict):
            ns = _opt_int(v.get("violation_ns"))
            if ns is not None:
                out[name] = (_opt_int(v.get("reference_us")), ns)
    return out or None


def parse_gpu(raw: dict[str, Any], position: int,
              recheck: dict[str, Any] | None = None) -> GPUInfo:
    procs = _procs(raw.get("compute_processes"))
    again = recheck or {}
    index = raw.get("index")
    return GPUInfo(
        index=index if isinstance(index, int) else position,
        name=_opt_str(raw.get("name")),
        uuid=_opt_str(raw.get("uuid")),
        pci_bus_id=_opt_str(raw.get("pci_bus_id")),
        temperature_c=_opt_float(raw.get("temperature_c")),
        power_w=_opt_float(raw.get("power_w")),
        power_limit_w=_opt_float(raw.get("power_limit_w")),
        total_energy_mj=_opt_float(raw.get("total_energy_mj")),
        persistence_mode=_opt_bool(raw.get("persistence_mode")),
        ecc_uncorrected_volatile=_opt_int(raw.get("ecc_uncorrected_volatile")),
        ecc_uncorrected_aggregate=_opt_int(raw.get("ecc_uncorrected_aggregate")),
        retired_pages_sbe=_opt_int(raw.get("retired_pages_sbe")),
        retired_pages_dbe=_opt_int(raw.get("retired_pages_dbe")),
        retired_pages_pending=_opt_bool(raw.get("retired_pages_pending")),
        remapped_rows_correctable=_opt_int(raw.get("remapped_rows_correctable")),
        remapped_rows_uncorrectable=_opt_int(raw.get("remapped_rows_uncorrectable")),
        remapped_rows_pending=_opt_bool(raw.get("remapped_rows_pending")),
        remapped_rows_failure=_opt_bool(raw.get("remapped_rows_failure")),
        clocks_event_reasons=_opt_int(raw.get("clocks_event_reasons")),
        pcie_link_gen_current=_opt_int(raw.get("pcie_link_gen_current")),
        pcie_link_gen_max=_opt_int(raw.get("pcie_link_gen_max")),
        pcie_link_gen_gpu_max=_opt_int(raw.get("pcie_link_gen_gpu_max")),
        pcie_link_width_current=_opt_int(raw.get("pcie_link_width_current")),
        pcie_link_width_max=_opt_int(raw.get("pcie_link_width_max")),
        compute_processes=procs,
        memory_total_bytes=_opt_int(raw.get("memory_total_bytes")),
        memory_used_bytes=_opt_int(raw.get("memory_used_bytes")),
        error=_opt_str(raw.get("error")),
        clocks_event_reasons_recheck=_opt_int(again.get("clocks_event_reasons")),
        compute_processes_recheck=_procs(again.get("compute_processes")),
        vbios_version=_opt_str(raw.get("vbios_version")),
        nvlink_state=_nvlink_state(raw.get("nvlink_state")),
        nvlink_errors=_nvlink_errors(raw.get("nvlink_errors")),
        fabric_state=_opt_int(raw.get("fabric_state")),
        fabric_status=_opt_int(raw.get("fabric_status")),
        row_remap_histogram=_histogram(raw.get("row_remap_histogram")),
        clocks_violation=_violations(raw.get("clocks_violation")),
        app_clock_sm_mhz=_opt_int(raw.get("app_clock_sm_mhz")),
        app_clock_mem_mhz=_opt_int(raw.get("app_clock_mem_mhz")),
        **{f: _opt_int(raw.get(f)) for f in ECC_LOCATION_FIELDS},
    )


def parse_snapshot(data: Any, source: str = "") -> NVMLSnapshot:
    """Parse a snapshot dict (schema 1).

    Raises:
        ValueError: not a schema-1 NVML snapshot.
    """
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError("not an NVML snapshot (kind != 'nvml_snapshot')")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"unsupported NVML snapshot schema {data.get('schema')!r} (want {SCHEMA})")
    gpus_raw = data.get("gpus")
    if not isinstance(gpus_raw, list):
        raise ValueError("NVML snapshot has no 'gpus' list")
    kmsg = data.get("kmsg")
    raw_recheck = data.get("recheck")
    recheck: dict[str, Any] = raw_recheck if isinstance(raw_recheck, dict) else {}
    again = {g["index"]: g for g in recheck.get("gpus") or ()
             if isinstance(g, dict) and isinstance(g.get("index"), int)}
    hang = data.get("hang")
    init_error = data.get("init_error")
    return NVMLSnapshot(
        gpus=tuple(parse_gpu(g, i, again.get(g.get("index", i)))
                   for i, g in enumerate(gpus_raw) if isinstance(g, dict)),
        device_count=_opt_int(data.get("device_count")),
        driver_version=_opt_str(data.get("driver_version")),
        nvml_version=_opt_str(data.get("nvml_version")),
        kmsg=tuple(str(x) for x in kmsg) if isinstance(kmsg, list) else None,
        source=source or str(data.get("source") or ""),
        errors={str(k): str(v) for k, v in (data.get("errors") or {}).items()},
        init_error=str(init_error) if init_error not in (None, "") else None,
        hang=dict(hang) if isinstance(hang, dict) else ({"call": str(hang)} if hang else None),
        uptime_s=_opt_float(data.get("uptime_s")),
        recheck_after_s=_opt_float(recheck.get("after_s")),
        cuda_driver_version=cuda_version_text(data.get("cuda_driver_version")),
    )


def load_snapshot(path: Path) -> NVMLSnapshot:
    """Read and parse a snapshot file.

    Raises:
        OSError: unreadable. ValueError: not valid JSON or not a snapshot.
    """
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return parse_snapshot(data, source=f"snapshot {path}")


# -- live recording ---------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_kmsg(out: dict[str, Any], errors: dict[str, str]) -> None:
    path = os.environ.get("BV_KMSG")
    try:
        out["kmsg"] = read_marked_lines(path) if path else read_kmsg_nvrm()
    except OSError as exc:
        errors["kmsg"] = f"{exc.strerror or exc}"


def _header(source: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": KIND,
        "source": source,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hostname": socket.gethostname(),
        "uptime_s": round(time.clock_gettime(time.CLOCK_MONOTONIC), 6),
    }


def _binding_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("nvidia-ml-py")
    except PackageNotFoundError:
        return "?"


def gather_live(*, include_kmsg: bool = True, recheck_s: float = 0.0,
                raise_init_error: bool = True,
                process_gpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Record this node's NVML values in the snapshot format.

    Every NVML call is guarded: a field NVML does not support (or that fails) is recorded
    as null, with the error text under the GPU's `errors`. A GPU showing a hardware slowdown
    or compute processes is read again after `recheck_s` (0: no second reading).

    Args:
        include_kmsg: also read the kernel log's NVRM lines (`BV_KMSG`, else /dev/kmsg).
        recheck_s: seconds before the second reading.
        raise_init_error: raise when nvmlInit fails; False records it as `init_error`.
        process_gpus: only processes on these GPUs call for a second reading (the job's
            GPUs in the prolog); None: any GPU.

    Raises:
        NVMLMissingError: pynvml (package nvidia-ml-py) is not installed.
        NVMLInitError: nvmlInit failed (no driver, version mismatch) and `raise_init_error`.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise NVMLMissingError("pynvml is not installed (package nvidia-ml-py)") from exc

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if raise_init_error:
            raise NVMLInitError(str(exc)) from exc
        out = _header(f"live NVML via pynvml (nvidia-ml-py {_binding_version()})")
        errors: dict[str, str] = {}
        out.update(driver_version=None, nvml_version=None, cuda_driver_version=None,
                   device_count=None, gpus=[], kmsg=None, errors=errors, init_error=str(exc))
        if include_kmsg:
            _read_kmsg(out, errors)
        return out
    try:
        return _gather(pynvml, include_kmsg, recheck_s, process_gpus)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _call(nv: Any, where: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or None with NVML's error in `where[key]` when NVML refuses (not supported, no
    permission, a function the driver lacks: `NVMLError_FunctionNotFound`,
    `NVMLLibraryMismatchError`).

    Only NVML's own errors are a null field. An AttributeError or TypeError is a bug here (a
    misspelt function, wrong arguments) and goes up: caught, it would be a field that is
    always null and looks like a GPU that does not answer. Every function and constant this
    module calls unguarded is in the oldest binding it supports (nvidia-ml-py 12.535.77); the
    newer ones are looked up with `getattr`/`hasattr` and a fallback
    (tests/test_health_nvml_errors.py checks both against the installed binding).
    """
    try:
        return fn()
    except _nvml_errors(nv) as exc:
        where[key] = str(exc)
    return None


def _nvml_errors(nv: Any) -> tuple[type[Exception], ...]:
    """NVML's errors: `NVMLError`, and where the binding has it `NVMLLibraryMismatchError`
    (nvidia-ml-py 13: an unversioned call whose versioned function the driver lacks)."""
    mismatch = getattr(nv, "NVMLLibraryMismatchError", None)
    return (nv.NVMLError, mismatch) if mismatch is not None else (nv.NVMLError,)


def _gather(nv: Any, include_kmsg: bool, recheck_s: float = 0.0,
            process_gpus: tuple[int, ...] | None = None) -> dict[str, Any]:
    errors: dict[str, str] = {}

    def call(where: dict[str, str], key: str, fn: Callable[[], Any]) -> Any:
        return _call(nv, where, key, fn)

    count = call(errors, "device_count", nv.nvmlDeviceGetCount)
    cuda = call(errors, "cuda_driver_version", getattr(
        nv, "nvmlSystemGetCudaDriverVersion_v2", None) or nv.nvmlSystemGetCudaDriverVersion)
    out = _header(f"live NVML via pynvml (nvidia-ml-py {_binding_version()})")
    out.update({
        "driver_version": _opt(call(errors, "driver_version", nv.nvmlSystemGetDriverVersion), _text),
        "nvml_version": _opt(call(errors, "nvml_version", nv.nvmlSystemGetNVMLVersion), _text),
        "cuda_driver_version": cuda,
        "device_count": count,
        "gpus": [_gather_gpu(nv, i, call) for i in range(count or 0)],
        "kmsg": None,
        "errors": errors,
    })
    suspects = [g["index"] for g in out["gpus"]
                if ((g.get("clocks_event_reasons") or 0) & HW_SLOWDOWNS)
                or (g.get("compute_processes")
                    and (process_gpus is None or g["index"] in process_gpus))]
    if suspects and recheck_s > 0:
        # One transient reading (a power-brake blip, a process exiting) must not drain a node.
        time.sleep(recheck_s)
        out["recheck"] = {"after_s": recheck_s,
                          "gpus": [_regather_gpu(nv, i, call) for i in suspects]}
    if include_kmsg:
        _read_kmsg(out, errors)
    return out


def _reasons_fn(nv: Any) -> Callable[[Any], Any]:
    fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return fn or nv.nvmlDeviceGetCurrentClocksThrottleReasons


def _process_list(procs: Any) -> list[dict[str, Any]] | None:
    return None if procs is None else [
        {"pid": int(p.pid), "used_memory_bytes": _mem(getattr(p, "usedGpuMemory", None))}
        for p in procs
    ]


def _regather_gpu(nv: Any, index: int, call: Callable[..., Any]) -> dict[str, Any]:
    errs: dict[str, str] = {}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        return {"index": index, "error": str(exc)}
    reasons = _reasons_fn(nv)
    return {
        "index": index,
        "clocks_event_reasons": call(errs, "clocks_event_reasons", lambda: reasons(h)),
        "compute_processes": _process_list(call(
            errs, "compute_processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))),
        "errors": errs,
    }


def _opt(value: Any, fn: Callable[[Any], Any]) -> Any:
    return None if value is None else fn(value)


def _gather_gpu(nv: Any, index: int, call: Callable[..., Any]) -> dict[str, Any]:
    errs: dict[str, str] = {}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError as exc:
        return {"index": index, "error": str(exc)}

    def get(key: str, fn: Callable[[], Any]) -> Any:
        return call(errs, key, fn)

    g: dict[str, Any] = {"index": index}
    g["name"] = _opt(get("name", lambda: nv.nvmlDeviceGetName(h)), _text)
    g["uuid"] = _opt(get("uuid", lambda: nv.nvmlDeviceGetUUID(h)), _text)
    g["pci_bus_id"] = _opt(get("pci_bus_id", lambda: nv.nvmlDeviceGetPciInfo(h).busId), _text)
    g["serial"] = _opt(get("serial", lambda: nv.nvmlDeviceGetSerial(h)), _text)
    g["temperature_c"] = get(
        "temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
    g["power_w"] = _opt(get("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h)), lambda mw: mw / 1000)
    g["power_limit_w"] = _opt(
        get("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h)), lambda mw: mw / 1000)
    g["total_energy_mj"] = get(
        "total_energy_mj", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))
    g["persistence_mode"] = _opt(
        get("persistence_mode", lambda: nv.nvmlDeviceGetPersistenceMode(h)), bool)
    unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    g["ecc_uncorrected_volatile"] = get(
        "ecc_uncorrected_volatile",
        lambda: nv.nvmlDeviceGetTotalEccErrors(h, unc, nv.NVML_VOLATILE_ECC))
    g["ecc_uncorrected_aggregate"] = get(
        "ecc_uncorrected_aggregate",
        lambda: nv.nvmlDeviceGetTotalEccErrors(h, unc, nv.NVML_AGGREGATE_ECC))
    g["retired_pages_sbe"] = _opt(get("retired_pages_sbe", lambda: nv.nvmlDeviceGetRetiredPages(
        h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)), len)
    g["retired_pages_dbe"] = _opt(get("retired_pages_dbe", lambda: nv.nvmlDeviceGetRetiredPages(
        h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)), len)
    g["retired_pages_pending"] = _opt(get(
        "retired_pages_pending", lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h)), bool)
    rows = get("remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
    if rows is not None:
        corr, unc_rows, pending, failure = rows
        g.update(remapped_rows_correctable=corr, remapped_rows_uncorrectable=unc_rows,
                 remapped_rows_pending=bool(pending), remapped_rows_failure=bool(failure))
    else:
        g.update(remapped_rows_correctable=None, remapped_rows_uncorrectable=None,
                 remapped_rows_pending=None, remapped_rows_failure=None)
    reasons_fn = _reasons_fn(nv)
    g["clocks_event_reasons"] = get("clocks_event_reasons", lambda: reasons_fn(h))
    g["pcie_link_gen_current"] = get(
        "pcie_link_gen_current", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h))
    g["pcie_link_gen_max"] = get(
        "pcie_link_gen_max", lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h))
    g["pcie_link_gen_gpu_max"] = get(
        "pcie_link_gen_gpu_max", lambda: nv.nvmlDeviceGetGpuMaxPcieLinkGeneration(h))
    g["pcie_link_width_current"] = get(
        "pcie_link_width_current", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h))
    g["pcie_link_width_max"] = get(
        "pcie_link_width_max", lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h))
    procs = get("compute_processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
    g["compute_processes"] = _process_list(procs)
    mem = get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
    g["memory_total_bytes"] = getattr(mem, "total", None) if mem is not None else None
    g["memory_used_bytes"] = getattr(mem, "used", None) if mem is not None else None
    _gather_gpu_issue11(nv, h, g, get, errs)
    g["errors"] = errs
    return g


def _nvml_code(nv: Any, exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _gather_nvlinks(nv: Any, h: Any, g: dict[str, Any], errs: dict[str, str]) -> None:
    """Link states 0.. until NVML says the link does not exist (Not Supported, or Invalid
    Argument past the GPU's last link), then each link's error counters."""
    end = {getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nv, "NVML_ERROR_INVALID_ARGUMENT", 2)}
    states: list[bool | None] = []
    try:
        enabled = nv.NVML_FEATURE_ENABLED
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                states.append(nv.nvmlDeviceGetNvLinkState(h, link) == enabled)
            except nv.NVMLError as exc:
                if _nvml_code(nv, exc) in end:
                    if link == 0:
                        errs["nvlink_state"] = str(exc)
                    break
                states.append(None)
                errs[f"nvlink_state[{link}]"] = str(exc)
    except (AttributeError, TypeError, ValueError) as exc:  # a binding without NVLink calls
        errs["nvlink_state"] = f"{type(exc).__name__}: {exc}"
        g["nvlink_state"] = g["nvlink_errors"] = None
        return
    g["nvlink_state"] = states
    counters = {name: getattr(nv, const, None) for name, const in NVLINK_COUNTERS.items()}
    per_link: list[dict[str, int] | None] = []
    for link in range(len(states)):
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
    g["nvlink_errors"] = per_link


def _fabric_info(nv: Any, h: Any) -> tuple[int, int]:
    """GpuFabricInfo (state, status): the versioned call where the binding has it."""
    import ctypes

    if hasattr(nv, "nvmlDeviceGetGpuFabricInfoV") and hasattr(nv, "c_nvmlGpuFabricInfoV_t"):
        info: Any = nv.c_nvmlGpuFabricInfoV_t()
        nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    else:
        info = nv.c_nvmlGpuFabricInfo_t()
        nv.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    return int(info.state), int(info.status)


def _gather_gpu_issue11(nv: Any, h: Any, g: dict[str, Any], get: Callable[..., Any],
                        errs: dict[str, str]) -> None:
    """VBIOS, NVLink, fabric, ECC by location, row remapper histogram, violation counters,
    application clocks: each call guarded, null (with its error) where NVML refuses."""
    g["vbios_version"] = _opt(get("vbios_version", lambda: nv.nvmlDeviceGetVbiosVersion(h)), _text)
    _gather_nvlinks(nv, h, g, errs)
    fabric = get("fabric", lambda: _fabric_info(nv, h))
    g["fabric_state"], g["fabric_status"] = fabric if fabric is not None else (None, None)
    for name, kind, counter, loc in ECC_LOCATIONS:
        g[name] = get(name, lambda k=kind, c=counter, lo=loc: nv.nvmlDeviceGetMemoryErrorCounter(
            h, getattr(nv, k), getattr(nv, c), getattr(nv, lo)))
    hist = get("row_remap_histogram", lambda: nv.nvmlDeviceGetRowRemapperHistogram(h))
    g["row_remap_histogram"] = (None if hist is None else
                                {k: int(getattr(hist, k)) for k in ROW_REMAP_BANKS})
    viol: dict[str, dict[str, int]] = {}
    for name, const in VIOLATION_POLICIES.items():
        v = get(f"clocks_violation.{name}",
                lambda c=const: nv.nvmlDeviceGetViolationStatus(h, getattr(nv, c)))
        if v is not None:
            viol[name] = {"reference_us": int(v.referenceTime), "violation_ns": int(v.violationTime)}
    g["clocks_violation"] = viol or None
    g["app_clock_sm_mhz"] = get(
        "app_clock_sm_mhz", lambda: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM))
    g["app_clock_mem_mhz"] = get(
        "app_clock_mem_mhz", lambda: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_MEM))


def _mem(value: Any) -> int | None:
    # NVML reports "not available" (no privilege, MIG) as a huge sentinel value.
    if not isinstance(value, int) or value < 0 or value >= (1 << 63):
        return None
    return value


def write_snapshot(path: Path, data: dict[str, Any]) -> None:
    """Write a snapshot as readable JSON (atomically when the directory allows it)."""
    from bluevela.util.fs import atomic_write

    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    atomic_write(path, text.encode(), 0o644)


# -- where the gpu probe reads NVML from ------------------------------------------------------


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
    """This node's NVML through pynvml."""

    include_kmsg: bool = True
    recheck_s: float = 0.0
    process_gpus: tuple[int, ...] | None = None

    def read(self) -> NVMLSnapshot:
        data = gather_live(include_kmsg=self.include_kmsg, recheck_s=self.recheck_s,
                           raise_init_error=False, process_gpus=self.process_gpus)
        return parse_snapshot(data, "live NVML")


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
