"""Issue 11: pinned versions (the `versions` check, `bv health nodes --versions`'s grouping)
and DCGM diagnostics wired by purpose (healthcheck, before resume, nightly).

Probes read fixture roots (tests/data/health): a copy of `h100-healthy` with one file changed
where a test needs a drift. DCGM runs as a real subprocess of the check's forked child: a
stand-in `dcgmi` (tests/data/dcgm-replay/dcgmi) installed in the copied root that prints
a documented-format fixture byte for byte, or never answers.
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

from bluevela.archive.reports import validate_report
from bluevela.archive.spool import SpoolEntry
from bluevela.errors import SiteConfigError
from bluevela.fleet.api import versions_view
from bluevela.fleet.nodestate import dcgm_gate
from bluevela.health import dcgm_runs
from bluevela.health.checks import dcgm as dcgm_mod
from bluevela.health.checks import get_check
from bluevela.health.checks.versions import VersionFacts, cuda_text, evaluate_versions
from bluevela.health.context import ProbeContext
from bluevela.health.metrics import render
from bluevela.health.result import Status
from bluevela.health.runner import plan_tier, run_checks
from bluevela.site import NodeClass, Site, VersionPins
from bluevela.site_file import parse_site
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURES = materialized()
HEALTHY = FIXTURES / "h100-healthy"


def pinned(cls: NodeClass, **pins: object) -> NodeClass:
    return replace(cls, versions=VersionPins(**pins))  # type: ignore[arg-type]


def ctx_on(cls: NodeClass, root: Path) -> ProbeContext:
    return ProbeContext(cls, "h100", root=root, nvml_snapshot=HEALTHY / "nvml.json",
                        phase="healthcheck")


def copy_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(HEALTHY / "root", root, symlinks=True)
    return root


def run_versions(cls: NodeClass, root: Path):  # noqa: ANN201 - CheckResult
    return get_check("versions").run_once(ctx_on(cls, root))


# -- versions: the evaluator on fixture trees ---------------------------------------------------


def test_versions_matching_pins_ok_and_observed_values_reported(h100: NodeClass) -> None:
    cls = pinned(h100, driver="535.129.03", hca_fw="28.39.1002",
                 kernel=["5.15.0-91-generic", "6.1.0-18-amd64"], critical=["driver"])
    r = run_versions(cls, HEALTHY / "root")
    assert r.status is Status.OK, r
    # cuda and vbios come from the snapshot (nvml.py's cuda_driver_version, vbios_version)
    assert r.info == {"driver": "535.129.03", "cuda": "12.2", "vbios": "96.00.74.00.0D",
                      "hca_fw": "28.39.1002", "kernel": "5.15.0-91-generic"}
    assert r.summary == ("driver 535.129.03, cuda 12.2, vbios 96.00.74.00.0D, hca_fw 28.39.1002, "
                         "kernel 5.15.0-91-generic (3 pinned)")
    assert r.metrics == {"pinned_count": 3.0, "mismatched_count": 0.0}


def test_versions_kernel_off_its_pin_critical_or_warning(h100: NodeClass, tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    (root / "proc/sys/kernel/osrelease").write_text("6.1.0-17-amd64\n")
    crit = run_versions(pinned(h100, kernel="6.1.0-18-amd64", critical=["kernel"]), root)
    assert crit.status is Status.CRITICAL
    assert crit.summary == "kernel 6.1.0-17-amd64, pinned 6.1.0-18-amd64"
    warn = run_versions(pinned(h100, kernel="6.1.0-18-amd64"), root)
    assert warn.status is Status.WARNING and warn.summary == crit.summary
    allowed = run_versions(pinned(h100, kernel=["6.1.0-18-amd64", "6.1.0-17-amd64"]), root)
    assert allowed.status is Status.OK
    several = run_versions(pinned(h100, kernel=["6.1.0-18-amd64", "6.1.0-21-amd64"]), root)
    assert several.summary == "kernel 6.1.0-17-amd64, pinned one of 6.1.0-18-amd64, 6.1.0-21-amd64"


def test_versions_one_hca_firmware_differs(h100: NodeClass, tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    (root / "sys/class/infiniband/mlx5_3/fw_ver").write_text("28.38.1000\n")
    r = run_versions(pinned(h100, hca_fw="28.39.1002", critical=["hca_fw"]), root)
    assert r.status is Status.CRITICAL and r.summary == "hca_fw 28.38.1000 (mlx5_3), pinned 28.39.1002"
    assert r.info["hca_fw"] == "28.38.1000,28.39.1002"
    # Unpinned, HCAs of one node that disagree are still worth a warning.
    r = run_versions(h100, root)
    assert r.status is Status.WARNING and r.summary.startswith(
        "hca_fw differs within the node: 28.38.1000 (mlx5_3); 28.39.1002 (mlx5_0, mlx5_1, "), r


def test_versions_pinned_but_unreadable_is_unknown(h100: NodeClass, tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    (root / "proc/sys/kernel/osrelease").unlink()
    r = run_versions(pinned(h100, kernel="6.1.0-18-amd64", critical=["kernel"]), root)
    assert r.status is Status.UNKNOWN
    assert r.summary == "kernel unread (/proc/sys/kernel/osrelease: No such file or directory)"
    assert run_versions(h100, root).status is Status.OK  # not pinned: nothing to judge


def test_versions_vbios_and_cuda_evaluated(h100: NodeClass) -> None:
    facts = VersionFacts(driver="550.90.07", cuda="12.4",
                         vbios=tuple((f"GPU{i}", "96.00.89.00.01") for i in range(8)))
    cls = pinned(h100, cuda="12.4", vbios="96.00.89.00.01")
    assert evaluate_versions(facts, cls).status is Status.OK
    bad = replace(facts, vbios=(*facts.vbios[:3], ("GPU3", "96.00.74.00.01"), *facts.vbios[4:]))
    r = evaluate_versions(bad, cls)
    assert r.status is Status.WARNING and r.summary == "vbios 96.00.74.00.01 (GPU 3), pinned 96.00.89.00.01"
    all_old = replace(facts, vbios=tuple((f"GPU{i}", "96.00.74.00.01") for i in range(8)))
    assert evaluate_versions(all_old, cls).summary == "vbios 96.00.74.00.01 (all 8), pinned 96.00.89.00.01"
    assert cuda_text(12040) == "12.4" and cuda_text(13000) == "13.0" and cuda_text("12.4") == "12.4"
    assert cuda_text(0) is None and cuda_text(None) is None


def test_site_versions_schema(tmp_path: Path) -> None:
    base = (REPO / "site.yaml").read_text()

    def with_cpu(extra: str) -> Site:
        text = base.replace("    gpus: 0\n", f"    gpus: 0\n    {extra}\n", 1)
        return parse_site(text, tmp_path / "site.yaml")

    ok = with_cpu('versions: {kernel: ["6.1.0-18-amd64", "6.1.0-21-amd64"], critical: [kernel]}')
    assert ok.node_classes["cpu"].versions.allowed("kernel") == ("6.1.0-18-amd64", "6.1.0-21-amd64")
    with pytest.raises(SiteConfigError, match="versions.critical names driver, not pinned"):
        with_cpu('versions: {kernel: "6.1.0-18-amd64", critical: [driver]}')
    with pytest.raises(SiteConfigError, match="cuda"):  # 12.4 unquoted is a float, not "12.4"
        with_cpu("versions: {cuda: 12.4}")
    with pytest.raises(SiteConfigError, match="critical"):
        with_cpu('versions: {kernel: "x", critical: [bios]}')


# -- versions travel: runner child -> spool report -> Prometheus -------------------------------


def test_observed_versions_travel_in_the_report_and_prometheus(h100: NodeClass) -> None:
    report = run_checks(["versions"], ctx_on(h100, HEALTHY / "root"), timeout_s=3, cap_s=5,
                        tier="quick")
    r = report.result("versions")
    assert r is not None and r.info["kernel"] == "5.15.0-91-generic"  # across the fork
    body = {"schema": 1, "kind": "node_report", "phase": "prolog", "job_id": 7,
            "node": "gpu001", "time": time.time(), "health": report.to_dict()}
    checked = validate_report(json.loads(json.dumps(body)), SpoolEntry("x", 7, "gpu001", "prolog"))
    assert checked["health"]["checks"][0]["info"] == r.info
    prom = render({"versions": {**r.to_dict(components=True), "time": 1.0}}, hostname="gpu001")
    assert ('bluevela_versions_info{driver="535.129.03",cuda="12.2",vbios="96.00.74.00.0D",'
            'hca_fw="28.39.1002",kernel="5.15.0-91-generic"} 1') in prom


def test_observed_versions_survive_the_archive(h100: NodeClass, tmp_path: Path) -> None:
    """Spool report -> ingest -> HDF5 -> `show_job`: the strings come back as written."""
    from bluevela.archive import query
    from bluevela.archive.ingest import ingest
    from bluevela.archive.spool import write_report

    report = run_checks(["ib", "versions"], ctx_on(h100, HEALTHY / "root"), timeout_s=3,
                        cap_s=5, tier="quick")
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    now = time.time()
    for phase in ("prolog", "epilog"):
        write_report(spool, {"phase": phase, "job_id": 77, "node": "gpu001", "time": now,
                             "nodelist": "gpu001", "num_nodes": 1, "user": "alice",
                             "health": report.to_dict(), "telemetry": {}})
    ingest(spool, archive, now=now + 1)
    job = query.show_job(archive, 77)
    checks = job["nodes"][0]["prolog"]["health"]["checks"]
    got = next(c for c in checks if c["name"] == "versions")
    assert got["info"] == report.result("versions").info and got["info"]["hca_fw"] == "28.39.1002"  # type: ignore[union-attr]


def test_versions_view_groups_a_1000_node_fleet(site: Site) -> None:
    pins = replace(site.node_classes["cpu"], nodes="node[1-1000]",
                   versions=VersionPins(kernel="6.1.0-18-amd64"))
    big = replace(site, node_classes={"cpu": pins})
    names = [f"node{i}" for i in range(1, 1001)]
    observed: dict[str, dict[str, str] | None] = {
        n: {"kernel": "6.1.0-18-amd64", "hca_fw": "28.39.1002"} for n in names}
    for i in (17, 18, 19, 500):
        observed[f"node{i}"] = {"kernel": "6.1.0-17-amd64", "hca_fw": "28.39.1002"}
    observed["node999"] = {"kernel": "6.1.0-18-amd64", "hca_fw": "28.38.1000"}
    observed["node1000"] = None
    view = versions_view(big, observed, names)
    data = view.to_dict()
    assert [(g["nodes"], g["count"], g["drift"]) for g in data["groups"]] == [
        ("node[1-16,20-499,501-998]", 994, []),
        ("node[17-19,500]", 4, ["kernel"]),
        ("node999", 1, ["hca_fw"]),  # unpinned: off the class majority
    ]
    assert data["classes"]["cpu"] == {"pinned": {"kernel": ["6.1.0-18-amd64"]},
                                      "majority": {"hca_fw": "28.39.1002",
                                                   "kernel": "6.1.0-18-amd64"}}
    assert data["unreported"] == {"cpu": "node1000"} and data["drifting_nodes"] == 5
    assert view.to_dict(per_node=True)["nodes"]["node500"]["drift"] == ["kernel"]


# -- DCGM: the probe through the runner, a replaying dcgmi -------------------------------------


def dcgm_root(tmp_path: Path, replays: dict[int, str]) -> Path:
    """A copy of the healthy root with the replaying dcgmi and, per level, a fixture (a file
    name under tests/data/health) or "hang"."""
    root = copy_root(tmp_path)
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(DATA / "dcgm-replay" / "dcgmi", root / "usr/bin/dcgmi")
    share = root / "usr/share/bv-dcgm-replay"
    share.mkdir(parents=True, exist_ok=True)
    for level, what in replays.items():
        if what == "hang":
            (share / f"r{level}.hang").write_text("")
        else:
            shutil.copyfile(FIXTURES / what, share / f"r{level}.json")
    return root


def test_dcgm_level_from_the_purpose_runs_in_the_killable_child(h100: NodeClass,
                                                                tmp_path: Path) -> None:
    root = dcgm_root(tmp_path, {1: "dcgm-diag-4x-r1-rowremap-fail.json",
                                2: "dcgm-diag-4x-r2-pass.json"})
    ctx = ctx_on(h100, root)
    r1 = dcgm_runs.run_diag(ctx, 1, timeout_s=10)
    assert r1.status is Status.CRITICAL and r1.summary == (
        "diag r1 GPU 3 software failed: GPU 3 had uncorrectable memory errors and row "
        "remapping failed. Run a field diagnostic on the GPU.")
    r2 = dcgm_runs.run_diag(ctx, 2, timeout_s=10)
    assert r2.status is Status.OK and r2.summary == "diag r2: 24 passed, 0 skipped (DCGM 4.2.3)"
    # No fixture for level 3: dcgmi answers with an error and no JSON -> UNKNOWN, not OK.
    r3 = dcgm_runs.run_diag(ctx, 3, timeout_s=10)
    assert r3.status is Status.UNKNOWN and "unable to establish a connection" in r3.summary


def test_dcgm_hung_diag_is_killed_at_its_timeout(h100: NodeClass, tmp_path: Path) -> None:
    root = dcgm_root(tmp_path, {2: "hang"})
    t0 = time.monotonic()
    r = dcgm_runs.run_diag(ctx_on(h100, root), 2, timeout_s=1)
    took = time.monotonic() - t0
    assert r.status is Status.UNKNOWN and r.summary == "diag r2: no result in 1 s, dcgmi killed"
    assert took < 3, took
    # The replaying dcgmi did start and hang (it wrote its pid and its sleeping child's) ...
    pids_file = root / "usr/share/bv-dcgm-replay/r2.pids"
    assert pids_file.is_file(), "dcgmi never ran: nothing hung, nothing was killed"
    pids = [int(p) for p in pids_file.read_text().split()]
    assert 1 <= len(pids) <= 2, pids  # the shell, and its sleep unless killed before it began
    # ... and neither the shell nor its child outlived the check (a zombie counts as gone:
    # killed, only not yet reaped by its parent).
    deadline = time.monotonic() + 2.0
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    assert not alive, f"the hung dcgmi outlived its check: {alive}"
    left = subprocess.run(["pgrep", "-f", str(root / "usr/bin/dcgmi")], capture_output=True,
                          text=True, check=False)
    assert left.stdout.strip() == "", "the hung dcgmi outlived its check"


def _running(pid: int) -> bool:
    """`pid` exists and is not a zombie (/proc/<pid>/stat state Z)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_dcgm_absent_where_enabled_is_unknown_and_logged(h100: NodeClass,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    facts = dcgm_mod.probe_dcgm(dcgm_runs.with_level(ctx_on(h100, HEALTHY / "root"), 2))
    assert not facts.available and facts.level == 2
    assert dcgm_mod.evaluate_dcgm(facts, h100).status is Status.UNKNOWN
    assert "dcgm diag r2 asked for, but DCGM is not installed" in caplog.text


def test_dcgm_purposes_plan_and_resume_gate(site: Site, h100: NodeClass) -> None:
    opts = replace(site.health.dcgm, healthcheck_level=1, before_resume_level=2,
                   healthcheck_timeout_s=45, before_resume_timeout_s=600)
    on = replace(site, health=replace(site.health, dcgm=opts))
    full = plan_tier(on, "full")
    ctx = ctx_on(h100, HEALTHY / "root")
    plan, pctx = dcgm_runs.with_purpose(on, "healthcheck", full, ctx, limit_s=55)
    assert plan.checks == (*full.checks, "dcgm") and plan.tier == "full+dcgm"
    assert plan.timeout("dcgm") == 45 and pctx.node_class.node.dcgm_level == 1
    short, _ = dcgm_runs.with_purpose(on, "healthcheck", full, ctx, limit_s=20)
    assert short.timeout("dcgm") == 19  # within the caller's own bound
    assert dcgm_runs.with_purpose(site, "healthcheck", full, ctx) == (full, ctx)  # level 0: off
    # Before a resume: OK/WARNING passes, CRITICAL/UNKNOWN/not run keep the node drained.
    assert dcgm_gate(site, None) == (True, None)
    assert dcgm_gate(on, lambda: (0, "diag r2: 24 passed")) == (True, "DCGM diag r2 passes")
    assert dcgm_gate(on, None) == (False, "DCGM diag r2 must pass before a resume: not run")
    assert dcgm_gate(on, lambda: (2, "diag r2 GPU 3 memory failed: x")) == (
        False, "DCGM diag r2 before resume: CRITICAL: diag r2 GPU 3 memory failed: x")
    assert dcgm_gate(on, lambda: (3, "DCGM not installed"))[0] is False


# -- DCGM in the nightly: the per-node step and its verdict -----------------------------------


def test_nightly_dcgm_step_and_verdict(site: Site, tmp_path: Path) -> None:
    from bluevela.bench.nightly import NightlyOptions, dcgm_verdict, node_job, node_verdict

    on = replace(site, health=replace(site.health, dcgm=replace(
        site.health.dcgm, nightly_level=2, nightly_timeout_s=900)))
    req, job = node_job(on, "node1", "cpu", tmp_path, NightlyOptions(night="2026-11-26"))
    script = req.materialize()
    assert "health dcgm --level 2 --timeout-s 900 --class cpu --out" in script, script
    assert job.files["dcgm"] == tmp_path / "node1.dcgm.json"
    _, plain = node_job(site, "node1", "cpu", tmp_path, NightlyOptions(night="2026-11-26"))
    assert "dcgm" not in plain.files  # level 0: no step
    # What the step writes: `bv health dcgm` on a node whose dcgmi finds GPU 3's memory bad.
    root = dcgm_root(tmp_path, {2: "dcgm-diag-4x-r2-memory-fail.json"})
    out = tmp_path / "node1.dcgm.json"
    p = subprocess.run([sys.executable, "-m", "bluevela", "--site", str(REPO / "site.yaml"),
                        "health", "dcgm", "--level", "2", "--timeout-s", "10", "--class", "h100",
                        "--out", str(out)],
                       env={"PATH": "/usr/bin:/bin", "BV_SYSFS_ROOT": str(root),
                            "BV_STATE_DIR": str(tmp_path / "nostate")},
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stderr
    assert p.stdout.startswith("dcgm: CRITICAL: diag r2 GPU 3 memory failed: A memory mismatch")
    status, text = dcgm_verdict(out) or (None, "")
    assert status is Status.CRITICAL
    assert text.startswith("dcgm: diag r2 GPU 3 memory failed: A memory mismatch was detected")
    # The night's verdict on the node: culprit with the DCGM summary, even with good figures.
    status, why = node_verdict([], (status, text))
    assert status is Status.CRITICAL and why == text
    assert node_verdict([], (Status.UNKNOWN, "dcgm: no result")) == (Status.OK, None)
    assert dcgm_verdict(tmp_path / "missing.json") == (
        Status.UNKNOWN, "dcgm: no result (the step did not run or did not finish)")
    assert dcgm_verdict(None) is None
