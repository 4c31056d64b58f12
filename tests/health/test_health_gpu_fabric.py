"""Issue 11, GPU: NVLink state and error counters, the NVLink fabric (GpuFabricInfo), ECC by
location, the row remapper histogram, throttle shares from the violation counters, power limit
and application clocks, NVSwitch SXids, the CUDA driver and VBIOS versions in the snapshot.

Probes read the SYNTHETIC fixtures of tests/data/health (make_fixtures_gpu.py: the healthy
H100 node with one change each, tests/data/README.md) and the unedited real recordings; a
stored reading (`state/gpu_counters.json`) is copied to a fresh state dir as a node would
have it from its previous run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.health.checks import get_check, gpu_fabric
from bluevela.health.context import ProbeContext
from bluevela.health.kmsg import kmsg_record_line, parse_sxids
from bluevela.health.nvml_fields import FIELDS_BY_NAME, LATE_FIELDS
from bluevela.health.nvml_live import read_gpu_fields
from bluevela.health.nvml_snapshot import cuda_version_text, load_snapshot, short_pci
from bluevela.health.result import CheckResult, Status
from bluevela.site import NodeClass
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


def run_gpu(cls: NodeClass, fixture: str | Path, tmp: Path, phase: str = "healthcheck",
            snapshot: Path | None = None) -> CheckResult:
    fx = FIXTURES / fixture
    state = tmp / "state"
    if not state.exists():
        if (fx / "state").is_dir():
            shutil.copytree(fx / "state", state)
        else:
            state.mkdir(parents=True)
    ctx = ProbeContext(cls, "h100", root=FIXTURES / "h100-healthy" / "root",
                       nvml_snapshot=snapshot or fx / "nvml.json", phase=phase, state_dir=state)
    return get_check("gpu").run_once(ctx)


# -- each item on its failing fixture ----------------------------------------------------------


@pytest.mark.parametrize(("fixture", "status", "reason"), [
    ("h100-gpu-nvlink-down", Status.CRITICAL, "GPU 3 (0000:5D:00.0) NVLink 7 down"),
    ("h100-gpu-nvlink-recovery-rising", Status.WARNING,
     "GPU 2 (0000:3A:00.0) NVLink 5 recovery +4 in 10 min (allowed +0); "
     "GPU 2 (0000:3A:00.0) NVLink 5 replay +2039 in 10 min (allowed +1000)"),
    ("h100-gpu-fabric-in-progress", Status.CRITICAL,
     "GPU 0 (0000:18:00.0) NVLink fabric IN_PROGRESS (Fabric Manager has not registered the GPU)"),
    ("h100-gpu-sram-uncorrectable", Status.CRITICAL,
     "GPU 6 (0000:BA:00.0) 1 SRAM uncorrectable ECC errors (volatile): reset the GPU"),
    ("h100-gpu-dram-corrected-high", Status.WARNING,
     "GPU 1 (0000:2A:00.0) 4211 DRAM corrected ECC errors (volatile) > 1000"),
    ("h100-gpu-row-remap-low-spares", Status.WARNING,
     "GPU 4 (0000:9A:00.0) 3 memory banks with few spare rows (low 2, none 1) > 0"),
    ("h100-gpu-thermal-throttled", Status.WARNING,
     "GPU 5 (0000:AB:00.0) thermal-throttled 30% of the time in 10 min (> 5%)"),
    ("h100-gpu-power-limit-lowered", Status.WARNING,
     "GPU 7 (0000:DB:00.0) power limit 500 W, class 700 W"),
    ("h100-gpu-app-clock-low", Status.WARNING,
     "GPU 1 (0000:2A:00.0) application SM clock 1410 MHz, class 1980 MHz"),
    ("h100-gpu-sxid-fatal", Status.CRITICAL,
     "nvidia-nvswitch2 (PCI 0000:07:00.0) SXid 24007 fatal: Link 30 sourcetrack timeout error"),
    ("h100-gpu-sxid-nonfatal", Status.WARNING,
     "nvidia-nvswitch1 (PCI 0000:06:00.0) SXid 20009 non-fatal: Link 28 RX Short Error Rate"),
])
def test_failing_fixture(h100: NodeClass, tmp_path: Path, fixture: str, status: Status,
                         reason: str) -> None:
    r = run_gpu(h100, fixture, tmp_path)
    assert r.status is status, r
    assert reason in r.summary, r.summary


def test_healthy_fixture_reads_every_new_field_and_passes(h100: NodeClass, tmp_path: Path) -> None:
    r = run_gpu(h100, "h100-healthy", tmp_path)
    assert r.status is Status.OK, r
    assert "144 NVLinks up" in r.summary and "not reported" not in r.summary, r.summary
    assert r.metrics["nvlink_down_count"] == 0 and r.metrics["fabric_not_completed_count"] == 0
    assert r.metrics["ecc_sram_uncorrected_volatile_total"] == 0
    comp = r.components[3]["values"]
    assert comp["nvlink_up_count"] == 18 and comp["app_clock_sm_mhz"] == 1980
    snap = load_snapshot(FIXTURES / "h100-healthy" / "nvml.json")
    g = snap.gpus[0]
    assert snap.cuda_driver_version == "12.2"  # NVML's 12020
    assert g.vbios_version == "96.00.74.00.0D"
    assert g.fabric_state == 3 and g.fabric_status == 0
    assert g.row_remap_histogram == {"max": 2560, "high": 0, "partial": 0, "low": 0, "none": 0}
    assert g.clocks_violation is not None and set(g.clocks_violation) == {
        "power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability",
        "total_app_clocks", "total_base_clocks"}
    # The reading is stored for the next run's "since the last reading".
    stored = json.loads((tmp_path / "state" / gpu_fabric.GPU_COUNTERS).read_text())
    assert set(stored["gpus"]) == {x.uuid for x in snap.gpus}


def test_counters_rising_between_two_real_runs(h100: NodeClass, tmp_path: Path) -> None:
    """The probe's own stored reading is the baseline: the healthy node, then the same node
    with NVLink 5 recovery +4, in one state dir. The stored reading is only replaced once it
    is throttle_min_interval_s old, so the second run (seconds later) still sees it."""
    assert run_gpu(h100, "h100-healthy", tmp_path).status is Status.OK
    data = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    data["gpus"][2]["nvlink_errors"][5]["recovery"] = 4
    snap = tmp_path / "nvml.json"
    snap.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-healthy", tmp_path, snapshot=snap)
    assert r.status is Status.WARNING and "GPU 2 (0000:3A:00.0) NVLink 5 recovery +4 in" in r.summary
    # A recovery counter that did not move since the stored reading is fine.
    cls = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, throttle_min_interval_s=0))
    run_gpu(cls, "h100-healthy", tmp_path, snapshot=snap)  # stores the +4 reading
    assert run_gpu(cls, "h100-healthy", tmp_path, snapshot=snap).status is Status.OK


def test_missing_links_and_fabric_status(h100: NodeClass, tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    data["gpus"][1]["nvlink_state"] = data["gpus"][1]["nvlink_state"][:12]
    data["gpus"][5]["fabric_status"] = 28  # NVML_ERROR_GPU_NOT_FOUND
    data["gpus"][6]["nvlink_state"] = [False] * 18  # every link of a GPU down: one reason
    data["gpus"][7]["nvlink_state"][2] = data["gpus"][7]["nvlink_state"][9] = False
    snap = tmp_path / "nvml.json"
    snap.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-healthy", tmp_path, snapshot=snap)
    assert r.status is Status.CRITICAL
    assert "GPU 1 (0000:2A:00.0) 12 of 18 NVLinks" in r.summary
    assert "GPU 5 (0000:AB:00.0) NVLink fabric COMPLETED with status GPU_NOT_FOUND" in r.summary
    assert "GPU 6 (0000:BA:00.0) NVLinks 0,1,2,3,4,5... (18) down" in r.summary
    assert "GPU 7 (0000:DB:00.0) NVLinks 2,9 down" in r.summary
    # Not an NVSwitch class, no link count: neither is judged.
    loose = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, nvlinks=0, nvswitch=False))
    assert run_gpu(loose, "h100-healthy", tmp_path / "b", snapshot=snap).status is Status.OK


def test_power_share_below_the_cap_is_ok(h100: NodeClass, tmp_path: Path) -> None:
    """A busy GPU at its power cap 60% of the time is normal (cap 90%); a stored reading
    younger than throttle_min_interval_s is not judged at all."""
    data = json.loads((FIXTURES / "h100-gpu-thermal-throttled" / "nvml.json").read_text())
    g = data["gpus"][5]["clocks_violation"]
    g["thermal"]["violation_ns"] = 5_000_000_000_000  # as stored
    g["power"]["violation_ns"] = int(0.6 * 600e9)
    snap = tmp_path / "nvml.json"
    snap.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-gpu-thermal-throttled", tmp_path, snapshot=snap)
    assert r.status is Status.OK, r
    assert r.metrics["throttle_power_pct_max"] == pytest.approx(60.0)
    short = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, throttle_min_interval_s=3600))
    r = run_gpu(short, "h100-gpu-thermal-throttled", tmp_path / "b")
    assert r.status is Status.OK and "throttle_thermal_pct_max" not in r.metrics


def test_aggregate_sram_only_warns(h100: NodeClass, tmp_path: Path) -> None:
    """Lifetime SRAM errors stay after the GPU was reset (volatile 0): reported, not drained."""
    data = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    data["gpus"][6]["ecc_sram_uncorrected_aggregate"] = 2
    data["gpus"][6]["ecc_uncorrected_aggregate"] = 2
    snap = tmp_path / "nvml.json"
    snap.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-healthy", tmp_path, snapshot=snap)
    assert r.status is Status.WARNING
    assert "GPU 6 (0000:BA:00.0) 2 SRAM uncorrectable ECC errors (aggregate)" in r.summary


def test_per_gpu_prometheus_series(h100: NodeClass, tmp_path: Path) -> None:
    from bluevela.health.metrics import merge_last_results, render
    from bluevela.health.result import HealthReport

    r = run_gpu(h100, "h100-gpu-nvlink-recovery-rising", tmp_path)
    text = render(merge_last_results(tmp_path, HealthReport("quick", (r,)), "healthcheck"), "n1")
    lines = {line.split("{")[0] + "/" + line.split('gpu="')[1].split('"')[0]: line.rsplit(" ", 1)[1]
             for line in text.splitlines()
             if line.startswith("bluevela_gpu_nvlink_") and 'gpu="' in line}
    assert lines["bluevela_gpu_nvlink_recovery_error_count_total/2"] == "4"
    assert lines["bluevela_gpu_nvlink_replay_error_count_total/2"] == "2051"
    assert lines["bluevela_gpu_nvlink_down/3"] == "0"


# -- older recordings: the new fields absent, not judged ---------------------------------------


@pytest.mark.parametrize(("recording", "model", "cuda"), [
    ("nvml-real-h100-1gpu.json", "NVIDIA H100 80GB HBM3", "13.0"),
    ("nvml-real-h200-1gpu.json", "NVIDIA H200", "13.0"),
])
def test_recordings_without_the_new_fields_still_evaluate(h100: NodeClass, tmp_path: Path,
                                                          recording: str, model: str,
                                                          cuda: str) -> None:
    one = dataclasses.replace(h100, gpus=1, gpu_model=model)
    r = run_gpu(one, "h100-healthy", tmp_path, snapshot=FIXTURES / recording)
    # An 18-NVLink class and a recording without NVLink state: reported, not drained (issue 16:
    # OK before, "not reported by NVML" in passing).
    assert r.status is Status.WARNING, r
    assert r.summary == ("NVLink state not in the recorded snapshot for GPU 0 (class has 18 "
                         "NVLinks per GPU): an older recording, or no NVLink")
    # The rest that the recording lacks is not judged, only named.
    pcie = dataclasses.replace(one, gpu=dataclasses.replace(one.gpu, nvlinks=0))
    r = run_gpu(pcie, "h100-healthy", tmp_path, snapshot=FIXTURES / recording)
    assert r.status is Status.OK, r
    assert ("not reported by NVML: fabric state, SRAM ECC, row remapper histogram, violation "
            "counters, application clocks") in r.summary
    snap = load_snapshot(FIXTURES / recording)
    assert snap.cuda_driver_version == cuda
    assert snap.gpus[0].vbios_version is None and snap.gpus[0].nvlink_state is None


def test_recording_with_every_field_evaluates(h100: NodeClass, tmp_path: Path) -> None:
    """`bv health snapshot` on a real H200 VM on 2026-11-27 (benchmarks/device/run.sh), after
    issue 11's fields landed: every field the synthetic healthy snapshot has, with real values.
    That VM's GPU has no NVLink and no NVSwitch fabric: NVML answers an empty NVLink list (its
    NVLink calls "Not Supported") and fabric state 0 (NOT_SUPPORTED)."""
    rec = FIXTURES / "nvml-real-h200-1gpu-all-fields.json"
    real = json.loads(rec.read_text())
    synthetic = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    assert set(synthetic) <= set(real) and set(real["gpus"][0]) == set(synthetic["gpus"][0])
    g = real["gpus"][0]
    assert g["vbios_version"] and g["nvlink_state"] == [] and g["fabric_state"] == 0
    assert g["errors"]["nvlink_state"] == "Not Supported"
    assert g["row_remap_histogram"]["max"] > 0 and g["app_clock_sm_mhz"] == 1980
    one = dataclasses.replace(h100, gpus=1, gpu_model="NVIDIA H200")
    # In an HGX class (18 NVLinks, NVSwitch) such a GPU is drained: a PCIe card or a VM's
    # passthrough GPU where NVLinks and a registered fabric are expected.
    r = run_gpu(one, "h100-healthy", tmp_path, snapshot=rec)
    assert r.status is Status.CRITICAL, r
    assert r.summary.startswith("GPU 0 (0000:00:06.0) 0 of 18 NVLinks; GPU 0 (0000:00:06.0) "
                                "NVLink fabric NOT_SUPPORTED"), r.summary
    # Without NVLinks but with the H100 SXM's application clocks (site.yaml's h100 class): the
    # H200's default memory clock (HBM3e) is 3201 MHz, not the H100's 2619.
    pcie = dataclasses.replace(one, gpu=dataclasses.replace(one.gpu, nvlinks=0, nvswitch=False))
    r = run_gpu(pcie, "h100-healthy", tmp_path, snapshot=rec)
    assert r.status is Status.WARNING, r
    assert r.summary.startswith("GPU 0 (0000:00:06.0) application memory clock 3201 MHz"), r
    # In a class of such machines, with the H200's clocks: OK, nothing "not reported": every
    # field was read.
    pcie = dataclasses.replace(pcie, gpu=dataclasses.replace(pcie.gpu, app_clock_mem_mhz=3201))
    r = run_gpu(pcie, "h100-healthy", tmp_path, snapshot=rec)
    assert r.status is Status.OK, r
    assert r.summary.startswith("1 x NVIDIA H200 OK") and "not reported" not in r.summary, r
    snap = load_snapshot(rec)
    assert snap.cuda_driver_version == "13.0" and snap.gpus[0].nvlink_state == ()


# -- a live reading without NVLink state (issue 16 §5) ------------------------------------------


def _live_from(monkeypatch: pytest.MonkeyPatch, recording: Path) -> None:
    """The live path (no BV_NVML_SNAPSHOT) reading what a real H100 VM's NVML answered: the
    recording stands in for this machine's missing GPU at the NVML source seam only."""
    from bluevela.health.checks import gpu
    from bluevela.health.nvml import ReplayNVML

    monkeypatch.setattr(gpu, "nvml_source", lambda ctx: ReplayNVML(recording))


