"""The last result of each check as Prometheus text, for node_exporter's textfile collector.

`<metrics dir>/bluevela.prom` is rewritten atomically (temp file, fsync, rename) after every
hook run, from `last_results.json` in the state dir, so a check that the last run did not
include (nccl after a quick prolog) keeps its last value. Families (docs/health.md lists them)::

    bluevela_check_status{check="ib"} 0          # 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN
    bluevela_check_timestamp_seconds{check="ib"} 1.7e9
    bluevela_check_duration_seconds{check="ib"} 0.004
    bluevela_node_status 0                         # worst over the checks
    bluevela_ib_symbol_error_total 0              # each check metric, in base units
    bluevela_gpu_temp_celsius{gpu="0",UUID="GPU-...",pci_bus_id="...",...} 33
    bluevela_infiniband_link_downed_total{device="mlx5_0",port="1"} 0
    bluevela_versions_info{driver="550.90.07",kernel="6.1.0-18-amd64",...} 1

Per-GPU and per-port series come from the checks' `components` and are named after
dcgm-exporter's fields (`DCGM_FI_DEV_GPU_TEMP` -> `bluevela_gpu_temp_celsius`) and
node_exporter's infiniband collector (`node_infiniband_link_downed_total` ->
`bluevela_infiniband_link_downed_total`), with their label sets, `bluevela_`-prefixed so they
never clash with the real exporters on the same node, and in Prometheus base units.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bluevela.errors import UnsafeValueError
from bluevela.health.result import CheckResult, HealthReport, Status, worst
from bluevela.health.state import LAST_RESULTS, read_json, write_json
from bluevela.util.fs import atomic_write, ensure_dir

logger = logging.getLogger(__name__)

PROM_FILE = "bluevela.prom"
_BAD = re.compile(r"[^a-zA-Z0-9_]")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


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


def _labels(pairs: Mapping[str, str]) -> str:
    body = ",".join(f'{k}="{_label(v)}"' for k, v in pairs.items() if _LABEL_NAME.match(k))
    return f"{{{body}}}" if body else ""


def family_lines(name: str, type_: str, help_: str,
                 samples: Sequence[tuple[Mapping[str, str], float]]) -> list[str]:
    """One family in the text format: HELP, TYPE, then a line per (labels, value)."""
    out = [f"# HELP {name} {_help(help_)}", f"# TYPE {name} {type_}"]
    out.extend(f"{name}{_labels(labels)} {_num(v)}" for labels, v in samples)
    return out


# -- node-level check metrics: the unit suffix bluevela uses -> Prometheus base unit --------

# (suffix in CheckResult.metrics, suffix in Prometheus, factor)
_UNITS: tuple[tuple[str, str, float], ...] = (
    ("_gbps", "_bytes_per_second", 1e9 / 8),  # Gbit/s (IB link rate)
    ("_gbs", "_bytes_per_second", 1e9),  # GB/s (NCCL bus bandwidth)
    ("_per_h", "_per_second", 1 / 3600),
    ("_gib", "_bytes", 2.0**30),
    ("_ms", "_seconds", 1e-3),
    ("_s", "_seconds", 1.0),
    ("_c", "_celsius", 1.0),
    ("_w", "_watts", 1.0),
    ("_j", "_joules", 1.0),
)
# node-level sums of hardware counters that carry no `_total` in CheckResult.metrics
_COUNTER_RENAMES = {"port_rcv_data_bytes": "port_rcv_data_bytes_total",
                    "port_xmit_data_bytes": "port_xmit_data_bytes_total",
                    "energy_j": "energy_joules_total"}
# sums that mean nothing on a node (hw_counters/lifespan is each port's refresh period)
_NODE_SKIP = frozenset({"lifespan_total"})


def node_metric(check: str, metric: str, value: float) -> tuple[str, str, float]:
    """(Prometheus name, type, value) of one node-level check metric: base units, `_total`
    (and type counter) only for sums of counters."""
    if metric in _COUNTER_RENAMES:
        return f"bluevela_{_name(check)}_{_COUNTER_RENAMES[metric]}", "counter", value
    if metric.endswith("_total"):
        return f"bluevela_{_name(check)}_{_name(metric)}", "counter", value
    for old, new, factor in _UNITS:
        if metric.endswith(old):
            return (f"bluevela_{_name(check)}_{_name(metric[: -len(old)])}{new}", "gauge",
                    value * factor)
    return f"bluevela_{_name(check)}_{_name(metric)}", "gauge", value


# -- per-component families ------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """One per-component family: the component value it reads, scaled, and its meaning."""

    name: str
    type: str
    key: str
    help: str
    like: str  # the dcgm-exporter / node_exporter metric of the same meaning
    factor: float = 1.0


GPU_FAMILIES: tuple[Family, ...] = (
    Family("bluevela_gpu_temp_celsius", "gauge", "temperature_c", "GPU temperature.",
           "DCGM_FI_DEV_GPU_TEMP"),
    Family("bluevela_gpu_power_usage_watts", "gauge", "power_w", "GPU power draw.",
           "DCGM_FI_DEV_POWER_USAGE"),
    Family("bluevela_gpu_enforced_power_limit_watts", "gauge", "power_limit_w",
           "GPU enforced power limit.", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"),
    Family("bluevela_gpu_total_energy_consumption_joules_total", "counter", "energy_j",
           "GPU energy since the driver loaded.", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)"),
    Family("bluevela_gpu_fb_used_bytes", "gauge", "memory_used_bytes", "GPU memory used.",
           "DCGM_FI_DEV_FB_USED (MiB)"),
    Family("bluevela_gpu_fb_total_bytes", "gauge", "memory_total_bytes", "GPU memory size.",
           "DCGM_FI_DEV_FB_TOTAL (MiB)"),
    Family("bluevela_gpu_ecc_dbe_vol_total", "counter", "ecc_uncorrected_volatile",
           "Uncorrected ECC errors since the driver loaded.", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
    Family("bluevela_gpu_ecc_dbe_agg_total", "counter", "ecc_uncorrected_aggregate",
           "Uncorrected ECC errors over the GPU's life.", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"),
    Family("bluevela_gpu_retired_sbe", "gauge", "retired_pages_sbe",
           "Pages retired for single-bit errors.", "DCGM_FI_DEV_RETIRED_SBE"),
    Family("bluevela_gpu_retired_dbe", "gauge", "retired_pages_dbe",
           "Pages retired for double-bit errors.", "DCGM_FI_DEV_RETIRED_DBE"),
    Family("bluevela_gpu_retired_pending", "gauge", "retired_pages_pending",
           "1 when a page retirement waits for a GPU reset.", "DCGM_FI_DEV_RETIRED_PENDING"),
    Family("bluevela_gpu_correctable_remapped_rows", "gauge", "remapped_rows_correctable",
           "Rows remapped for correctable errors.", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
    Family("bluevela_gpu_uncorrectable_remapped_rows", "gauge", "remapped_rows_uncorrectable",
           "Rows remapped for uncorrectable errors.",
           "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
    Family("bluevela_gpu_row_remap_pending", "gauge", "remapped_rows_pending",
           "1 when a row remap waits for a GPU reset.", "DCGM_FI_DEV_ROW_REMAP_PENDING"),
    Family("bluevela_gpu_row_remap_failure", "gauge", "remapped_rows_failure",
           "1 when a row remap failed.", "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
    Family("bluevela_gpu_clock_throttle_reasons", "gauge", "clocks_event_reasons",
           "NVML clocks event (throttle) reasons bitmask.",
           "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
    Family("bluevela_gpu_pcie_link_gen", "gauge", "pcie_link_gen_current",
           "Current PCIe link generation.", "DCGM_FI_DEV_PCIE_LINK_GEN"),
    Family("bluevela_gpu_pcie_link_width", "gauge", "pcie_link_width_current",
           "Current PCIe link width (lanes).", "DCGM_FI_DEV_PCIE_LINK_WIDTH"),
    Family("bluevela_gpu_persistence_mode", "gauge", "persistence_mode",
           "1 when persistence mode is on.", "DCGM_FI_DEV_PERSISTENCE_MODE"),
    Family("bluevela_gpu_xid_errors", "gauge", "xid_last",
           "Last XID on the GPU within gpu.xid_window_s (0: none).", "DCGM_FI_DEV_XID_ERRORS"),
    Family("bluevela_gpu_xid_critical", "gauge", "xid_critical_last",
           "Last XID on the GPU within gpu.xid_window_s that bv drains for (0: none).", "-"),
    Family("bluevela_gpu_xid_window_errors", "gauge", "xid_count",
           "XIDs on the GPU within gpu.xid_window_s.", "-"),
    Family("bluevela_gpu_xid_fallen_off_bus", "gauge", "xid_fallen_off_bus",
           "1 when the GPU's PCI address logged XID 79 (fallen off the bus) within "
           "gpu.xid_window_s; also for an address NVML no longer lists.", "-"),
    Family("bluevela_gpu_foreign_processes", "gauge", "processes_count",
           "Compute processes on the GPU that are not the job's.", "-"),
    Family("bluevela_gpu_nvlink_down", "gauge", "nvlink_down_count",
           "NVLinks of the GPU that are down.", "-"),
    *(Family(f"bluevela_gpu_nvlink_{name}_error_count_total", "counter", f"nvlink_{name}_total",
             f"NVLink {name} errors over all links since the driver loaded.",
             f"DCGM_FI_DEV_NVLINK_{name.upper()}_ERROR_COUNT_TOTAL")
      for name in ("crc_flit", "crc_data", "replay", "recovery")),
    Family("bluevela_gpu_ecc_sram_uncorrected_vol_total", "counter",
           "ecc_sram_uncorrected_volatile", "SRAM uncorrected ECC errors since the driver loaded.",
           "-"),
    Family("bluevela_gpu_fabric_state", "gauge", "fabric_state",
           "NVML GpuFabricInfo state (3 COMPLETED, 2 IN_PROGRESS, 1 NOT_STARTED, 0 none).", "-"),
)

# node_exporter's infiniband collector: sysfs counter -> metric (data counters in 4-byte words)
_IB_COUNTERS: dict[str, tuple[str, float]] = {
    "port_rcv_data": ("port_data_received_bytes_total", 4.0),
    "port_xmit_data": ("port_data_transmitted_bytes_total", 4.0),
    "port_rcv_packets": ("port_packets_received_total", 1.0),
    "port_xmit_packets": ("port_packets_transmitted_total", 1.0),
    "unicast_rcv_packets": ("unicast_packets_received_total", 1.0),
    "unicast_xmit_packets": ("unicast_packets_transmitted_total", 1.0),
    "multicast_rcv_packets": ("multicast_packets_received_total", 1.0),
    "multicast_xmit_packets": ("multicast_packets_transmitted_total", 1.0),
    "link_downed": ("link_downed_total", 1.0),
    "link_error_recovery": ("link_error_recovery_total", 1.0),
    "symbol_error": ("symbol_error_total", 1.0),
    "port_rcv_errors": ("port_errors_received_total", 1.0),
    "port_rcv_remote_physical_errors": ("port_receive_remote_physical_errors_total", 1.0),
    "port_rcv_switch_relay_errors": ("port_receive_switch_relay_errors_total", 1.0),
    "port_rcv_constraint_errors": ("port_constraint_errors_received_total", 1.0),
    "port_xmit_constraint_errors": ("port_constraint_errors_transmitted_total", 1.0),
    "port_xmit_discards": ("port_transmit_discards_total", 1.0),
    "port_xmit_wait": ("port_transmit_wait_total", 1.0),
    "excessive_buffer_overrun_errors": ("excessive_buffer_overrun_errors_total", 1.0),
    "local_link_integrity_errors": ("local_link_integrity_errors_total", 1.0),
    "VL15_dropped": ("vl15_dropped_total", 1.0),
}
_IB_GAUGES: dict[str, tuple[str, float, str]] = {
    "state_id": ("state_id", 1.0, "IB port state (1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE)."),
    "phys_state_id": ("physical_state_id", 1.0,
                      "IB physical port state (2 Polling, 3 Disabled, 5 LinkUp, ...)."),
    "rate_gbps": ("rate_bytes_per_second", 1e9 / 8, "IB port link rate."),
}
_HW_NOT_COUNTERS = frozenset({"lifespan"})  # a refresh period (ms), not a count
# The PMA PortCounters error fields and their widths, as the kernel reads them into sysfs
# (drivers/infiniband/core/sysfs.c, PORT_PMA_ATTR): 4, 8 or 16 bits. The IBA spec has them
# stop at all ones, not wrap, so a saturated counter never rises again and `increase()` reads
# 0 on the worst ports: `bluevela_infiniband_counter_saturated` says so instead. (The data and
# packet counters are 64-bit through PortCountersExtended; port_xmit_wait is a 32-bit congestion
# count, not an error.)
IB_COUNTER_MAX: dict[str, int] = {
    "symbol_error": 0xFFFF,
    "link_error_recovery": 0xFF,
    "link_downed": 0xFF,
    "port_rcv_errors": 0xFFFF,
    "port_rcv_remote_physical_errors": 0xFFFF,
    "port_rcv_switch_relay_errors": 0xFFFF,
    "port_xmit_discards": 0xFFFF,
    "port_xmit_constraint_errors": 0xFF,
    "port_rcv_constraint_errors": 0xFF,
    "local_link_integrity_errors": 0xF,
    "excessive_buffer_overrun_errors": 0xF,
    "VL15_dropped": 0xFFFF,
}
IB_SATURATED = "bluevela_infiniband_counter_saturated"


def _gpu_labels(labels: Mapping[str, str], hostname: str) -> dict[str, str]:
    """dcgm-exporter's label set: gpu, UUID, pci_bus_id, device, modelName, Hostname."""
    gpu = labels.get("gpu", "")
    # A GPU NVML no longer lists (fallen off the bus) has only its PCI address: no index,
    # UUID or device node.
    out = {"gpu": gpu, "UUID": labels.get("uuid", ""),
           "pci_bus_id": labels.get("pci_bus_id", ""),
           "device": f"nvidia{gpu}" if gpu else "", "modelName": labels.get("model", ""),
           "Hostname": hostname}
    return {k: v for k, v in out.items() if v}


