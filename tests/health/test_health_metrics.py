"""The Prometheus textfile (bluevela/health/metrics.py): per-GPU and per-port series from the
recorded fixture trees (tests/data/health/), validated with prometheus_client's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bluevela.health.context import ProbeContext
from bluevela.health.metrics import (
    GPU_FAMILIES,
    PROM_FILE,
    NodeFacts,
    merge_last_results,
    render,
    write_prom,
)
from bluevela.health.result import CheckResult, HealthReport, Status
from bluevela.health.runner import run_checks
from bluevela.site import NodeClass, load_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


@pytest.fixture(scope="module")
def h100() -> NodeClass:
    return load_site(REPO / "site.yaml").node_class(name="h100")


def last_for(cls: NodeClass, fixture: str, tmp_path: Path) -> dict[str, dict]:
    """gpu, ib and node checks on a fixture, run by the runner (each in a forked child, the
    result sent back as JSON) and merged into last_results.json, as a hook does."""
    fx = FIXTURES / fixture
    state = tmp_path / "state"
    state.mkdir(parents=True, exist_ok=True)
    ctx = ProbeContext(cls, "h100", root=fx / "root", nvml_snapshot=fx / "nvml.json",
                       state_dir=state, phase="prolog")
    report = run_checks(["gpu", "ib", "node"], ctx, timeout_s=5.0, cap_s=10.0, tier="quick")
    return merge_last_results(state, report, "prolog")


def parse(text: str) -> dict[str, object]:
    """{family name: family} by prometheus_client's parser (raises on a malformed file)."""
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams
    return fams


def samples(fams: dict, family: str) -> dict[tuple, float]:
    """{sorted label items: value} of one family."""
    return {tuple(sorted(s.labels.items())): s.value for s in fams[family].samples}