def test_live_reading_without_nvlink_state_on_an_nvlink_class_drains(
        h100: NodeClass, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Old main: "1 x NVIDIA H100 80GB HBM3 OK ...; not reported by NVML: NVLink state, ..."."""
    from bluevela.health.checks.gpu import evaluate_gpu, probe_gpu

    rec = FIXTURES / "nvml-real-h100-1gpu.json"
    one = dataclasses.replace(h100, gpus=1, gpu_model="NVIDIA H100 80GB HBM3")
    _live_from(monkeypatch, rec)
    kmsg = tmp_path / "dmesg.txt"
    kmsg.write_text("", encoding="utf-8")
    ctx = ProbeContext(one, "h100", root=FIXTURES / "h100-healthy" / "root", kmsg=kmsg,
                       phase="prolog", state_dir=tmp_path / "state")
    facts = probe_gpu(ctx)
    assert facts.live and facts.snapshot is not None
    assert facts.snapshot.gpus[0].nvlink_state is None
    r = evaluate_gpu(facts, one)
    assert r.status is Status.CRITICAL, r
    assert r.summary == ("NVLink state not reported by NVML on GPU 0 (class has 18 NVLinks per "
                         "GPU): a PCIe card in an SXM class, or a broken NVLink fabric")
    # The same reading from the snapshot file: an old recording, WARNING.
    replay = dataclasses.replace(ctx, nvml_snapshot=rec)
    assert not probe_gpu(replay).live
    assert evaluate_gpu(probe_gpu(replay), one).status is Status.WARNING
    # A class without NVLinks is not judged on them, live or not.
    pcie = dataclasses.replace(one, gpu=dataclasses.replace(one.gpu, nvlinks=0))
    assert evaluate_gpu(probe_gpu(dataclasses.replace(ctx, node_class=pcie)), pcie).status \
        is Status.OK


def test_every_gpu_silent_is_one_reason(h100: NodeClass, tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    for g in data["gpus"]:
        g.pop("nvlink_state")
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-healthy", tmp_path, snapshot=path)
    assert r.status is Status.WARNING
    assert r.summary.startswith("NVLink state not in the recorded snapshot for every GPU "), r
    data["gpus"][2]["nvlink_state"] = [True] * 18
    path.write_text(json.dumps(data))
    r = run_gpu(h100, "h100-healthy", tmp_path, snapshot=path)
    assert "for GPU 0,1,3,4,5,6,7 (class has 18" in r.summary, r


# -- formats -----------------------------------------------------------------------------------


def test_versions_and_pci_forms() -> None:
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(12020) == "12.2"
    assert cuda_version_text(13000) == "13.0"
    assert cuda_version_text("12.4") == "12.4"
    assert cuda_version_text(None) is None and cuda_version_text(0) is None
    assert short_pci("00000000:5D:00.0") == "0000:5D:00.0"
    assert short_pci("0000:5d:00.0") == "0000:5d:00.0"


def test_sxid_lines_are_kept_from_kmsg_and_parsed() -> None:
    rec = ("3,2101,812345678,-;nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, "
           "Link 32 egress non-posted PRIV error (First)")
    line = kmsg_record_line(rec)
    assert line == ("[  812.345678] nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, "
                    "Non-fatal, Link 32 egress non-posted PRIV error (First)")
    assert kmsg_record_line("6,1,2,-;usb 1-1: new device") is None
    (x,) = parse_sxids([line])
    assert (x.switch, x.pci, x.code, x.fatal, x.at_s) == (
        "nvidia-nvswitch3", "0000:05:00.0", 12028, False, 812.345678)
    (y,) = parse_sxids(["nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 11001, Fatal, "
                        "ingress invalid command"])
    assert y.fatal is True and y.text == "ingress invalid command"
    # An SXid older than the window does not count (like XIDs).
    problems, counted = gpu_fabric.sxid_problems([x, y], uptime_s=812.345678 + 7200,
                                                 window_s=3600)
    assert (problems, counted) == ([(Status.CRITICAL, "nvidia-nvswitch0 (PCI 0000:c3:00.0) SXid "
                                     "11001 fatal: ingress invalid command; reset the NVSwitch "
                                     "and its GPUs (restart Fabric Manager)")], 1)


# -- the live gather's NVLink loop and guards (a binding shaped like pynvml's) -------------------


class _NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


class _Binding:
    """pynvml's names and error behaviour for the calls that read the LATE_FIELDS make: 18 links
    (link 18 and above: NVML_ERROR_INVALID_ARGUMENT), link 4 down, link 9's state unreadable,
    link 2's replay counter failing, no fabric call in this binding, no row remapper support."""

    NVMLError = _NVMLError
    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_UNKNOWN = 3, 2, 999
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 36
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_MEMORY_LOCATION_DRAM, NVML_MEMORY_LOCATION_SRAM = 2, 7
    NVML_PERF_POLICY_POWER, NVML_PERF_POLICY_THERMAL = 0, 1
    NVML_PERF_POLICY_SYNC_BOOST, NVML_PERF_POLICY_BOARD_LIMIT = 2, 3
    NVML_PERF_POLICY_LOW_UTILIZATION, NVML_PERF_POLICY_RELIABILITY = 4, 5
    NVML_PERF_POLICY_TOTAL_APP_CLOCKS, NVML_PERF_POLICY_TOTAL_BASE_CLOCKS = 10, 11
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    calls = 0

    def nvmlDeviceGetVbiosVersion(self, h: Any) -> bytes:  # noqa: N802
        return b"96.00.99.00.01"

    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:  # noqa: N802
        self.calls += 1
        if link >= 18:
            raise _NVMLError(2, "Invalid Argument")
        if link == 9:
            raise _NVMLError(999, "Unknown Error")
        return 0 if link == 4 else 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:  # noqa: N802
        if link == 2 and counter == 0:
            raise _NVMLError(999, "Unknown Error")
        return link * 10 + counter

    def nvmlDeviceGetMemoryErrorCounter(self, h: Any, kind: int, counter: int, loc: int) -> int:  # noqa: N802
        return 1 if (kind, counter, loc) == (1, 0, 7) else 0

    def nvmlDeviceGetRowRemapperHistogram(self, h: Any) -> Any:  # noqa: N802
        raise _NVMLError(3, "Not Supported")

    def nvmlDeviceGetViolationStatus(self, h: Any, policy: int) -> Any:  # noqa: N802
        return type("V", (), {"referenceTime": 1_000_000, "violationTime": policy * 7})()

    def nvmlDeviceGetApplicationsClock(self, h: Any, clock: int) -> int:  # noqa: N802
        return {1: 1980, 2: 2619}[clock]


def test_live_gather_records_links_until_nvml_says_none(tmp_path: Path) -> None:
    nv = _Binding()
    errs: dict[str, str] = {}

    def get(key: str, fn: Any) -> Any:
        try:
            return fn()
        except nv.NVMLError as exc:
            errs[key] = str(exc)
        except (AttributeError, TypeError, ValueError) as exc:
            errs[key] = f"{type(exc).__name__}: {exc}"
        return None

    g: dict[str, Any] = {"index": 0}
    t0 = time.perf_counter()
    g.update(read_gpu_fields(nv, object(), tuple(FIELDS_BY_NAME[f] for f in LATE_FIELDS),
                             errs, get))
    assert time.perf_counter() - t0 < 0.5
    assert nv.calls == 19  # links 0..17, then link 18 ends the list
    assert g["nvlink_state"] == [True] * 4 + [False] + [True] * 4 + [None] + [True] * 8
    assert errs["nvlink_state[9]"] == "Unknown Error"
    assert g["nvlink_errors"][2] == {"recovery": 21, "crc_flit": 22, "crc_data": 23}
    assert errs["nvlink_errors[2].replay"] == "Unknown Error"
    assert g["fabric_state"] is None and "fabric" in errs  # the binding has no fabric call
    assert g["row_remap_histogram"] is None and errs["row_remap_histogram"] == "Not Supported"
    assert g["ecc_sram_uncorrected_volatile"] == 1 and g["ecc_dram_uncorrected_volatile"] == 0
    assert g["clocks_violation"]["thermal"] == {"reference_us": 1_000_000, "violation_ns": 7}
    assert g["vbios_version"] == "96.00.99.00.01" and g["app_clock_mem_mhz"] == 2619
    # What it recorded is what the snapshot parser and the check read.
    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    snap["gpus"][0].update({k: v for k, v in g.items() if k != "index"})
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(snap))
    gpu = load_snapshot(path).gpus[0]
    assert gpu.nvlink_state is not None and gpu.nvlink_state[4] is False
    assert gpu.ecc_sram_uncorrected_volatile == 1