def _component_samples(results: list[CheckResult], hostname: str
                       ) -> dict[str, tuple[str, str, list[tuple[str, float]]]]:
    """{family name: (type, help, [(labels, value)])} of every check's components."""
    fams: dict[str, tuple[str, str, list[tuple[str, float]]]] = {}

    def add(name: str, type_: str, help_: str, labels: str, value: float) -> None:
        fams.setdefault(name, (type_, help_, []))[2].append((labels, value))

    for r in results:
        for comp in r.components:
            values: Mapping[str, float] = comp["values"]
            if comp["kind"] == "gpu":
                lab = _labels(_gpu_labels(comp["labels"], hostname))
                for f in GPU_FAMILIES:
                    if f.key in values:
                        add(f.name, f.type, f.help, lab, values[f.key] * f.factor)
            elif comp["kind"] == "ib_port":
                port = {"device": comp["labels"].get("device", ""),
                        "port": comp["labels"].get("port", "")}
                lab = _labels(port)
                for key, v in values.items():
                    if key.startswith("counter_"):
                        raw = key[len("counter_"):]
                        name, factor = _IB_COUNTERS.get(raw, (f"{_name(raw)}_total", 1.0))
                        add(f"bluevela_infiniband_{name}", "counter",
                            f"InfiniBand port counter {raw}.", lab, v * factor)
                        if raw in IB_COUNTER_MAX:
                            add(IB_SATURATED, "gauge",
                                "1 when the port's error counter stopped at its maximum (PMA "
                                "widths: 4, 8 or 16 bits); increase() no longer sees it rise.",
                                _labels({**port, "counter": raw}),
                                1.0 if v >= IB_COUNTER_MAX[raw] else 0.0)
                    elif key.startswith("hw_counter_"):
                        raw = key[len("hw_counter_"):]
                        if raw not in _HW_NOT_COUNTERS:
                            add(f"bluevela_infiniband_hw_{_name(raw)}_total", "counter",
                                f"InfiniBand port hw_counters/{raw}.", lab, v)
                    elif key in _IB_GAUGES:
                        name, factor, help_ = _IB_GAUGES[key]
                        add(f"bluevela_infiniband_{name}", "gauge", help_, lab, v * factor)
    return fams


