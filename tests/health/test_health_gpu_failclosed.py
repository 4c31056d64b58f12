"""Issue 9, items 2 and 4: a broken GPU stack fails closed, and a healthy node is not drained
by a single reading, an old XID, another job's GPU or our own nccl workers.

Every probe reads a recorded-format snapshot (tests/data/health/, written by make_fixtures.py
or recorded live with `gather_live`) or this machine's real NVML and /proc; the hang goes
through the real forked runner and its timeout.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bluevela.bench.catalog import get as get_measurement
from bluevela.bench.evaluate import GPUS_FIGURE, evaluate, short_of_gpus
from bluevela.bench.result import Facts
from bluevela.bench.result import Status as BenchStatus
from bluevela.health.checks import get_check
from bluevela.health.checks.gpu import XID_TABLE, evaluate_gpu, probe_gpu
from bluevela.health.context import ProbeContext, parse_gpu_list
from bluevela.health.nvml_snapshot import load_snapshot
from bluevela.health.result import Status
from bluevela.health.runner import plan_tier, run_checks, run_plan
from bluevela.hooks.env import HookContext
from bluevela.site import NodeClass, Site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


def ctx_on(cls: NodeClass, fixture: str, phase: str = "prolog",
           job_gpus: tuple[int, ...] | None = None, name: str = "h100") -> ProbeContext:
    fx = FIXTURES / fixture
    return ProbeContext(cls, name, root=fx / "root", nvml_snapshot=fx / "nvml.json",
                        phase=phase, job_gpus=job_gpus)


# -- item 2: NVML that cannot start -------------------------------------------------------------


@pytest.mark.parametrize(("fixture", "reason"), [
    ("h100-gpu-nvml-driver-not-loaded", "NVML: Driver Not Loaded"),
    ("h100-gpu-nvml-version-mismatch", "NVML: RM has detected an NVML/RM version mismatch."),
])
def test_nvml_init_failure_is_critical_with_nvmls_words(h100: NodeClass, fixture: str,
                                                        reason: str) -> None:
    """Old main: UNKNOWN "NVML unavailable" live, so the prolog admitted the job."""
    r = get_check("gpu").run_once(ctx_on(h100, fixture))
    assert r.status is Status.CRITICAL and r.summary == reason


def test_real_recording_without_a_driver_is_critical(h100: NodeClass, site: Site) -> None:
    """nvml-real-no-driver.json was recorded by gather_live on this VM (no NVIDIA driver)."""
    fx = FIXTURES / "nvml-real-no-driver.json"
    assert load_snapshot(fx).init_error == "NVML Shared Library Not Found"
    r = get_check("gpu").run_once(ProbeContext(h100, "h100", nvml_snapshot=fx, phase="prolog"))
    assert (r.status, r.summary) == (Status.CRITICAL, "NVML: NVML Shared Library Not Found")
    # A class without GPUs is not judged on NVML: could not run, never CRITICAL.
    cpu = site.node_class(name="cpu")
    r = get_check("gpu").run_once(ProbeContext(cpu, "cpu", nvml_snapshot=fx))
    assert r.status is Status.UNKNOWN


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_live_nvml_without_a_driver_is_critical(h100: NodeClass) -> None:
    pytest.importorskip("pynvml")
    r = evaluate_gpu(probe_gpu(ProbeContext(h100, "h100", phase="prolog")), h100)
    assert r.status is Status.CRITICAL and r.summary.startswith("NVML: "), r


def test_pynvml_missing_is_unknown_and_logged_as_installation_error(
        h100: NodeClass, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with caplog.at_level(logging.ERROR, logger="bluevela.health.checks.gpu"):
        r = evaluate_gpu(probe_gpu(ProbeContext(h100, "h100", phase="prolog")), h100)
    assert r.status is Status.UNKNOWN
    assert "bluevela installation error" in r.summary and "nvidia-ml-py" in r.summary
    assert any("installation error" in rec.getMessage() for rec in caplog.records)


def test_nvml_hang_is_critical_through_the_runner_timeout(h100: NodeClass, site: Site) -> None:
    """The replayed hang blocks in the check's forked child until the quick tier's 3 s timeout
    kills it. Old main: the replay did not hang, and a timeout was UNKNOWN."""
    plan = plan_tier(site, "quick", ["gpu", "node"])
    t0 = time.monotonic()
    report = run_plan(plan, ctx_on(h100, "h100-gpu-nvml-hang"))
    took = time.monotonic() - t0
    gpu = report.result("gpu")
    assert gpu is not None and gpu.status is Status.CRITICAL
    assert gpu.summary == "NVML timed out after 3 s"
    assert report.drain_detail() == "gpu: NVML timed out after 3 s"
    assert report.result("node").status is Status.OK  # type: ignore[union-attr]
    assert 2.9 <= took < 5.0, took


def test_a_timeout_on_a_class_without_gpus_stays_unknown(site: Site) -> None:
    cpu = site.node_class(name="cpu")
    rep = run_checks(["gpu"], ctx_on(cpu, "h100-gpu-nvml-hang", name="cpu"), timeout_s=0.5,
                     cap_s=2.0)
    assert rep.checks[0].status is Status.UNKNOWN


# -- item 2: the nightly ------------------------------------------------------------------------


def test_nightly_fewer_gpus_than_the_class_is_critical(h100: NodeClass) -> None:
    """Old main: "could not run" (UNKNOWN), so the nightly did not drain a node missing a GPU."""
    for name in ("gemm", "hbm", "h2d", "d2h", "allreduce"):
        facts = Facts.from_dict(json.loads(json.dumps(short_of_gpus(name, 8, 7).to_dict())))
        r = evaluate(get_measurement(name), facts, h100.bench, gpus=h100.gpus)
        assert r.status is BenchStatus.CRITICAL, r
        assert r.message == f"{name}: 7 of 8 GPUs visible"
        assert [v.name for v in r.failed_figures] == [GPUS_FIGURE]
    # A measurement that could not run for another reason is still UNKNOWN.
    r = evaluate(get_measurement("gemm"), Facts.failed("gemm", "CUDA error"), h100.bench, gpus=8)
    assert r.status is BenchStatus.UNKNOWN


def test_nightly_judges_the_gpu_count_against_the_class(site: Site) -> None:
    """What the nightly controller does with a node job's facts: CRITICAL, and the failure
    text it drains with names the count."""
    from bluevela.bench.nightly import _failure_text, judge

    results = judge([short_of_gpus("gemm", 8, 7), short_of_gpus("hbm", 8, 7)], site, "h100",
                    {}, ["gpu001"])
    assert [r.status for r in results] == [BenchStatus.CRITICAL] * 2
    assert _failure_text(results) == "gemm: 7 of 8 GPUs visible; hbm: 7 of 8 GPUs visible"


# -- item 4: the leftover-process check ---------------------------------------------------------


def test_leftovers_only_on_the_jobs_gpus(h100: NodeClass) -> None:
    """GPU0 is held by another job's process: a job given GPUs 1-2 is not refused. Old main
    looked at every GPU of the node."""
    gpu = get_check("gpu")
    assert gpu.run_once(ctx_on(h100, "h100-gpu-leftover-process", job_gpus=(1, 2))).status is Status.OK
    r = gpu.run_once(ctx_on(h100, "h100-gpu-leftover-process", job_gpus=(0, 1)))
    assert r.status is Status.CRITICAL and "GPU0 1 leftover process(es) (pid 48213" in r.summary


def test_job_gpus_from_slurm(h100: NodeClass) -> None:
    assert parse_gpu_list("0,1,4-5") == (0, 1, 4, 5)
    assert parse_gpu_list("") is None and parse_gpu_list("$(id)") is None
    env = {"SLURM_JOB_GPUS": "2,3", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node1"}
    assert ProbeContext.from_env(h100, "h100", env=env, phase="prolog").job_gpus == (2, 3)
    assert ProbeContext.from_env(h100, "h100", env=env, phase="healthcheck").job_gpus is None
    assert HookContext.from_env("prolog", dict(env)).job_gpus == (2, 3)


def _snapshot_with_procs(tmp_path: Path, pid: int) -> Path:
    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    snap["gpus"][0]["compute_processes"] = [{"pid": pid, "used_memory_bytes": 1 << 30}]
    snap["recheck"] = {"after_s": 1.0, "gpus": [
        {"index": 0, "clocks_event_reasons": 1,
         "compute_processes": [{"pid": pid, "used_memory_bytes": 1 << 30}], "errors": {}}]}
    path = tmp_path / f"nvml-{pid}.json"
    path.write_text(json.dumps(snap))
    return path


def test_our_own_processes_are_not_leftovers(h100: NodeClass, tmp_path: Path) -> None:
    """A process below this hook run (the nccl check's workers) is ours, read from the real
    /proc; pid 1 is not. Old main drained the node for its own nccl workers."""
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = ProbeContext(h100, "h100", root=Path("/"), phase="healthcheck",
                            nvml_snapshot=_snapshot_with_procs(tmp_path, worker.pid))
        rep = run_checks(["gpu"], ours, timeout_s=5.0, cap_s=6.0)  # via the forked runner
        assert rep.checks[0].status is Status.OK, rep.checks[0]
        other = ProbeContext(h100, "h100", root=Path("/"), phase="healthcheck",
                             nvml_snapshot=_snapshot_with_procs(tmp_path, 1))
        r = get_check("gpu").run_once(other)
        assert r.status is Status.CRITICAL and "leftover process(es) (pid 1," in r.summary
    finally:
        worker.kill()
        worker.wait()


# -- item 4: XIDs -------------------------------------------------------------------------------


def test_xid_table_covers_the_codes_issue_11_names() -> None:
    for code in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 123, 140, 143, 154):
        kind = XID_TABLE[code]
        assert kind.what and kind.action, code
    assert XID_TABLE[79].status is Status.CRITICAL and XID_TABLE[63].status is Status.WARNING


def test_xid_window(h100: NodeClass) -> None:
    """The same XID 79 line 388 s before the reading drains; 23 h before it, with the driver
    loaded again since, it does not (old main matched the whole ring buffer: sticky until
    reboot)."""
    gpu = get_check("gpu")
    recent = gpu.run_once(ctx_on(h100, "h100-gpu-xid79-recent"))
    assert recent.status is Status.CRITICAL and "XID 79 on GPU3 (PCI 0000:5d:00)" in recent.summary
    old = gpu.run_once(ctx_on(h100, "h100-gpu-xid79-expired"))
    assert old.status is Status.OK, old
    assert old.metrics["xid_count"] == 0 and old.metrics["xid_outside_window_count"] == 1


def _kmsg_variant(tmp_path: Path, name: str, keep: int, extra: list[str]) -> Path:
    """The xid79-expired snapshot with its first `keep` kernel lines and `extra` after them."""
    snap = json.loads((FIXTURES / "h100-gpu-xid79-expired" / "nvml.json").read_text())
    snap["kmsg"] = snap["kmsg"][:keep] + extra
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(snap))
    return path


def test_a_draining_xid_needs_evidence_of_a_reset(h100: NodeClass, tmp_path: Path) -> None:
    """Issue 24: an XID 79 23 h old with no driver load after it stays CRITICAL, whatever
    xid_window_s (on 9058adc it stopped counting after the 1 h window: the node resumed with
    no evidence the GPU was reset). A driver load BEFORE the XID is no evidence; one after it
    is. An application XID (13, RESTART_APP) still ends with the window."""
    gpu = get_check("gpu")
    root = FIXTURES / "h100-gpu-xid79-expired" / "root"

    def judge(snap: Path) -> object:
        return gpu.run_once(ProbeContext(h100, "h100", root=root, nvml_snapshot=snap))

    no_reset = judge(_kmsg_variant(tmp_path, "no-reset", 2, []))
    assert no_reset.status is Status.CRITICAL, no_reset
    assert "XID 79 on GPU3 (PCI 0000:5d:00)" in no_reset.summary
    assert "no GPU reset since: reload the driver or reboot" in no_reset.summary
    assert no_reset.metrics["xid_count"] == 1
    reload_at = "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
    after = judge(_kmsg_variant(tmp_path, "reload-after", 2, [f"[ 3700.000000] {reload_at}"]))
    assert after.status is Status.OK, after
    xid13 = ("[ 3602.000000] NVRM: Xid (PCI:0000:5d:00): 13, pid=4242, name=python, "
             "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0)")
    app = judge(_kmsg_variant(tmp_path, "app-xid", 1, [xid13]))
    assert app.status is Status.OK and app.metrics["xid_outside_window_count"] == 1, app


def test_unreadable_kernel_log_is_unknown_not_ok(h100: NodeClass, tmp_path: Path) -> None:
    r = get_check("gpu").run_once(ctx_on(h100, "h100-gpu-kmsg-unreadable"))
    assert r.status is Status.UNKNOWN and "kernel log unreadable" in r.summary
    # BV_KMSG naming a file that cannot be read: the same.
    ctx = ProbeContext(h100, "h100", root=FIXTURES / "h100-healthy" / "root",
                       nvml_snapshot=FIXTURES / "h100-healthy" / "nvml.json",
                       kmsg=tmp_path / "absent-dmesg.txt")
    assert get_check("gpu").run_once(ctx).status is Status.UNKNOWN


# -- on the real dev cluster ----------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_cluster_node_without_nvml_is_drained_and_the_job_requeued(devcluster: object,
                                                                    tmp_path: Path) -> None:
    """node1's hook.env points at a snapshot where nvmlInit fails (Driver Not Loaded). A 2-node
    job lands on node[1-2]; node1's prolog drains it with NVML's words and exits 1; Slurm
    requeues the job, which completes on node[2-3]. Then node1 hangs in NVML instead: its
    prolog (run inside the node as slurmd runs it) drains it `NVML timed out after 3 s`.
    Old main: UNKNOWN, exit 0, the job ran on node1."""
    from tests.conftest import DevCluster
    from tests.hooks.test_hooks_cluster import node_state, point_at, requeued_off_node1, run_in_node

    assert isinstance(devcluster, DevCluster)
    cluster = devcluster
    with cluster.clean(settle=True, bv_resume=["node1"]):
        point_at(cluster, "node1", "h100-gpu-nvml-driver-not-loaded")
        requeued_off_node1(cluster, tmp_path, "bv: gpu: NVML: Driver Not Loaded", timeout=400)

        # The hang, through the real prolog inside node1 (its own hook.env), after a resume.
        point_at(cluster, "node1", "h100-gpu-nvml-hang")
        cluster.bv("health", "resume", "node1")  # ours: also frees its fleet-breaker slot
        assert node_state(cluster, "node1")[0] == "idle"
        t0 = time.monotonic()
        proc = run_in_node(cluster, "node1", "prolog",
                           {"SLURM_JOB_ID": "990001", "SLURMD_NODENAME": "node1",
                            "SLURM_JOB_USER": "root", "SLURM_JOB_GPUS": "0,1"})
        took = time.monotonic() - t0
        assert proc.returncode == 1, proc.stderr
        state, reason = node_state(cluster, "node1")
        assert state == "drained" and reason == "bv: gpu: NVML timed out after 3 s", (state, reason)
        assert took < 15, took


@pytest.mark.gpu
def test_live_gpu_process_of_ours_vs_not_ours(tmp_path: Path) -> None:
    """On a real GPU: a CUDA process below this run makes the live reading take its second
    look (`recheck`), and is not a leftover: it is ours."""
    pytest.importorskip("torch")
    from bluevela.health.nvml_live import gather_live
    from bluevela.site import GPUThresholds, NodeClass

    code = ("import torch, time, sys; x = torch.ones(1 << 20, device='cuda'); "
            "torch.cuda.synchronize(); print('ready', flush=True); time.sleep(60)")
    ours = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert ours.stdout is not None and ours.stdout.readline().strip() == "ready"
        data = gather_live(include_kmsg=False, recheck_s=0.5)
        assert "init_error" not in data
        assert data.get("recheck") and data["recheck"]["after_s"] == 0.5, data.get("recheck")
        snap = load_snapshot(_write(tmp_path / "live.json", data))
        cls = NodeClass(nodes="gpu001", gpus=len(snap.gpus), gpu_model=snap.gpus[0].name,
                        gpu=GPUThresholds(require_persistence_mode=False, recheck_s=0.5))
        ctx = ProbeContext(cls, "live", phase="healthcheck")
        r = run_checks(["gpu"], ctx, timeout_s=20, cap_s=25).checks[0]
        assert "leftover" not in r.summary, r
    finally:
        ours.kill()
        ours.wait()


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_kmsg_records_keep_their_time_since_boot() -> None:
    """/dev/kmsg's record format (priority,sequence,usec,flags;message): the time is kept in
    dmesg's form so the XID window can date the line."""
    from bluevela.health.kmsg import kmsg_record_line, parse_xids

    rec = ("4,10233,86012345678,-;NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', "
           "name=<unknown>, GPU has fallen off the bus.\n SUBSYSTEM=pci\n")
    line = kmsg_record_line(rec)
    assert line == ("[86012.345678] NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', "
                    "name=<unknown>, GPU has fallen off the bus.")
    (xid,) = parse_xids([line])
    assert (xid.code, xid.bus, xid.at_s) == (79, "5d:00", 86012.345678)
    assert kmsg_record_line("6,1,2,-;usb 1-1: new device") is None
