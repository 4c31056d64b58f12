"""Issue 11, network and host: the ib and node checks' new parts on fixture trees.

Probes read the fixture roots of tests/data/health (built by make_fixtures.py +
make_fixtures_host.py) exactly as on a node; a baseline in the state dir is what an earlier
run wrote, with its time moved where the test needs an interval. The hung mount is a real one:
a FUSE mount whose daemon never answers (tests/fuse_hang.py), in a private mount namespace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.checks.dcgm import DcgmFacts, evaluate_dcgm, parse_diag
from bluevela.health.checks.host import (
    ClockFacts,
    EdacFacts,
    EdacMC,
    Proc,
    evaluate_clock,
    evaluate_edac,
    evaluate_procs,
    gather_procs,
    parse_stat,
    probe_mounts,
    read_adjtimex,
)
from bluevela.health.checks.ib import (
    GPUDirectFacts,
    evaluate_gpudirect,
    kernel_at_least,
    parse_gts,
    parse_modules,
)
from bluevela.health.context import ProbeContext
from bluevela.health.result import Status
from bluevela.health.state import IB_COUNTERS
from bluevela.site import NodeClass, load_site
from tests.fixture_trees import materialized
from tests.fuse_hang import fuse_available

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


@pytest.fixture(scope="module")
def h100() -> NodeClass:
    return load_site(REPO / "site.yaml").node_class(name="h100")


def ctx_on(cls: NodeClass, root: Path, state: Path, fixture: str | None = None) -> ProbeContext:
    state.mkdir(parents=True, exist_ok=True)
    if fixture and (FIXTURES / fixture / "state").is_dir():
        shutil.copytree(FIXTURES / fixture / "state", state, dirs_exist_ok=True)
    return ProbeContext(cls, "h100", root=root, state_dir=state, phase="healthcheck")


def fixture_ctx(cls: NodeClass, fixture: str, tmp_path: Path) -> ProbeContext:
    return ctx_on(cls, FIXTURES / fixture / "root", tmp_path / "state", fixture)


def healthy_copy(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "h100-healthy" / "root", root)
    return root


def age_baseline(state: Path, name: str, seconds: float) -> None:
    """Make the stored reading `seconds` old (as if the last run was that long ago)."""
    data = json.loads((state / name).read_text())
    data["time"] = time.time() - seconds
    (state / name).write_text(json.dumps(data))


def bump(path: Path, by: int) -> None:
    path.write_text(f"{int(path.read_text()) + by}\n")


# -- healthy ------------------------------------------------------------------------------------


def test_healthy_node_passes_every_new_part(h100: NodeClass, tmp_path: Path) -> None:
    ctx = fixture_ctx(h100, "h100-healthy", tmp_path)
    ib = get_check("ib").run_once(ctx)
    assert ib.status is Status.OK, ib
    assert ib.metrics["hca_pcie_width_min"] == 16
    assert ib.metrics["rnr_nak_retry_err_total"] == 0  # hw_counters read
    assert "lifespan_total" not in ib.metrics  # a period, not a counter
    node = get_check("node").run_once(ctx)
    assert node.status is Status.OK, node
    assert "1 mounts answering" in node.summary and "4 services running" in node.summary
    assert node.metrics["edac_ue_total"] == 0 and node.metrics["d_state_count"] == 0


# -- network ------------------------------------------------------------------------------------


def test_link_downed_rising_is_critical_with_its_interval(h100: NodeClass, tmp_path: Path) -> None:
    ctx = fixture_ctx(h100, "h100-ib-link-downed-rising", tmp_path)
    age_baseline(tmp_path / "state", IB_COUNTERS, 40 * 60)
    r = get_check("ib").run_once(ctx)
    assert r.status is Status.CRITICAL
    assert r.summary.startswith("mlx5_2/1 link_downed +3 in 40 min (0 -> 3, allowed +0)"), r.summary


def test_local_link_integrity_errors_rising_is_critical(h100: NodeClass, tmp_path: Path) -> None:
    """Two LLI errors: far under the absolute ceiling (10), but any rise is a failing link."""
    root = healthy_copy(tmp_path)
    ctx = ctx_on(h100, root, tmp_path / "state")
    assert get_check("ib").run_once(ctx).status is Status.OK  # writes the baseline
    bump(root / "sys/class/infiniband/mlx5_6/ports/1/counters/local_link_integrity_errors", 2)
    age_baseline(tmp_path / "state", IB_COUNTERS, 300)
    r = get_check("ib").run_once(ctx)
    assert r.status is Status.CRITICAL
    assert "mlx5_6/1 local_link_integrity_errors +2 in 5 min" in r.summary, r.summary
    # The counter stops rising: the next reading passes (the baseline was replaced).
    assert get_check("ib").run_once(ctx).status is Status.OK


def test_hw_counter_rate_per_hour_is_warned(h100: NodeClass, tmp_path: Path) -> None:
    root = healthy_copy(tmp_path)
    ctx = ctx_on(h100, root, tmp_path / "state")
    get_check("ib").run_once(ctx)
    stored = json.loads((tmp_path / "state" / IB_COUNTERS).read_text())
    assert stored["hw"]["mlx5_3/1"]["rnr_nak_retry_err"] == 0 and "lifespan" not in stored["hw"]["mlx5_3/1"]
    bump(root / "sys/class/infiniband/mlx5_3/ports/1/hw_counters/rnr_nak_retry_err", 25)
    age_baseline(tmp_path / "state", IB_COUNTERS, 3600)
    r = get_check("ib").run_once(ctx)
    assert r.status is Status.WARNING, r
    assert "mlx5_3/1 rnr_nak_retry_err 25/h > 10/h (+25 in 60 min)" in r.summary, r.summary
    assert r.metrics["rnr_nak_retry_err_max_per_h"] == pytest.approx(25, rel=0.01)


def test_rate_not_judged_over_a_short_interval(h100: NodeClass, tmp_path: Path) -> None:
    """One error 10 s after the last reading is not 360/h: under rate_min_interval_s no rate."""
    root = healthy_copy(tmp_path)
    ctx = ctx_on(h100, root, tmp_path / "state")
    get_check("ib").run_once(ctx)
    bump(root / "sys/class/infiniband/mlx5_3/ports/1/hw_counters/rnr_nak_retry_err", 1)
    age_baseline(tmp_path / "state", IB_COUNTERS, 10)
    r = get_check("ib").run_once(ctx)
    assert r.status is Status.OK and "rnr_nak_retry_err_max_per_h" not in r.metrics, r
    assert r.metrics["rnr_nak_retry_err_increase_count"] == 1


@pytest.mark.parametrize(("fixture", "text"), [
    ("h100-ib-hca-pcie-x8", "mlx5_4 PCIe x8 (max x16)"),
    ("h100-ib-hca-pcie-gen4", "mlx5_1 PCIe 16 GT/s (max 32 GT/s)"),
    ("h100-ib-no-peermem", "GPUDirect RDMA unavailable: nvidia_peermem not loaded"),
])
def test_hca_pcie_and_gpudirect_failures(h100: NodeClass, tmp_path: Path, fixture: str,
                                         text: str) -> None:
    r = get_check("ib").run_once(fixture_ctx(h100, fixture, tmp_path))
    assert r.status is Status.CRITICAL and r.summary == text, r


def test_hca_pcie_unreadable_is_unknown(h100: NodeClass, tmp_path: Path) -> None:
    root = healthy_copy(tmp_path)
    (root / "sys/class/infiniband/mlx5_0/device/max_link_width").unlink()
    r = get_check("ib").run_once(ctx_on(h100, root, tmp_path / "state"))
    assert r.status is Status.UNKNOWN and r.summary.startswith("mlx5_0 PCIe link unreadable"), r
    off = replace(h100, ib=replace(h100.ib, pcie_at_max=False))
    assert get_check("ib").run_once(ctx_on(off, root, tmp_path / "s2")).status is Status.OK


def test_gpudirect_paths() -> None:
    peer = GPUDirectFacts(frozenset({"nvidia", "nvidia_peermem"}), False, "5.15.0-91-generic")
    dmabuf = GPUDirectFacts(frozenset({"nvidia"}), True, "6.5.0-1015-nvidia")
    old = GPUDirectFacts(frozenset({"nvidia"}), True, "5.4.0-150-generic")
    ofed = GPUDirectFacts(frozenset({"nvidia", "nv_peer_mem"}), False, "4.18.0")
    assert evaluate_gpudirect(peer, "peermem") == [] and evaluate_gpudirect(ofed, "peermem") == []
    assert evaluate_gpudirect(dmabuf, "dmabuf") == [] and evaluate_gpudirect(dmabuf, "any") == []
    assert evaluate_gpudirect(dmabuf, "peermem")[0][0] is Status.CRITICAL
    [(status, text)] = evaluate_gpudirect(old, "dmabuf")
    assert status is Status.CRITICAL and "kernel 5.4.0-150-generic < 5.12" in text
    assert evaluate_gpudirect(peer, "dmabuf")[0][1].endswith("the NVIDIA module is not the open one")
    assert evaluate_gpudirect(GPUDirectFacts(frozenset(), None, "6.1"), "any")[0][0] is Status.CRITICAL
    assert evaluate_gpudirect(GPUDirectFacts(error="/proc/modules: Permission denied"),
                              "peermem")[0][0] is Status.UNKNOWN
    assert evaluate_gpudirect(GPUDirectFacts(), "off") == []


def test_sysfs_and_proc_formats() -> None:
    assert parse_gts("32.0 GT/s PCIe\n") == 32.0 and parse_gts("8 GT/s") == 8.0
    assert parse_gts("Unknown") is None
    mods = parse_modules("nvidia_peermem 16384 0 - Live 0x0000000000000000 (POE)\nib_core 1 0 - Live 0x0\n")
    assert mods == {"nvidia_peermem", "ib_core"}
    assert kernel_at_least("5.12.0", 5, 12) and not kernel_at_least("5.4.0", 5, 12)
    assert not kernel_at_least(None, 5, 12) and kernel_at_least("6.1.0-18-amd64", 5, 12)


# -- host: services and processes ---------------------------------------------------------------


def test_required_service_not_running_is_critical(h100: NodeClass, tmp_path: Path) -> None:
    r = get_check("node").run_once(fixture_ctx(h100, "h100-node-service-down", tmp_path))
    assert r.status is Status.CRITICAL and r.summary == "service nv-fabricmanager not running", r


def test_stat_parsing_and_service_matching() -> None:
    p = parse_stat("4242 (a) b (c)) S 1 4242 4242 0 -1 4194624 1 0 0 0 0 0 0 0 20 0 1 0 777 1 1 "
                   "1 1 1 1 1 0 0 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0\n")
    assert p == Proc(4242, "a) b (c)", "S", 4194624, 777)
    assert parse_stat("garbage") is None and parse_stat("12 (x) S 1") is None
    t = replace(NodeClass(nodes="n1").node, required_services=["nvidia-persistenced", "munged"])
    procs = [Proc(10, "nvidia-persiste", "S", 0x400140, 5), Proc(11, "munged", "Z", 0x400140, 6)]
    facts, _ = gather_procs(procs, {}, 1000.0, True)
    # comm keeps 15 characters; a zombie munged is not a running munged.
    assert evaluate_procs(facts, t) == [(Status.CRITICAL, "service munged not running")]


def test_long_d_state_is_warned(h100: NodeClass, tmp_path: Path) -> None:
    r = get_check("node").run_once(fixture_ctx(h100, "h100-node-d-state", tmp_path))
    assert r.status is Status.WARNING, r
    assert r.summary.startswith("1 process(es) in D state over 600 s: python3 pid 61234 for "), r
    stored = json.loads((tmp_path / "state" / "host_state.json").read_text())
    assert stored["d_state"] == {"61234:912345678": 1768456800.0}  # first-seen time kept


def test_d_state_duration_is_across_readings() -> None:
    t = NodeClass(nodes="n1").node  # max_d_state_s 600
    d = Proc(500, "python3", "D", 0x400040, 99)
    kthread = Proc(7, "kworker/0:1", "D", 0x4208060, 3)
    facts, seen = gather_procs([d, kthread], {}, 1000.0, True)
    assert facts.d_state_now == 1 and seen == {"500:99": 1000.0}  # kernel threads skipped
    assert evaluate_procs(facts, t) == []  # first seen now
    facts, seen = gather_procs([d], seen, 1700.0, True)
    assert evaluate_procs(facts, t)[0][0] is Status.WARNING
    # It left D once: the clock starts again.
    facts, seen = gather_procs([replace(d, state="S")], seen, 1800.0, True)
    assert seen == {}
    facts, seen = gather_procs([d], seen, 1900.0, True)
    assert evaluate_procs(facts, t) == []
    # A reused pid (another starttime) is another process.
    facts, _ = gather_procs([replace(d, starttime=100)], {"500:99": 0.0}, 1900.0, True)
    assert evaluate_procs(facts, t) == []


# -- host: EDAC ---------------------------------------------------------------------------------


def test_edac_uncorrectable_drains_naming_the_dimm(h100: NodeClass, tmp_path: Path) -> None:
    r = get_check("node").run_once(fixture_ctx(h100, "h100-node-edac-ue", tmp_path))
    assert r.status is Status.CRITICAL, r
    assert r.summary == ("EDAC mc1 1 uncorrectable memory error(s) since boot "
                         "(CPU_SrcID#0_MC#1_Chan#1_DIMM#0)"), r.summary


def test_edac_corrected_rate_is_warned(h100: NodeClass, tmp_path: Path) -> None:
    root = healthy_copy(tmp_path)
    ctx = ctx_on(h100, root, tmp_path / "state")
    assert get_check("node").run_once(ctx).status is Status.OK
    bump(root / "sys/devices/system/edac/mc/mc2/ce_count", 250)
    age_baseline(tmp_path / "state", "host_state.json", 3600)
    r = get_check("node").run_once(ctx)
    assert r.status is Status.WARNING, r
    assert "EDAC mc2 corrected memory errors 250/h > 100/h (+250)" in r.summary, r.summary
    t = h100.node
    few = EdacFacts((EdacMC("mc0", 5, 0, (), 0),), age_s=3600.0)
    assert evaluate_edac(few, t) == []
    assert evaluate_edac(EdacFacts(error="EACCES"), t)[0][0] is Status.UNKNOWN


# -- host: clock --------------------------------------------------------------------------------


def test_clock_sync_evaluation() -> None:
    t = replace(NodeClass(nodes="n1").node, max_clock_offset_ms=100.0)
    synced = ClockFacts(0, 0x2001, 1500.0, 120000)  # PLL | NANO, 1.5 ms
    assert evaluate_clock(synced, t) == []
    [(s, text)] = evaluate_clock(ClockFacts(5, 0x40, 0.0, 16_000_000), t)
    assert s is Status.WARNING and text.startswith("clock not synchronized (adjtimex: STA_UNSYNC")
    [(s, text)] = evaluate_clock(ClockFacts(0, 0x1, -250_000.0, 300000), t)
    assert s is Status.WARNING and text == "clock offset 250.0 ms > 100 ms"
    assert evaluate_clock(ClockFacts(5, 0x40, 0.0, 0), replace(t, max_clock_offset_ms=0)) == []


def test_adjtimex_reads_the_real_kernel_clock() -> None:
    facts = read_adjtimex()
    assert facts.error is None and facts.state in range(0, 6) and facts.maxerror_us >= 0


# -- host: mounts -------------------------------------------------------------------------------


def test_mount_probe_answers_and_writes_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "data" / "probe").mkdir(parents=True)
    [p] = probe_mounts(tmp_path, ["/data"], ["/data/probe"], 2.0)
    assert p.state == "ok" and p.seconds < 2.0
    assert list((tmp_path / "data" / "probe").iterdir()) == []
    (tmp_path / "ro").mkdir()
    [gone, ro] = probe_mounts(tmp_path, ["/missing", "/ro"], ["/ro"], 2.0)
    assert gone.state == "error" and "statvfs: No such file or directory" in gone.detail
    (tmp_path / "ro").chmod(0o500)
    try:
        [ro] = probe_mounts(tmp_path, ["/ro"], ["/ro"], 2.0)
    finally:
        (tmp_path / "ro").chmod(0o700)
    # root writes through 0500; an ordinary user gets EACCES: either way it answered.
    assert ro.state in ("ok", "error")


HUNG_SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
from dataclasses import replace
sys.path.insert(0, {repo!r})
from tests.fuse_hang import mount_hung
from bluevela.health.context import ProbeContext
from bluevela.health.runner import run_checks
from bluevela.site import load_site
root = Path({root!r})
fd = mount_hung(str(root / "lustre"))
(root / "proc" / "mounts").write_text(
    (root / "proc" / "mounts").read_text()
    + "10.1.0.5@o2ib:/lfs01 /lustre lustre rw,flock,lazystatfs 0 0\n")
cls = load_site({site!r}).node_class(name="h100")
cls = replace(cls, node=replace(cls.node, required_mounts=["/home", "/lustre"],
                                mount_probe_timeout_s=1.0))
ctx = ProbeContext(cls, "h100", root=root, state_dir=Path({state!r}), phase="prolog")
t0 = time.monotonic()
a = run_checks(["node"], ctx, timeout_s=3.0, cap_s=5.0).checks[0]
took = time.monotonic() - t0
# Probe bound longer than the check's own timeout: the runner kills the check (on_timeout).
slow = replace(cls, node=replace(cls.node, mount_probe_timeout_s=30.0))
b = run_checks(["node"], replace(ctx, node_class=slow), timeout_s=1.0, cap_s=3.0).checks[0]
print(json.dumps({{"a": [a.status.name, a.summary], "took": took,
                   "b": [b.status.name, b.summary]}}))
"""