def merge_last_results(state_dir: Path, report: HealthReport, phase: str) -> dict[str, Any]:
    """Merge `report`'s results into `last_results.json`; return the merged mapping."""
    stored = read_json(state_dir / LAST_RESULTS)
    merged: dict[str, Any] = stored if isinstance(stored, dict) else {}
    now = time.time()
    for r in report.checks:
        merged[r.name] = {**r.to_dict(components=True), "time": now, "phase": phase}
    write_json(state_dir / LAST_RESULTS, merged)
    return merged


@dataclass(frozen=True)
class NodeFacts:
    """What the site says this node should be (the alerts compare it with what the checks saw)."""

    class_name: str
    gpus: int


def render(last: Mapping[str, Mapping[str, Any]], hostname: str | None = None,
           node: NodeFacts | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of the last results.

    Args:
        last: check name -> stored result (`last_results.json`).
        hostname: the `Hostname` label of per-GPU series (default: this host's).
        node: the node's class and expected GPU count, as `bluevela_node_class_info` and
            `bluevela_node_gpus_expected` (the GPU-missing alert compares it with
            `bluevela_gpu_gpus_count`); omitted when None.
    """
    host = hostname if hostname is not None else os.uname().nodename
    results = _stored_results(last)
    out = _Exposition()
    _check_families(out, results)
    if node is not None:
        out.family("bluevela_node_class_info", "The node's class in site.yaml (value 1).",
                   [(_labels({"class": node.class_name}), 1)])
        out.family("bluevela_node_gpus_expected", "GPUs the node's class in site.yaml expects.",
                   [("", node.gpus)])
    checks = [r for r, _ in results]
    for name, (type_, help_, samples) in sorted(_component_samples(checks, host).items()):
        out.family(name, help_, samples, type_)
    return out.text()


def _stored_results(last: Mapping[str, Mapping[str, Any]]) -> list[tuple[CheckResult, float]]:
    """The stored results, by check name, each with the time it ran.

    A malformed entry (a `last_results.json` from another release, a hand edit) is skipped,
    so that one bad entry never hides every other check's series.
    """
    results: list[tuple[CheckResult, float]] = []
    for name in sorted(last):
        try:
            results.append((CheckResult.from_dict(last[name]), float(last[name].get("time", 0))))
        except (KeyError, ValueError, TypeError, AttributeError):
            logger.debug("skipping malformed last result %r", name)
    return results


class _Exposition:
    """The text exposition being written: metric families in order, each name once.

    Names are sanitised from check and metric names, so two may meet; Prometheus refuses a
    file that declares a family twice, so the first one wins and the other is dropped.
    """

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._seen: set[str] = set()

    def family(self, name: str, help_: str, samples: list[tuple[str, float]],
               type_: str = "gauge") -> None:
        """Add a family (HELP, TYPE, one line per sample); nothing when it has no samples."""
        if not samples:
            return
        if name in self._seen:  # two metrics that sanitise to one name: keep the first
            logger.debug("duplicate metric family %s skipped", name)
            return
        self._seen.add(name)
        self._lines.append(f"# HELP {name} {help_}")
        self._lines.append(f"# TYPE {name} {type_}")
        self._lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _check_families(out: _Exposition, results: list[tuple[CheckResult, float]]) -> None:
    """The per-check families: status, time and duration of each check, the node's worst
    status, each check's node-level metrics, and its text facts as an info series."""
    checks = [r for r, _ in results]
    out.family("bluevela_check_status",
               "Last status of each bluevela health check (0 OK, 1 WARNING, 2 CRITICAL, "
               "3 UNKNOWN).",
               [(_labels({"check": r.name}), int(r.status)) for r in checks])
    out.family("bluevela_check_timestamp_seconds", "When each check last ran (unix seconds).",
               [(_labels({"check": r.name}), t) for r, t in results])
    out.family("bluevela_check_duration_seconds", "Wall time of each check's last run.",
               [(_labels({"check": r.name}), r.duration_s) for r in checks])
    out.family("bluevela_node_status", "Worst status over the last result of every check.",
               [("", int(worst(r.status for r in checks)) if checks else int(Status.UNKNOWN))])
    for r in checks:
        for metric in sorted(set(r.metrics) - _NODE_SKIP):
            prom, type_, value = node_metric(r.name, metric, r.metrics[metric])
            out.family(prom, f"bluevela {_help(r.name)} check: {_help(metric)} (node).",
                       [("", value)], type_)
    for r in checks:  # text facts (the versions check's) as an info series, value 1
        if r.info:
            out.family(f"bluevela_{_name(r.name)}_info",
                       f"bluevela {_help(r.name)} check: observed values as labels.",
                       [(_labels(r.info), 1)])


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def write_prom(metrics_dir: Path, last: Mapping[str, Mapping[str, Any]],
               node: NodeFacts | None = None) -> Path | None:
    """Write `<metrics_dir>/bluevela.prom` atomically; None (logged) when it cannot."""
    path = metrics_dir / PROM_FILE
    try:
        ensure_dir(metrics_dir, 0o755)
        atomic_write(path, render(last, node=node).encode(), 0o644)
    except (OSError, UnsafeValueError) as exc:
        logger.warning("cannot write %s: %s", path, exc)
        return None
    return path
