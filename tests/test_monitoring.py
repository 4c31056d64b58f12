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
from pathlib import Path

import pytest
import yaml

from bluevela.fleet_metrics import render_fleet
from bluevela.site import load_site
from bluevela.slurm.client import NodeInfo, ReservationInfo
from tests import monitoring_cases
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parent.parent
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
                       "node4": ("operator", 'maint "dimm" \\ swap\nnext')}
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
