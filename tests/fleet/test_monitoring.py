"""bv's Prometheus rules and dashboard without a cluster: `promtool check rules`, `promtool test
rules` (every alert: fires on its fault, silent on healthy and noisy series), the generated test
file up to date, each alert's conventions, and every metric an alert or panel reads is one that
bv (a real hook run on a fixture), the fleet file or node_exporter really writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from bluevela.fleet_metrics import render_fleet
from bluevela.site import load_site
from bluevela.slurm.client import NodeInfo, ReservationInfo
from tests import monitoring_cases
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "prolog_epilog" / "prometheus"
DOCS = REPO / "docs" / "monitoring.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(slurm/install-deps installs Debian's prometheus)")
# node_exporter's own families the rules use, and Prometheus's
EXPORTER_NAMES = {"node_textfile_mtime_seconds", "node_textfile_scrape_error", "up", "ALERTS"}


@needs_promtool
def test_promtool_check_rules() -> None:
    p = subprocess.run([PROMTOOL or "promtool", "check", "rules",
                        str(RULES / "bluevela.rules.yml"), str(RULES / "bluevela.recording.yml")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    p = subprocess.run([PROMTOOL or "promtool", "test", "rules", "bluevela.rules.test.yml"],
                       cwd=RULES / "tests", capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


def test_unit_tests_are_generated_from_the_current_rules() -> None:
    assert monitoring_cases.TEST_FILE.read_text() == monitoring_cases.text(), (
        "regenerate: python3 -m tests.monitoring_cases > "
        "prolog_epilog/prometheus/tests/bluevela.rules.test.yml")


def test_every_alert_has_fire_healthy_and_noise_cases() -> None:
    tests = yaml.safe_load(monitoring_cases.TEST_FILE.read_text())["tests"]
    names = {t["name"] for t in tests}
    for alert in monitoring_cases.alert_rules():
        for kind in ("fires on the fault", "silent when healthy", "silent on noise"):
            want = f"{alert}: {kind}"
            if alert == "BluevelaNodeDrained" or alert == "BluevelaNightlyRegression":
                if kind == "silent when healthy":
                    continue  # healthy = no drained series at all: covered by "noise"
            assert want in names, want


def _reads_fleet_view(expr: str, fleet_records: set[str]) -> bool:
    names = _names_in(expr) | set(re.findall(r"\b(bluevela:[a-z0-9_:]+)", expr))
    return any(n.startswith(("bluevela_slurm_", "bluevela_breaker_")) or n in fleet_records
               for n in names)


def test_alerts_on_the_fleet_view_are_gated_and_tested_without_it() -> None:
    """Every alert reading the fleet file's families (or a recording rule over them) carries the
    freshness gate, and has its fault tested with Slurm not answering, an old file, no file."""
    records = {r["record"]: r["expr"] for g in yaml.safe_load(
        (RULES / "bluevela.recording.yml").read_text())["groups"] for r in g["rules"]}
    fleet_records: set[str] = set()
    for _ in range(3):  # records over records
        fleet_records |= {r for r, e in records.items() if _reads_fleet_view(e, fleet_records)}
    assert "bluevela:class_drained:ratio" in fleet_records
    gate = re.compile(r"and on \(\) \(bluevela_fleet_scrape_success == 1\s+and on \(\) "
                      r"\(time\(\) - bluevela_fleet_timestamp_seconds\) < 300\)$")
    names = {t["name"] for t in yaml.safe_load(monitoring_cases.TEST_FILE.read_text())["tests"]}
    gated = []
    for name, rule in monitoring_cases.alert_rules().items():
        if name == "BluevelaFleetViewStale" or not _reads_fleet_view(rule["expr"], fleet_records):
            continue
        gated.append(name)
        assert gate.search(rule["expr"].strip()), f"{name}: not gated on a fresh fleet view"
        assert f"{name}: silent when Slurm does not answer" in names, name
        assert f"{name}: silent on an old fleet view" in names, name
    assert sorted(gated) == sorted([
        "BluevelaMetricsStale", "BluevelaNodeDrained", "BluevelaNightlyRegression",
        "BluevelaClassDrainedHigh", "BluevelaFleetBreakerFull",
        "BluevelaCriticalNodeNotDrained"])
    for variant in ("no fleet view", "old file", "exporter gone"):
        assert f"BluevelaFleetViewStale ({variant}): fires on the fault" in names


def test_alert_conventions_and_runbooks() -> None:
    anchors = set(re.findall(r"(?m)^#+ (Bluevela[A-Za-z]+)", DOCS.read_text()))
    for name, rule in monitoring_cases.alert_rules().items():
        assert re.fullmatch(r"Bluevela[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["labels"]["component"] in ("gpu", "infiniband", "slurm", "bluevela",
                                               "bench"), name
        assert re.fullmatch(r"\d+[mh]", rule["for"]), name
        ann = rule["annotations"]
        assert ann["summary"] and len(ann["description"]) > 80, name
        assert "Next:" in ann["description"], f"{name}: say what to do next"
        assert ann["runbook_url"] == f"docs/monitoring.md#{name.lower()}", name
        assert name in anchors, f"{name} has no section in docs/monitoring.md"


def _names_in(expr: str) -> set[str]:
    """Metric names an expression reads (recording rule names and functions left out)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    words = set(re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\b(?!\s*\()", expr))
    return {w for w in words if w.startswith(("bluevela_", "node_")) or w in ("up", "ALERTS")}


def _written_names(tmp: Path) -> set[str]:
    """Every family a real hook run on the healthy H100 fixture writes, and the fleet file's."""
    fx = materialized() / "h100-healthy"
    env = {**os.environ, "BV_SITE": str(REPO / "site.yaml"), "BV_NODE_CLASS": "h100",
           "BV_SYSFS_ROOT": str(fx / "root"), "BV_NVML_SNAPSHOT": str(fx / "nvml.json"),
           "BV_STATE_DIR": str(tmp / "state"), "BV_METRICS_DIR": str(tmp / "metrics"),
           "BV_SPOOL_DIR": str(tmp / "spool"), "SLURM_CONF": "/nonexistent",
           "SLURMD_NODENAME": "node2", "SLURM_JOB_ID": "1", "BV_HOOK_LOG_LEVEL": "ERROR"}
    # the epilog runs the quick tier (no nccl: it cannot run without a GPU) and writes the file
    subprocess.run([sys.executable, "-m", "bluevela.hooks", "epilog"], env=env,
                   capture_output=True, text=True, timeout=120, check=False)
    text = (tmp / "metrics" / "bluevela.prom").read_text()
    site = load_site(REPO / "site.yaml")
    text += render_fleet(site, [NodeInfo("node1", "ALLOCATED", "", ("debug",)),
                                NodeInfo("node2", "IDLE+DRAIN", "bv: ib: x", ("debug",))],
                         [ReservationInfo("bv-drain-debug-0", ("node2",), 1e9)])
    names = set(re.findall(r"(?m)^# TYPE (\S+)", text))
    # nccl's node-level metric: written by the full tier, where a GPU is present
    names.add("bluevela_nccl_busbw_bytes_per_second")
    return names | EXPORTER_NAMES


def test_rules_and_panels_read_metrics_bv_writes(tmp_path: Path) -> None:
    written = _written_names(tmp_path)
    assert "bluevela_node_gpus_expected" in written and "bluevela_slurm_node_drained" in written
    used: dict[str, set[str]] = {}
    for f in ("bluevela.rules.yml", "bluevela.recording.yml"):
        for group in yaml.safe_load((RULES / f).read_text())["groups"]:
            for rule in group["rules"]:
                used[rule.get("alert") or rule["record"]] = _names_in(rule["expr"])
    dash = json.loads((RULES / "grafana-dashboard.json").read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used[panel["title"]] = _names_in(target["expr"])
    unknown = {who: sorted(names - written) for who, names in used.items() if names - written}
    assert not unknown, unknown


def test_dashboard_reads_the_recording_rules() -> None:
    dash = json.loads((RULES / "grafana-dashboard.json").read_text())
    records = {r["record"] for g in yaml.safe_load(
        (RULES / "bluevela.recording.yml").read_text())["groups"] for r in g["rules"]}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert dash["uid"] == "bluevela-fleet" and len(dash["panels"]) >= 15
    on_records = [e for e in exprs if any(r in e for r in records)]
    assert len(on_records) >= len(exprs) // 2, "fleet panels should read recording rules"


@needs_promtool
def test_example_scrape_config_is_valid(tmp_path: Path) -> None:
    cfg = (RULES / "prometheus.example.yml").read_text()
    # the example names the installed rules; point them at this checkout's
    cfg = cfg.replace("/opt/bluevela/prolog_epilog/prometheus", str(RULES))
    (tmp_path / "prometheus.yml").write_text(cfg)
    p = subprocess.run([PROMTOOL or "promtool", "check", "config",
                        str(tmp_path / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rules files" in p.stdout or "SUCCESS: 2 rule files" in p.stdout \
        or "SUCCESS" in p.stdout, p.stdout


def _fleet_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def test_fleet_file_drains_sources_busy_and_breaker() -> None:
    site = load_site(REPO / "site.yaml")
    nodes = [NodeInfo("node1", "MIXED", "", ("debug",)),
             NodeInfo("node2", "IDLE+DRAIN", "bv: ib: mlx5_3/1 state DOWN", ("debug",)),
             NodeInfo("node3", "ALLOCATED+DRAIN", "bv: nightly 2026-11-26: gemm low",
                      ("debug",)),
             NodeInfo("node4", "IDLE+DRAIN", 'maint "dimm" \\ swap\nnext', ("debug",)),
             NodeInfo("node5", "IDLE", "", ())]
    text = render_fleet(site, nodes, [ReservationInfo("bv-drain-debug-0", ("node2",), 1e9),
                                      ReservationInfo("other", ("node1",), 1e9)])
    got = _fleet_samples(text)  # the real parser: the operator's quotes/newline are escaped
    drained = {lab["node"]: (lab["source"], lab["reason"]) for n, lab, _ in got
               if n == "bluevela_slurm_node_drained"}
    assert drained == {"node2": ("bv", "bv: ib: mlx5_3/1 state DOWN"),
                       "node3": ("nightly", "bv: nightly 2026-11-26: gemm low"),
                       # one line: the newline becomes a space; quotes and \\ escaped
                       "node4": ("operator", 'maint "dimm" \\ swap next')}
    busy = {lab["node"]: v for n, lab, v in got if n == "bluevela_slurm_node_busy"}
    assert busy == {"node1": 1, "node2": 0, "node3": 1, "node4": 0, "node5": 0}
    classes = {lab["node"]: lab["class"] for n, lab, _ in got if n == "bluevela_slurm_node_info"}
    assert classes == {f"node{i}": "cpu" for i in range(1, 6)}
    breaker = {(n, lab["partition"]): v for n, lab, v in got if n.startswith("bluevela_breaker")}
    # debug: 4 nodes at 15 % -> 1; bv drained node2 (slot) and node3 (nightly, also ours)
    assert breaker[("bluevela_breaker_nodes", "debug")] == 4
    assert breaker[("bluevela_breaker_limit_nodes", "debug")] == 1
    assert breaker[("bluevela_breaker_drained_nodes", "debug")] == 2
    assert breaker[("bluevela_breaker_nodes", "_none")] == 5  # nodes in no partition: all


def test_fleet_file_when_slurm_does_not_answer() -> None:
    got = _fleet_samples(render_fleet(load_site(REPO / "site.yaml"), None))
    assert {n for n, _, _ in got} == {"bluevela_fleet_scrape_success",
                                      "bluevela_fleet_timestamp_seconds"}
    assert next(v for n, _, v in got if n == "bluevela_fleet_scrape_success") == 0


# -- from a real hook run's file to promtool's verdict --------------------------------------------


def _hook_file(tmp: Path, root: Path, nvml: Path, kmsg: Path | None = None) -> str:
    """bluevela.prom as a real epilog run writes it (actions: audit, so no drain is tried)."""
    site = tmp / "site.yaml"
    text = (REPO / "site.yaml").read_text()
    text, n = re.subn(r"(?m)^health:\n", "health:\n  actions: audit\n", text)
    assert n == 1
    # The metrics come from the checks' facts: a check timed out on a loaded machine (CI's two
    # workers) writes none of its families, so the bounds here leave room (the site's 3 s did not).
    text, n = re.subn(r"quick: \{checks: \[([^]]*)\], cap_s: \d+, check_timeout_s: \d+\}",
                      r"quick: {checks: [\1], cap_s: 40, check_timeout_s: 15}", text)
    assert n == 1
    site.write_text(text)
    env = {**os.environ, "BV_SITE": str(site), "BV_NODE_CLASS": "h100",
           "BV_SYSFS_ROOT": str(root), "BV_NVML_SNAPSHOT": str(nvml),
           "BV_STATE_DIR": str(tmp / "state"), "BV_METRICS_DIR": str(tmp / "metrics"),
           "BV_SPOOL_DIR": str(tmp / "spool"), "SLURM_CONF": "/nonexistent",
           "SLURMD_NODENAME": "node2", "SLURM_JOB_ID": "1", "BV_HOOK_LOG_LEVEL": "ERROR"}
    if kmsg is not None:
        env["BV_KMSG"] = str(kmsg)
    subprocess.run([sys.executable, "-m", "bluevela.hooks", "epilog"], env=env,
                   capture_output=True, text=True, timeout=120, check=False)
    return (tmp / "metrics" / "bluevela.prom").read_text()


def _series_text(v: float) -> str:
    """A sample value in promtool's a+bxN notation, which has no exponent form: a tiny value
    of the live machine (9.9e-05, a ratio from its own clock) written out in full."""
    if float(v).is_integer():
        return str(int(v))
    text = format(Decimal(repr(float(v))), "f")  # the shortest repr's digits, no exponent
    assert "e" not in text.lower(), text
    return text


def _promtool_alerts(tmp: Path, text: str, minutes: int,
                     expect: dict[str, list[tuple[dict[str, str], float]]]
                     ) -> subprocess.CompletedProcess[str]:
    """promtool over `text` scraped from node2 every minute for `minutes`: at the end, each
    alert of `expect` fires with exactly the given (label set, value)s, the rule's own labels
    added and its annotations rendered as a person reads them."""
    node = {"node": "node2", "instance": "node2:9100", "job": "node"}
    inputs = []
    for name, lab, v in _fleet_samples(text):
        if v != v:  # NaN
            continue
        body = ",".join(f'{k}="{val}"' for k, val in {**node, **lab}.items())
        inputs.append({"series": f"{name}{{{body}}}", "values": f"{_series_text(v)}x{minutes}"})
    rules = monitoring_cases.alert_rules()
    def expected(alert: str, labels: dict[str, str], value: float) -> dict[str, Any]:
        full = {**node, **labels, **rules[alert]["labels"]}
        return {"exp_labels": full,
                "exp_annotations": {k: monitoring_cases.render(v, full, value)
                                    for k, v in rules[alert]["annotations"].items()}}

    checks = [{"eval_time": f"{minutes}m", "alertname": alert,
               "exp_alerts": [expected(alert, labels, value) for labels, value in want]}
              for alert, want in expect.items()]
    (tmp / "case.yml").write_text(yaml.safe_dump({
        "rule_files": [str(RULES / "bluevela.rules.yml"), str(RULES / "bluevela.recording.yml")],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}]}))
    return subprocess.run([PROMTOOL or "promtool", "test", "rules", str(tmp / "case.yml")],
                          capture_output=True, text=True, timeout=120, check=False)


def _out(p: subprocess.CompletedProcess[str]) -> str:
    return p.stdout[-3000:] + p.stderr[-1000:]


@needs_promtool
def test_xid79_for_a_gpu_nvml_no_longer_lists_reaches_its_alert(tmp_path: Path) -> None:
    fx = materialized()
    # h100-gpu-missing: NVML lists 7 GPUs, the one at DB:00 is gone; the kernel logged, in its
    # own format (tests/data/health/h100-gpu-xid79), XID 79 for that address, then 154.
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "NVRM: Xid (PCI:0000:db:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        "the bus.\n"
        "NVRM: Xid (PCI:0000:db:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
        "(Node Reboot Required)\n")
    text = _hook_file(tmp_path, fx / "h100-gpu-missing" / "root",
                      fx / "h100-gpu-missing" / "nvml.json", kmsg)
    got = {(n, tuple(sorted(lab.items()))): v for n, lab, v in _fleet_samples(text)}
    gone = (("Hostname", os.uname().nodename), ("pci_bus_id", "00000000:DB:00.0"))
    assert got[("bluevela_gpu_xid_fallen_off_bus", gone)] == 1
    assert got[("bluevela_gpu_xid_errors", gone)] == 154  # the last code is no longer 79
    p = _promtool_alerts(tmp_path, text, 5, {
        "BluevelaGpuFallenOffBus": [({"pci_bus_id": "00000000:DB:00.0",
                                      "Hostname": os.uname().nodename}, 1)],
        "BluevelaGpuMissing": [({}, 7)]})
    assert p.returncode == 0, _out(p)
    # The same node without the kernel lines: the GPU is missing, nothing fell off a bus.
    (tmp_path / "h").mkdir()
    (tmp_path / "empty").write_text("")
    healthy = _hook_file(tmp_path / "h", fx / "h100-gpu-missing" / "root",
                         fx / "h100-gpu-missing" / "nvml.json", tmp_path / "empty")
    p = _promtool_alerts(tmp_path, healthy, 5, {"BluevelaGpuFallenOffBus": [],
                                                 "BluevelaGpuMissing": [({}, 7)]})
    assert p.returncode == 0, _out(p)


@needs_promtool
def test_saturated_ib_counters_reach_their_alert(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(materialized() / "h100-healthy" / "root", root, symlinks=True)
    counters = root / "sys" / "class" / "infiniband" / "mlx5_3" / "ports" / "1" / "counters"
    (counters / "link_downed").write_text("255\n")  # 8 bits: stuck at 255
    (counters / "local_link_integrity_errors").write_text("15\n")  # 4 bits
    (counters / "symbol_error").write_text("65534\n")  # 16 bits, one below: not saturated
    (tmp_path / "empty").write_text("")
    text = _hook_file(tmp_path, root, materialized() / "h100-healthy" / "nvml.json",
                      tmp_path / "empty")
    sat = {(lab["device"], lab["counter"]): v for n, lab, v in _fleet_samples(text)
           if n == "bluevela_infiniband_counter_saturated"}
    assert len(sat) == 12 * 8  # every PMA error counter of the 8 ports
    assert {k for k, v in sat.items() if v == 1} == {("mlx5_3", "link_downed"),
                                                      ("mlx5_3", "local_link_integrity_errors")}
    port = {"device": "mlx5_3", "port": "1"}
    p = _promtool_alerts(tmp_path, text, 30, {
        "BluevelaIbCounterSaturated": [({**port, "counter": "link_downed"}, 1),
                                       ({**port, "counter": "local_link_integrity_errors"}, 1)],
        # why the alert exists: a counter stuck at its maximum never rises
        "BluevelaIbLinkFlapping": [], "BluevelaIbErrorsRising": []})
    assert p.returncode == 0, _out(p)


@pytest.mark.parametrize("argv, message", [
    (["--out", "/tmp/x", "--every", "-1"], "--every must be >= 0"),
    (["--out", "/tmp/x", "--site", "/nonexistent/site.yaml"], "site"),
])
def test_fleet_metrics_bad_input_is_one_line(argv: list[str], message: str) -> None:
    p = subprocess.run([sys.executable, "-m", "bluevela.fleet_metrics", *argv],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert message in p.stderr


def test_fleet_metrics_writes_scrape_failure_without_slurm(tmp_path: Path) -> None:
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "no-slurm.conf"),
           "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "bluevela.fleet_metrics", "--out",
                        str(tmp_path / "out"), "--site", str(REPO / "site.yaml")],
                       env=env, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    got = _fleet_samples((tmp_path / "out" / "bluevela_fleet.prom").read_text())
    assert ("bluevela_fleet_scrape_success", {}, 0.0) in got