@pytest.mark.gpu
def test_live_snapshot_has_the_new_fields() -> None:
    """On a real GPU: every new field is recorded, as a value or with NVML's reason."""
    from bluevela.health.nvml_live import gather_live

    t0 = time.perf_counter()
    data = gather_live(include_kmsg=False)
    took = time.perf_counter() - t0
    print(f"\ngather_live: {took:.3f} s for {data['device_count']} GPU(s)")
    assert isinstance(data["cuda_driver_version"], int)
    # field -> the `errors` key NVML's refusal is recorded under
    why = {"vbios_version": "vbios_version", "nvlink_state": "nvlink_state", "fabric_state": "fabric",
           "ecc_sram_uncorrected_volatile": "ecc_sram_uncorrected_volatile",
           "row_remap_histogram": "row_remap_histogram", "clocks_violation": "clocks_violation.",
           "app_clock_sm_mhz": "app_clock_sm_mhz"}
    for g in data["gpus"]:
        unsupported = {}
        for key, err in why.items():
            assert key in g
            if g[key] is None:
                found = [k for k in g["errors"] if k.startswith(err)]
                assert found, (key, g["errors"])
                unsupported[key] = g["errors"][found[0]]
        print(f"GPU {g['index']} not supported: {unsupported}")


# -- on the real dev cluster ----------------------------------------------------------------------


@pytest.mark.cluster
def test_cluster_node_with_an_nvlink_down_is_drained_and_the_job_runs_elsewhere(
        devcluster: object, tmp_path: Path) -> None:
    """node1's hook.env points at the snapshot with GPU 3's NVLink 7 down. A 2-node job lands on
    node[1-2]; node1's prolog drains it naming the GPU, its PCI id and the link; Slurm requeues
    the job, which completes on node[2-3]. Old main: the gpu check read no NVLink state, the
    job ran on node1."""
    from tests.conftest import DevCluster
    from tests.hooks.test_hooks_cluster import point_at, requeued_off_node1

    assert isinstance(devcluster, DevCluster)
    with devcluster.clean(settle=True, bv_resume=["node1"]):
        point_at(devcluster, "node1", "h100-gpu-nvlink-down")
        requeued_off_node1(devcluster, tmp_path, "bv: gpu: GPU 3 (0000:5D:00.0) NVLink 7 down",
                           timeout=300)
