"""The `promtool test rules` cases of bluevela's alerts, and the writer of their test file.

Every alert gets three cases: it FIRES on the fault (after its `for:`), it stays SILENT on the
healthy series, and it stays SILENT on noise: one bad scrape among good ones for a state, a
counter reset or a rise below the threshold for a counter, a busy node for the stale file.
An alert that reads the fleet view (`gated`) gets a fresh, successful one with every input,
and three more cases where its fault is there but the view is not: Slurm did not answer (the
file holds only `scrape_success 0`), the file is old, the file is gone; it must stay SILENT in
each (BluevelaFleetViewStale fires instead, and has cases of its own for the same three).
The expected annotations are rendered here from the rule file's templates (a small renderer
of the few template forms the rules use), so promtool checks the text a person reads, too.

Regenerate the committed file after changing a rule or a case:

    python3 -m tests.monitoring_cases > prolog_epilog/prometheus/tests/bluevela.rules.test.yml
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RULES_DIR = REPO / "prolog_epilog" / "prometheus"
RULE_FILES = ("../bluevela.rules.yml", "../bluevela.recording.yml")
TEST_FILE = RULES_DIR / "tests" / "bluevela.rules.test.yml"

N2 = {"node": "node2", "instance": "node2:9100", "job": "node"}
N1 = {"node": "node1", "instance": "node1:9100", "job": "node"}
FLEET = {"instance": "ctl:9100", "job": "bluevela-fleet"}
GPU3 = {"gpu": "3", "UUID": "GPU-3", "pci_bus_id": "00000000:5D:00.0", "device": "nvidia3"}
GPU1 = {"gpu": "1", "UUID": "GPU-1", "pci_bus_id": "00000000:1B:00.0", "device": "nvidia1"}
# A GPU NVML no longer lists: its XID series carry the PCI address alone (checks/gpu.py).
GONE = {"pci_bus_id": "00000000:DB:00.0"}
PORT = {"device": "mlx5_3", "port": "1"}
PROM = "/var/lib/node_exporter/textfile/bluevela.prom"


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


@dataclass
class Case:
    """One alert's fault, healthy and noisy inputs; the alert's labels and value when firing."""

    alert: str
    fault: list[dict[str, str]]
    healthy: list[dict[str, str]]
    noisy: list[dict[str, str]]
    at: str  # eval time at which the fault has outlasted `for:`
    labels: dict[str, str]  # the firing series' labels (before the rule's own)
    value: float
    extra: list[dict[str, str]] = field(default_factory=list)  # common to all three inputs
    variant: str = ""  # a second case of the same alert: its name's suffix


# The gate every alert that reads the fleet view carries (bluevela.rules.yml's header).
FLEET_GATE = "bluevela_fleet_scrape_success == 1"


FLEET_FAMILIES = ("bluevela_slurm_", "bluevela_breaker_")


def fleet_ok(minutes: int) -> list[dict[str, str]]:
    """A fleet file rewritten every minute, Slurm answering."""
    return [series("bluevela_fleet_scrape_success", FLEET, f"1x{minutes}"),
            series("bluevela_fleet_timestamp_seconds", FLEET, f"0+60x{minutes}")]


def _without_fleet(inputs: list[dict[str, str]]) -> list[dict[str, str]]:
    return [i for i in inputs if not i["series"].startswith(FLEET_FAMILIES)]


def fleet_faults(inputs: list[dict[str, str]], minutes: int
                 ) -> list[tuple[str, list[dict[str, str]]]]:
    """(kind, inputs) of a gated alert's fault without a fresh, successful fleet view."""
    return [
        # What fleet_metrics writes when sinfo fails: no node families, a fresh timestamp.
        ("silent when Slurm does not answer", _without_fleet(inputs) + [
            series("bluevela_fleet_scrape_success", FLEET, f"0x{minutes}"),
            series("bluevela_fleet_timestamp_seconds", FLEET, f"0+60x{minutes}")]),
        # The writer stopped an hour ago; node_exporter still serves its last file.
        ("silent on an old fleet view", inputs + [
            series("bluevela_fleet_scrape_success", FLEET, f"1x{minutes}"),
            series("bluevela_fleet_timestamp_seconds", FLEET, f"-3600x{minutes}")]),
        ("silent without a fleet view", _without_fleet(inputs)),
    ]


