"""The NVML snapshot: its format, the model (`NVMLSnapshot`, `GPUInfo`) and the parser.

The snapshot format (schema 1) is exactly what `nvml_live.gather_live()` records and what
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

The GPU fields are the rows of `nvml_fields.GPU_FIELDS`, whose `parse` column this parser
applies. The fields from `vbios_version` on (`nvml_fields.LATE_FIELDS`) are absent from older
recordings: a snapshot without them parses with None there, and the gpu check does not judge
what is None.
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
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bluevela.health.kmsg import bus_key
from bluevela.health.nvml_fields import (
    GPU_FIELDS,
    ProcessInfo,
    as_float,
    as_int,
    as_processes,
    as_str,
)

SCHEMA = 1
KIND = "nvml_snapshot"


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
    # LATE_FIELDS (None: not in an older snapshot, or NVML did not support it)
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
    v = as_int(value)
    if v is None or v <= 0:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def parse_gpu(raw: dict[str, Any], position: int,
              recheck: dict[str, Any] | None = None) -> GPUInfo:
    """One GPU object of a snapshot (its `recheck` entry, if any, as the second reading)."""
    again = recheck or {}
    index = raw.get("index")
    values = {f.name: f.parse(raw.get(f.name)) for f in GPU_FIELDS if f.parse is not None}
    return GPUInfo(
        index=index if isinstance(index, int) else position,
        error=as_str(raw.get("error")),
        clocks_event_reasons_recheck=as_int(again.get("clocks_event_reasons")),
        compute_processes_recheck=as_processes(again.get("compute_processes")),
        **values,
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
        device_count=as_int(data.get("device_count")),
        driver_version=as_str(data.get("driver_version")),
        nvml_version=as_str(data.get("nvml_version")),
        kmsg=tuple(str(x) for x in kmsg) if isinstance(kmsg, list) else None,
        source=source or str(data.get("source") or ""),
        errors={str(k): str(v) for k, v in (data.get("errors") or {}).items()},
        init_error=str(init_error) if init_error not in (None, "") else None,
        hang=dict(hang) if isinstance(hang, dict) else ({"call": str(hang)} if hang else None),
        uptime_s=as_float(data.get("uptime_s")),
        recheck_after_s=as_float(recheck.get("after_s")),
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


def write_snapshot(path: Path, data: dict[str, Any]) -> None:
    """Write a snapshot as readable JSON (atomically when the directory allows it)."""
    from bluevela.util.fs import atomic_write

    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    atomic_write(path, text.encode(), 0o644)


def header(source: str) -> dict[str, Any]:
    """A new snapshot's top: format, source, when and where it was recorded."""
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