def assert_naming_rules(text: str, fams: dict) -> None:
    """HELP and TYPE for every family; `_total` on counters only and on every counter."""
    for f in fams.values():
        assert f.documentation, f.name
        for s in f.samples:
            if f.type == "counter":
                assert s.name.endswith("_total"), s.name
            else:
                assert f.type == "gauge" and not s.name.endswith("_total"), s.name
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names == {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    series = {s.name for f in fams.values() for s in f.samples}
    for old in ("_gbps", "_gbs", "_c", "_gib", "_per_h", "_ms", "_s", "_w", "_j"):
        assert not [n for n in series if n.endswith(old)], old


def test_prom_h100_healthy_per_gpu_and_per_port(h100: NodeClass, tmp_path: Path) -> None:
    merged = last_for(h100, "h100-healthy", tmp_path)
    path = write_prom(tmp_path / "metrics", merged)
    assert path == tmp_path / "metrics" / PROM_FILE
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left
    text = path.read_text()
    fams = parse(text)
    assert_naming_rules(text, fams)
    # per GPU: 8 series, dcgm-exporter's label set, each GPU its own uuid and bus id
    temps = fams["bluevela_gpu_temp_celsius"].samples
    assert sorted(s.labels["gpu"] for s in temps) == [str(i) for i in range(8)]
    for s in temps:
        assert s.labels["UUID"].startswith("GPU-") and s.labels["pci_bus_id"].startswith("0000")
        assert s.labels["device"] == f"nvidia{s.labels['gpu']}"
        assert s.labels["modelName"] == "NVIDIA H100 80GB HBM3" and s.labels["Hostname"]
        assert 20 <= s.value <= 90
    assert len({s.labels["UUID"] for s in temps}) == len({s.labels["pci_bus_id"] for s in temps}) == 8
    for name in ("bluevela_gpu_power_usage_watts", "bluevela_gpu_xid_errors",
                 "bluevela_gpu_ecc_dbe_vol", "bluevela_gpu_pcie_link_width",
                 "bluevela_gpu_fb_used_bytes", "bluevela_gpu_total_energy_consumption_joules"):
        assert len(fams[name].samples) == 8, name
    assert fams["bluevela_gpu_ecc_dbe_vol"].type == "counter"
    assert set(samples(fams, "bluevela_gpu_xid_errors").values()) == {0}
    # per IB port: node_exporter's infiniband names and labels, bytes not 4-byte words
    rx = samples(fams, "bluevela_infiniband_port_data_received_bytes")
    assert sorted(rx) == [(("device", f"mlx5_{i}"), ("port", "1")) for i in range(8)]
    words = int((FIXTURES / "h100-healthy/root/sys/class/infiniband/mlx5_0/ports/1/counters/"
                 "port_rcv_data").read_text())
    assert rx[(("device", "mlx5_0"), ("port", "1"))] == 4 * words
    assert set(samples(fams, "bluevela_infiniband_rate_bytes_per_second").values()) == {50e9}
    assert set(samples(fams, "bluevela_infiniband_state_id").values()) == {4}
    assert set(samples(fams, "bluevela_infiniband_physical_state_id").values()) == {5}
    assert len(fams["bluevela_infiniband_link_downed"].samples) == 8
    assert fams["bluevela_infiniband_link_downed"].type == "counter"
    # node level: base units, per-check status kept
    assert samples(fams, "bluevela_ib_rate_min_bytes_per_second") == {(): 50e9}
    assert samples(fams, "bluevela_gpu_temp_max_celsius")[()] == max(s.value for s in temps)
    assert samples(fams, "bluevela_node_mem_available_bytes")[()] > 2**30
    assert samples(fams, "bluevela_check_status") == {
        (("check", "gpu"),): 0, (("check", "ib"),): 0, (("check", "node"),): 0}
    assert "bluevela_gpu_temp_max_c" not in fams and "bluevela_ib_rate_min_gbps" not in fams


def test_prom_failing_fixtures_name_the_component(h100: NodeClass, tmp_path: Path) -> None:
    """An XID 79 on 5d:00 shows on that GPU's series only; a DOWN port on its own series."""
    fams = parse(render(last_for(h100, "h100-gpu-xid79-recent", tmp_path / "x"), "n1"))
    xid = {s.labels["pci_bus_id"]: s.value for s in fams["bluevela_gpu_xid_errors"].samples}
    assert len(xid) == 8
    assert {b for b, v in xid.items() if v} == {"00000000:5D:00.0"} and xid["00000000:5D:00.0"] == 79
    assert samples(fams, "bluevela_check_status")[(("check", "gpu"),)] == int(Status.CRITICAL)
    text = render(last_for(h100, "h100-ib-port-down", tmp_path / "p"), "n1")
    fams = parse(text)
    assert_naming_rules(text, fams)
    state = samples(fams, "bluevela_infiniband_state_id")
    assert state.pop((("device", "mlx5_3"), ("port", "1"))) == 1  # DOWN
    assert set(state.values()) == {4}
    assert samples(fams, "bluevela_infiniband_physical_state_id")[
        (("device", "mlx5_3"), ("port", "1"))] == 3  # Disabled
    assert samples(fams, "bluevela_node_status") == {(): int(Status.CRITICAL)}


def test_prom_units_and_types_of_check_metrics(tmp_path: Path) -> None:
    """Gbit/s and GB/s (one letter apart in bluevela's names) both become bytes_per_second."""
    rep = HealthReport("full", (
        CheckResult("nccl", Status.OK, "ok", {"busbw_gbs": 100.0, "time_s": 2.5}),
        CheckResult("ib", Status.OK, "ok", {"rate_min_gbps": 400, "symbol_error_max_per_h": 36,
                                            "port_rcv_data_bytes": 8, "symbol_error_total": 3}),
        CheckResult("node", Status.OK, "ok", {"clock_offset_ms": 5, "free_min_gib": 2}),
    ))
    text = render(merge_last_results(tmp_path, rep, "epilog"), "n1")
    fams = parse(text)
    assert_naming_rules(text, fams)
    assert samples(fams, "bluevela_nccl_busbw_bytes_per_second") == {(): 1e11}
    assert samples(fams, "bluevela_ib_rate_min_bytes_per_second") == {(): 5e10}
    assert samples(fams, "bluevela_nccl_time_seconds") == {(): 2.5}
    assert samples(fams, "bluevela_ib_symbol_error_max_per_second") == {(): 0.01}
    assert samples(fams, "bluevela_node_clock_offset_seconds") == {(): 0.005}
    assert samples(fams, "bluevela_node_free_min_bytes") == {(): 2 * 2**30}
    assert fams["bluevela_ib_port_rcv_data_bytes"].type == "counter"
    assert fams["bluevela_ib_symbol_error"].type == "counter"


def test_prom_hostile_label_values_escaped(tmp_path: Path) -> None:
    """Quotes, backslashes and newlines in a check name or a GPU's strings stay inside the
    label value; the file still parses and gives the original text back."""
    evil = 'x"} 1\nbluevela_node_status 0\n# \\'
    gpu = {"kind": "gpu", "labels": {"gpu": "0", "uuid": evil, "pci_bus_id": "0000:18:00.0",
                                     "model": evil},
           "values": {"temperature_c": 40}}
    port = {"kind": "ib_port", "labels": {"device": evil, "port": "1"},
            "values": {"counter_link_downed": 2, "counter_odd\nname": 1}}
    rep = HealthReport("quick", (
        CheckResult(evil, Status.WARNING, "odd", {"temp_c": 1}),
        CheckResult("gpu", Status.OK, "ok", {}, components=(gpu,)),
        CheckResult("ib", Status.OK, "ok", {}, components=(port,)),
    ))
    text = render(merge_last_results(tmp_path, rep, "prolog"), evil)
    fams = parse(text)
    assert samples(fams, "bluevela_node_status") == {(): int(Status.WARNING)}
    assert (("check", evil),) in samples(fams, "bluevela_check_status")
    (s,) = fams["bluevela_gpu_temp_celsius"].samples
    assert s.labels["UUID"] == s.labels["modelName"] == s.labels["Hostname"] == evil
    assert samples(fams, "bluevela_infiniband_link_downed") == {
        (("device", evil), ("port", "1")): 2}


def test_prom_components_kept_from_an_earlier_run(tmp_path: Path) -> None:
    """A later run without the gpu check keeps the per-GPU series (last_results.json)."""
    gpu = {"kind": "gpu", "labels": {"gpu": "3", "uuid": "GPU-3", "pci_bus_id": "0000:5d:00.0",
                                     "model": "H100"},
           "values": {"temperature_c": 41, "energy_j": 1.5, "clocks_event_reasons": 8}}
    merge_last_results(tmp_path, HealthReport("quick", (
        CheckResult("gpu", Status.OK, "ok", {"temp_max_c": 41}, components=(gpu,)),)), "prolog")
    merged = merge_last_results(tmp_path, HealthReport("quick", (
        CheckResult("node", Status.OK, "ok", {}),)), "epilog")
    fams = parse(render(merged, "n1"))
    assert [s.value for s in fams["bluevela_gpu_temp_celsius"].samples] == [41]
    assert [s.value for s in fams["bluevela_gpu_clock_throttle_reasons"].samples] == [8]
    assert [s.value for s in fams["bluevela_gpu_total_energy_consumption_joules"].samples] == [1.5]


def test_gpu_families_named_in_base_units() -> None:
    for f in GPU_FAMILIES:
        assert f.name.startswith("bluevela_gpu_")
        assert f.name.endswith("_total") == (f.type == "counter"), f.name


def test_prom_skips_malformed_keeps_first_of_a_name_and_adds_node_facts(tmp_path: Path) -> None:
    """What render decides beyond laying out families: a malformed stored result is skipped
    (the others still show), two metrics that come to one name keep the first (sorted by
    metric name: wait_ms before wait_s), the site's node facts come after the checks, and nothing stored is one
    UNKNOWN node status."""
    rep = HealthReport("quick", (
        CheckResult("gpu", Status.WARNING, "warm", {"wait_ms": 5.0, "wait_s": 9.0}),
    ))
    last = {**merge_last_results(tmp_path, rep, "prolog"), "broken": {"no": "status"}}
    text = render(last, "n1", NodeFacts(class_name="h100", gpus=8))
    fams = parse(text)
    assert samples(fams, "bluevela_check_status") == {(("check", "gpu"),): 1.0}
    assert samples(fams, "bluevela_gpu_wait_seconds") == {(): 0.005}
    assert text.count("# TYPE bluevela_gpu_wait_seconds ") == 1
    assert samples(fams, "bluevela_node_status") == {(): 1.0}
    assert samples(fams, "bluevela_node_class_info") == {(("class", "h100"),): 1.0}
    assert samples(fams, "bluevela_node_gpus_expected") == {(): 8.0}
    names = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]
    assert names.index("bluevela_gpu_wait_seconds") < names.index("bluevela_node_class_info")
    assert render({}, "n1") == ("# HELP bluevela_node_status Worst status over the last result "
                                "of every check.\n# TYPE bluevela_node_status gauge\n"
                                "bluevela_node_status 3\n")