def _up(n: str, at: int) -> dict[str, str]:
    return series("bluevela_node_status", {"node": n, "instance": f"{n}:9100", "job": "node"},
                  f"0x{at}")


CASES: list[Case] = [
    Case("BluevelaCheckCritical",
         [series("bluevela_check_status", {**N2, "check": "ib"}, "0 0 2x10")],
         [series("bluevela_check_status", {**N2, "check": "ib"}, "0x12")],
         [series("bluevela_check_status", {**N2, "check": "ib"}, "0 0 2 0x9")],
         "8m", {**N2, "check": "ib"}, 2),
    Case("BluevelaCheckUnknown",
         [series("bluevela_check_status", {**N2, "check": "gpu"}, "0 3x30")],
         [series("bluevela_check_status", {**N2, "check": "gpu"}, "0x31")],
         [series("bluevela_check_status", {**N2, "check": "gpu"}, "0 3x5 0x25")],
         "25m", {**N2, "check": "gpu"}, 3),
    Case("BluevelaGpuMissing",
         [series("bluevela_gpu_gpus_count", N2, "8 7x10")],
         [series("bluevela_gpu_gpus_count", N2, "8x11")],
         [series("bluevela_gpu_gpus_count", N2, "8 7 8x9")],
         "8m", N2, 7,
         extra=[series("bluevela_node_gpus_expected", N2, "8x11")]),
    # The GPU at DB:00 fell off the bus: NVML lists 7 GPUs, the XID 79 (then 154, reboot
    # required: the last XID is no longer 79) is on a series of its PCI address alone.
    Case("BluevelaGpuFallenOffBus",
         [series("bluevela_gpu_xid_fallen_off_bus", {**N2, **GONE}, "_ 1x10"),
          series("bluevela_gpu_xid_errors", {**N2, **GONE}, "_ 154x10")],
         [series("bluevela_gpu_xid_fallen_off_bus", {**N2, **GPU3}, "0x11")],
         [series("bluevela_gpu_xid_fallen_off_bus", {**N2, **GPU3}, "0 1 0x9")],
         "8m", {**N2, **GONE}, 1),
    # A GPU NVML still lists (the XID just logged): the same alert, the same flag.
    Case("BluevelaGpuFallenOffBus",
         [series("bluevela_gpu_xid_fallen_off_bus", {**N2, **GPU3}, "0 1x10")],
         [], [],
         "8m", {**N2, **GPU3}, 1, variant="still listed"),
    Case("BluevelaGpuXidNeedsReset",
         [series("bluevela_gpu_xid_critical", {**N2, **GPU3}, "0 48x10")],
         # XID 13 (an application's graphics exception) needs no reset: the check writes 0;
         # 79 (fallen off the bus) has its own alert.
         [series("bluevela_gpu_xid_errors", {**N2, **GPU3}, "0 13x10"),
          series("bluevela_gpu_xid_critical", {**N2, **GPU3}, "0x11"),
          series("bluevela_gpu_xid_critical", {**N2, **GPU1}, "0 79x10")],
         [series("bluevela_gpu_xid_critical", {**N2, **GPU3}, "0 48 0x9")],
         "8m", {**N2, **GPU3}, 48),
    Case("BluevelaGpuRowRemapPending",
         [series("bluevela_gpu_row_remap_pending", {**N2, **GPU3}, "0 1x12")],
         [series("bluevela_gpu_row_remap_pending", {**N2, **GPU3}, "0x13")],
         [series("bluevela_gpu_row_remap_pending", {**N2, **GPU3}, "0 1 0x11")],
         "10m", {**N2, **GPU3}, 1),
    Case("BluevelaGpuRowRemapFailed",
         [series("bluevela_gpu_row_remap_failure", {**N2, **GPU3}, "0 1x10")],
         [series("bluevela_gpu_row_remap_failure", {**N2, **GPU3}, "0x11")],
         [series("bluevela_gpu_row_remap_failure", {**N2, **GPU3}, "0 1 0x9")],
         "8m", {**N2, **GPU3}, 1),
    Case("BluevelaGpuNvlinkDown",
         [series("bluevela_gpu_nvlink_down", {**N2, **GPU3}, "0 1x10")],
         [series("bluevela_gpu_nvlink_down", {**N2, **GPU3}, "0x11")],
         [series("bluevela_gpu_nvlink_down", {**N2, **GPU3}, "0 1 0x9")],
         "8m", {**N2, **GPU3}, 1),
    Case("BluevelaGpuNvlinkErrorsRising",
         [series("bluevela_gpu_nvlink_recovery_error_count_total", {**N2, **GPU3}, "0x10 4x50"),
          series("bluevela_gpu_nvlink_replay_error_count_total", {**N2, **GPU3}, "0x61")],
         [series("bluevela_gpu_nvlink_recovery_error_count_total", {**N2, **GPU3}, "5x61"),
          series("bluevela_gpu_nvlink_replay_error_count_total", {**N2, **GPU3}, "0x61")],
         # A driver reload resets the counters to 0: not a rise.
         [series("bluevela_gpu_nvlink_recovery_error_count_total", {**N2, **GPU3}, "5x10 0x50"),
          series("bluevela_gpu_nvlink_replay_error_count_total", {**N2, **GPU3}, "0x61")],
         "30m", {**N2, **GPU3}, 4),
    Case("BluevelaIbPortDown",
         [series("bluevela_infiniband_state_id", {**N2, **PORT}, "4 1x10")],
         [series("bluevela_infiniband_state_id", {**N2, **PORT}, "4x11")],
         [series("bluevela_infiniband_state_id", {**N2, **PORT}, "4 1 4x9")],
         "8m", {**N2, **PORT}, 1),
    Case("BluevelaIbPortDegraded",
         [series("bluevela_infiniband_rate_bytes_per_second", {**N2, **PORT}, "5e10 2.5e10x12")],
         [series("bluevela_infiniband_rate_bytes_per_second", {**N2, **PORT}, "5e10x13")],
         [series("bluevela_infiniband_rate_bytes_per_second", {**N2, **PORT}, "5e10 2.5e10 5e10x11")],
         "10m", {**N2, **PORT}, 2.5e10,
         extra=[series("bluevela_infiniband_rate_bytes_per_second",
                       {**N2, "device": "mlx5_0", "port": "1"}, "5e10x13"),
                series("bluevela_infiniband_state_id", {**N2, **PORT}, "4x13")]),
    # A port that is DOWN (its rate falls too) is BluevelaIbPortDown's, not this alert's.
    Case("BluevelaIbPortDegraded",
         [], [],
         [series("bluevela_infiniband_rate_bytes_per_second", {**N2, **PORT}, "5e10 1e9x12"),
          series("bluevela_infiniband_state_id", {**N2, **PORT}, "4 1x12")],
         "10m", {}, 0,
         extra=[series("bluevela_infiniband_rate_bytes_per_second",
                       {**N2, "device": "mlx5_0", "port": "1"}, "5e10x13")],
         variant="port down"),
    Case("BluevelaIbLinkFlapping",
         [series("bluevela_infiniband_link_downed_total", {**N2, **PORT}, "0x10 2x50")],
         [series("bluevela_infiniband_link_downed_total", {**N2, **PORT}, "3x61")],
         [series("bluevela_infiniband_link_downed_total", {**N2, **PORT}, "3x10 0x50")],
         "30m", {**N2, **PORT}, 2),
    Case("BluevelaIbErrorsRising",
         [series("bluevela_infiniband_symbol_error_total", {**N2, **PORT}, "0x10 50x50")],
         [series("bluevela_infiniband_symbol_error_total", {**N2, **PORT}, "7x61")],
         # 3 symbol errors in an hour: below the 10/h threshold.
         [series("bluevela_infiniband_symbol_error_total", {**N2, **PORT}, "0x10 3x50")],
         "30m", {"node": "node2", **PORT}, 50,
         extra=[series(f"bluevela_infiniband_{c}_total", {**N2, **PORT}, "0x61")
                for c in ("link_error_recovery", "port_errors_received",
                          "local_link_integrity_errors", "excessive_buffer_overrun_errors")]),
    Case("BluevelaIbCounterSaturated",
         [series("bluevela_infiniband_counter_saturated",
                 {**N2, **PORT, "counter": "link_downed"}, "0 1x12")],
         [series("bluevela_infiniband_counter_saturated",
                 {**N2, **PORT, "counter": "link_downed"}, "0x13")],
         [series("bluevela_infiniband_counter_saturated",
                 {**N2, **PORT, "counter": "link_downed"}, "0 1 0x11")],
         "10m", {**N2, **PORT, "counter": "link_downed"}, 1),
    # The file was last written 2 h 59 min before the test starts (not 4 h of samples: the
    # six cases of this alert were a third of promtool's time): 3 h old from minute 1.
    Case("BluevelaMetricsStale",
         [series("node_textfile_mtime_seconds", {**N2, "file": PROM}, "-10740x20"),
          series("bluevela_slurm_node_busy", {**FLEET, "node": "node2"}, "0x20")],
         [series("node_textfile_mtime_seconds", {**N2, "file": PROM}, "0+60x20"),
          series("bluevela_slurm_node_busy", {**FLEET, "node": "node2"}, "0x20")],
         # A node running a long job: its file ages, nothing is wrong.
         [series("node_textfile_mtime_seconds", {**N2, "file": PROM}, "-10740x20"),
          series("bluevela_slurm_node_busy", {**FLEET, "node": "node2"}, "1x20")],
         "15m", {**N2, "file": PROM}, 11640),
    Case("BluevelaMetricsMissing",
         [series("up", N2, "1x60")],
         [series("up", N2, "1x60"),
          series("node_textfile_mtime_seconds", {**N2, "file": PROM}, "0x60")],
         # The file missing for one scrape (a rename caught mid-way) is not missing.
         [series("up", N2, "1x60"),
          series("node_textfile_mtime_seconds", {**N2, "file": PROM}, "0x10 stale 0x49")],
         "45m", N2, 1),
    Case("BluevelaTextfileScrapeError",
         [series("node_textfile_scrape_error", N2, "0 1x30")],
         [series("node_textfile_scrape_error", N2, "0x31")],
         [series("node_textfile_scrape_error", N2, "0 1 0x29")],
         "20m", N2, 1),
    Case("BluevelaNodeDrained",
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node2", "class": "h100", "source": "bv",
                  "reason": "bv: ib: mlx5_3/1 state DOWN"}, "_ 1x10")],
         [],
         # An operator's drain is the operator's business: no bluevela alert.
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node2", "class": "h100", "source": "operator",
                  "reason": "maint: dimm swap"}, "_ 1x10")],
         "5m", {**FLEET, "node": "node2", "class": "h100", "source": "bv",
                "reason": "bv: ib: mlx5_3/1 state DOWN"}, 1,
         extra=[series("bluevela_slurm_node_info", {**FLEET, "node": "node2", "class": "h100"},
                       "1x11")]),
    Case("BluevelaNightlyRegression",
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node2", "class": "h100", "source": "nightly",
                  "reason": "bv: nightly 2026-11-26: gemm 612 TFLOP/s < 700"}, "_ 1x10")],
         [],
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node2", "class": "h100", "source": "bv",
                  "reason": "bv: gpu: GPU4 row remap pending"}, "_ 1x10")],
         "5m", {**FLEET, "node": "node2", "class": "h100", "source": "nightly",
                "reason": "bv: nightly 2026-11-26: gemm 612 TFLOP/s < 700"}, 1),
    Case("BluevelaClassDrainedHigh",
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": f"node{i}", "class": "h100", "source": "bv",
                  "reason": "bv: ib: x"}, "_ 1x30") for i in (1, 2)],
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node1", "class": "h100", "source": "bv",
                  "reason": "bv: ib: x"}, "_ 1x30")],
         # 2 of 10 drained for 5 minutes only (drained, then resumed): not 15 minutes.
         [series("bluevela_slurm_node_drained",
                 {**FLEET, "node": f"node{i}", "class": "h100", "source": "bv",
                  "reason": "bv: ib: x"}, "_ 1x5 _x25") for i in (1, 2)],
         "25m", {"class": "h100"}, 0.2,
         extra=[series("bluevela_slurm_node_info", {**FLEET, "node": f"node{i}", "class": "h100"},
                       "1x31") for i in range(1, 11)]),
    Case("BluevelaFleetBreakerFull",
         [series("bluevela_breaker_drained_nodes", {**FLEET, "partition": "gpu"}, "0 2x10")],
         [series("bluevela_breaker_drained_nodes", {**FLEET, "partition": "gpu"}, "0 1x10")],
         [series("bluevela_breaker_drained_nodes", {**FLEET, "partition": "gpu"}, "0 2 1x9")],
         "8m", {**FLEET, "partition": "gpu"}, 2,
         extra=[series("bluevela_breaker_limit_nodes", {**FLEET, "partition": "gpu"}, "2x11")]),
    Case("BluevelaCriticalNodeNotDrained",
         [series("bluevela_node_status", N2, "0 2x20")],
         [series("bluevela_node_status", N2, "0 2x20"),
          series("bluevela_slurm_node_drained",
                 {**FLEET, "node": "node2", "class": "h100", "source": "bv",
                  "reason": "bv: ib: x"}, "_ 1x20")],
         [series("bluevela_node_status", N2, "0 2x3 0x17")],
         "15m", {"node": "node2"}, 2),
    Case("BluevelaFleetViewStale",
         [series("bluevela_fleet_scrape_success", FLEET, "1 0x20"),
          series("bluevela_fleet_timestamp_seconds", FLEET, "0+60x20")],
         [series("bluevela_fleet_scrape_success", FLEET, "1x21"),
          series("bluevela_fleet_timestamp_seconds", FLEET, "0+60x20")],
         [series("bluevela_fleet_scrape_success", FLEET, "1 0 1x19"),
          series("bluevela_fleet_timestamp_seconds", FLEET, "0+60x20")],
         "15m", FLEET, 0),
    # No fleet file was ever scraped (the writer never started, the exporter not scraped).
    Case("BluevelaFleetViewStale",
         [series("bluevela_node_status", N2, "0x30")], [], [],
         "15m", {}, 1, variant="no fleet view"),
    # The writer stopped; node_exporter serves its last file, Slurm's answer in it.
    Case("BluevelaFleetViewStale",
         [series("bluevela_fleet_scrape_success", FLEET, "1x30"),
          series("bluevela_fleet_timestamp_seconds", FLEET, "0x30")], [], [],
         "20m", FLEET, 1200, variant="old file"),
    # The fleet host's node_exporter (or the file) is gone after 5 minutes.
    Case("BluevelaFleetViewStale",
         [series("bluevela_fleet_scrape_success", FLEET, "1x5 _x25"),
          series("bluevela_fleet_timestamp_seconds", FLEET, "0+60x5 _x25"),
          series("bluevela_node_status", N2, "0x30")], [], [],
         "25m", {}, 1, variant="exporter gone"),
]