@pytest.mark.skipif(not fuse_available() or not shutil.which("unshare"),
                    reason="needs root, /dev/fuse and unshare for a real hung mount")
def test_hung_mount_is_critical_not_a_crash(tmp_path: Path) -> None:
    """A real hung mount (FUSE, no daemon answer) listed in proc/mounts: the node check
    reports it hung within its bound; with a longer bound the runner's kill is CRITICAL too."""
    root = healthy_copy(tmp_path)
    (tmp_path / "state").mkdir()
    script = HUNG_SCRIPT.format(repo=str(REPO), root=str(root), site=str(REPO / "site.yaml"),
                                state=str(tmp_path / "state"))
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["a"] == ["CRITICAL", "mount /lustre hung (no answer in 1 s)"], out
    assert out["took"] < 2.5, out  # bounded by the probe's 1 s, not the check's 3 s
    assert out["b"][0] == "CRITICAL", out
    assert out["b"][1] == "no answer in 1 s (a file system is hung: required mounts /home, /lustre)"


# -- DCGM diagnostics ---------------------------------------------------------------------------


def dcgm_facts(name: str, level: int) -> DcgmFacts:
    results, version = parse_diag((FIXTURES / name).read_text())
    return DcgmFacts(level, True, results, version)


def test_dcgm_absent_is_unknown_not_ok(h100: NodeClass, tmp_path: Path) -> None:
    """The fixture node has no /usr/bin/dcgmi: nothing was diagnosed."""
    r = get_check("dcgm").run_once(fixture_ctx(h100, "h100-healthy", tmp_path))
    assert r.status is Status.UNKNOWN and r.summary.startswith("DCGM not installed"), r