# -- the few template forms the rules use ------------------------------------------------------


def _go_float(v: float) -> str:
    """Go's %v of a float64 (strconv 'g', shortest): 2 -> 2, 2.5e10 -> 2.5e+10."""
    if float(v).is_integer() and abs(v) < 1e21:
        return str(int(v))
    text = repr(float(v))
    return re.sub(r"e([+-]?)(\d+)$", lambda m: f"e{m.group(1) or '+'}{int(m.group(2)):02d}", text)


def _humanize(v: float) -> str:
    if v == 0 or abs(v) < 1:
        return f"{v:.4g}"
    prefixes = ["", "k", "M", "G", "T", "P", "E", "Z", "Y"]
    i = 0
    while abs(v) >= 1000 and i < len(prefixes) - 1:
        v /= 1000
        i += 1
    return f"{v:.4g}{prefixes[i]}"


def _humanize_duration(v: float) -> str:
    seconds = int(v)
    days, rem = divmod(seconds, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    if days:
        return f"{days}d {hours}h {minutes}m {secs}s"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def render(template: str, labels: dict[str, str], value: float) -> str:
    def sub(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            return labels.get(expr[len("$labels."):], "")
        fn = {"$value": _go_float, "$value | humanize": _humanize,
              "$value | humanizeDuration": _humanize_duration,
              "$value | humanizePercentage": lambda x: f"{x * 100:.4g}%"}.get(expr)
        if fn is None:
            raise ValueError(f"template form not supported here: {{{{ {expr} }}}}")
        return fn(value)

    return re.sub(r"\{\{(.*?)\}\}", sub, template)


def alert_rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((RULES_DIR / "bluevela.rules.yml").read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _minutes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([mh])", text)
    assert m, text
    return int(m.group(1)) * (60 if m.group(2) == "h" else 1)


def build() -> dict[str, Any]:
    rules = alert_rules()
    missing = sorted(set(rules) - {c.alert for c in CASES})
    if missing:
        raise ValueError(f"alerts without promtool cases: {', '.join(missing)}")
    tests: list[dict[str, Any]] = []
    for c in CASES:
        rule = rules[c.alert]
        assert math.isfinite(c.value)
        labels = {**c.labels, **rule["labels"]}
        annotations = {k: render(v, labels, c.value) for k, v in rule["annotations"].items()}
        name = f"{c.alert} ({c.variant})" if c.variant else c.alert
        expected = [{"exp_labels": labels, "exp_annotations": annotations}]
        # Silent means silent at every evaluation up to c.at, the noisy sample's own
        # included: there an alert without its `for:` would already fire.
        end = _minutes(c.at)
        step = max(1, end // 40)
        quiet = [{"eval_time": f"{m}m", "alertname": c.alert, "exp_alerts": []}
                 for m in range(step, end + 1, step)]
        gated = FLEET_GATE in rule["expr"]
        extra = c.extra + (fleet_ok(end + 5) if gated else [])
        kinds: list[tuple[str, list[dict[str, str]], list[dict[str, Any]]]] = [
            ("fires on the fault", c.fault + extra if c.fault else [],
             [{"eval_time": c.at, "alertname": c.alert, "exp_alerts": expected}]),
            ("silent when healthy", c.healthy + extra if c.healthy else [], quiet),
            ("silent on noise", c.noisy + extra if c.noisy else [], quiet)]
        if gated and c.fault:
            kinds += [(kind, inputs, quiet)
                      for kind, inputs in fleet_faults(c.fault + c.extra, end + 5)]
        for kind, inputs, checks in kinds:
            if not inputs:
                continue  # e.g. a variant with its fault only
            tests.append({
                "name": f"{name}: {kind}",
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": checks,
            })
    return {"rule_files": list(RULE_FILES), "evaluation_interval": "1m", "tests": tests}


def text() -> str:
    header = ("# Generated by tests/monitoring_cases.py: do not edit; regenerate with\n"
              "#   python3 -m tests.monitoring_cases > "
              "prolog_epilog/prometheus/tests/bluevela.rules.test.yml\n")
    return header + yaml.safe_dump(build(), sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    print(text(), end="")