def test_dcgm_diag_pass_fail_and_config_only(h100: NodeClass) -> None:
    ok = evaluate_dcgm(dcgm_facts("dcgm-diag-3x-r1-pass.json", 1), h100)
    assert ok.status is Status.OK and ok.summary == "diag r1: 9 passed, 0 skipped (DCGM 3.3.5)", ok
    bad = evaluate_dcgm(dcgm_facts("dcgm-diag-4x-r2-memory-fail.json", 2), h100)
    assert bad.status is Status.CRITICAL, bad
    assert bad.summary.startswith("diag r2 GPU 3 memory failed: A memory mismatch was detected")
    assert bad.metrics["failed_count"] == 1 and bad.metrics["results_count"] == 24
    # Persistence mode off fails every GPU with CONFIG severity: warned, not drained.
    cfg = evaluate_dcgm(dcgm_facts("dcgm-diag-4x-r1-persistence-off.json", 1), h100)
    assert cfg.status is Status.WARNING and "Persistence mode for GPU 0 is disabled" in cfg.summary


def test_dcgm_output_parsing_edges(h100: NodeClass) -> None:
    with pytest.raises(ValueError):
        parse_diag("Error: unable to establish a connection to the specified host: localhost")
    with pytest.raises(ValueError):
        parse_diag('{"something": "else"}')
    # dcgmi may print a line before the JSON; warnings may be plain strings; status any case.
    text = ('Successfully ran diagnostic for group.\n{"DCGM GPU Diagnostic": {"test_categories": '
            '[{"category": "Stress", "tests": [{"name": "Targeted Power", "results": '
            '[{"gpu_ids": "1", "status": "WARN", "warnings": ["Power 601 W below 650 W"]}]}]}]}}')
    results, version = parse_diag(text)
    assert version is None and results[0].status == "warn" and results[0].gpus == "1"
    r = evaluate_dcgm(DcgmFacts(3, True, results), h100)
    assert r.status is Status.WARNING and r.summary == (
        "diag r3 GPU 1 Targeted Power warned: Power 601 W below 650 W")
    assert evaluate_dcgm(DcgmFacts(1, True, ()), h100).status is Status.UNKNOWN
