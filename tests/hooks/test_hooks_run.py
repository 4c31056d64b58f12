"""The hooks run as Slurm runs them: a fresh process, no PATH, settings only from hook.env.

These runs need no Slurm except where a node is drained; there Slurm is made unreachable on
purpose (a bogus slurm.conf) to check what the prolog does when it cannot drain.
The real drain/requeue/resume flow is in test_hooks_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.archive.reports import load_report
from bluevela.archive.spool import scan_spool
from tests.conftest import HOSTILE
from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()
HEAVY = ("torch", "numpy", "h5py", "pynvml", "click", "rich")


def make_node(tmp_path: Path, fixture: str = "h100-healthy", **extra: str) -> tuple[Path, Path]:
    """A node's /etc/bluevela/hook.env and its dirs under tmp_path; returns (hook.env, base)."""
    base = tmp_path / "node"
    for d in ("state", "spool", "metrics"):
        (base / d).mkdir(parents=True, exist_ok=True)
    bogus = tmp_path / "bogus-slurm.conf"
    bogus.write_text("NotAnOption\n")  # scontrol/sinfo fail at once: Slurm "unreachable"
    values = {
        "BV_SITE": str(REPO / "site.yaml"),
        "BV_NODE_CLASS": "h100",
        "BV_SYSFS_ROOT": str(FIXTURES / fixture / "root"),
        "BV_NVML_SNAPSHOT": str(FIXTURES / fixture / "nvml.json"),
        "BV_STATE_DIR": str(base / "state"),
        "BV_SPOOL_DIR": str(base / "spool"),
        "BV_METRICS_DIR": str(base / "metrics"),
        "SLURM_CONF": str(bogus),
        **extra,
    }
    env_file = tmp_path / "hook.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    env_file.chmod(0o644)
    return env_file, base


def run_hook(phase: str, hook_env: Path, slurm: dict[str, str], *, cwd: Path | None = None,
             python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Like slurmd: a bare environment (no PATH), Slurm's variables, the shim's interpreter."""
    env = {"BV_HOOK_ENV": str(hook_env), **slurm}
    return subprocess.run([sys.executable, *python_flags, "-m", "bluevela.hooks", phase],
                          env=env, capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False)


def test_usage() -> None:
    p = subprocess.run([sys.executable, "-m", "bluevela.hooks"], capture_output=True, text=True,
                       check=False)
    assert p.returncode == 2 and "usage: python -m bluevela.hooks {prolog|epilog|healthcheck}" in p.stderr


def test_healthy_prolog_then_epilog_report_and_telemetry(tmp_path: Path) -> None:
    hook_env, base = make_node(tmp_path)
    slurm = {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "alice",
             "SLURM_JOB_PARTITION": "gpu", "SLURM_NODELIST": "gpu[001-002]",
             "SLURM_JOB_NUM_NODES": "2"}
    p = run_hook("prolog", hook_env, slurm)
    assert p.returncode == 0, p.stderr
    report = json.loads((base / "spool" / "4242.gpu001.prolog.json").read_text())
    assert report["schema"] == 1 and report["kind"] == "node_report" and report["phase"] == "prolog"
    assert report["job_id"] == 4242 and report["user"] == "alice"
    assert report["nodelist"] == "gpu[001-002]" and report["num_nodes"] == 2
    assert report["drained"] is False and report["drain_reason"] is None
    health = report["health"]
    assert [c["name"] for c in health["checks"]][:3] == ["gpu", "ib", "node"]
    assert all(c["status"] == "OK" for c in health["checks"][:3])
    assert (base / "state" / "jobs" / "4242.json").exists()
    prom = (base / "metrics" / "bluevela.prom").read_text()
    assert 'bluevela_check_status{check="ib"} 0' in prom

    # The job ran: 1 kJ more per GPU, warmer, one more symbol error on a port.
    snap = json.loads((FIXTURES / "h100-healthy" / "nvml.json").read_text())
    for g in snap["gpus"]:
        g["total_energy_mj"] += 1_000_000
        g["temperature_c"] = 58
    after = tmp_path / "after.json"
    after.write_text(json.dumps(snap))
    hook_env.write_text(hook_env.read_text().replace(
        str(FIXTURES / "h100-healthy" / "nvml.json"), str(after)))
    p = run_hook("epilog", hook_env, {"SLURM_JOB_EXIT_CODE2": "3:0", "SLURM_JOB_EXIT_CODE": "768",
                                      "SLURM_JOB_DERIVED_EC": "768", **slurm})
    assert p.returncode == 0, p.stderr
    ep = json.loads((base / "spool" / "4242.gpu001.epilog.json").read_text())
    assert ep["exit_code"] == 3 and ep["exit_signal"] is None and ep["derived_exit_code"] == 3
    t = ep["telemetry"]
    assert t["gpu_energy_j"] == pytest.approx(8000.0) and t["gpu_temp_max_c"] == 58
    assert t["ib_symbol_error_increase_count"] == 0 and t["job_wall_s"] >= 0
    assert not (base / "state" / "jobs" / "4242.json").exists()  # consumed by the epilog
    # Both reports pass the archive's own validation of the spool format.
    scan = scan_spool(base / "spool")
    assert not scan.refused and len(scan.entries) == 2
    for entry in scan.entries:
        assert load_report(base / "spool", entry)["health"]["status_code"] in (0, 3)


def test_critical_prolog_that_cannot_reach_slurm_exits_0(tmp_path: Path) -> None:
    """No breaker slot could be won (Slurm unreachable): exit 1 would make Slurm drain the
    node "Prolog error" outside the breaker, so a storm against a slow controller drained the
    whole partition (old behaviour: exit 1 here). The report keeps the CRITICAL and the reason."""
    hook_env, base = make_node(tmp_path, "h100-ib-port-down")
    p = run_hook("prolog", hook_env, {"SLURMD_NODENAME": "gpu002", "SLURM_JOB_ID": "7"})
    assert p.returncode == 0, p.stderr
    report = json.loads((base / "spool" / "7.gpu002.prolog.json").read_text())
    assert report["health"]["status"] == "CRITICAL"
    assert report["drained"] is False
    assert report["drain_reason"] == "bv: ib: mlx5_3/1 state DOWN (phys_state Disabled)"
    assert "could not drain gpu002" in p.stderr and "no breaker slot was won" in p.stderr
    last = json.loads((base / "state" / "last_run.json").read_text())
    assert last["exit_code"] == 0 and last["drain_note"]


def test_critical_epilog_always_exits_0(tmp_path: Path) -> None:
    hook_env, base = make_node(tmp_path, "h100-gpu-row-remap-pending")
    p = run_hook("epilog", hook_env, {"SLURMD_NODENAME": "gpu003", "SLURM_JOB_ID": "8",
                                      "SLURM_JOB_EXIT_CODE2": "0:0"})
    assert p.returncode == 0, p.stderr
    report = json.loads((base / "spool" / "8.gpu003.epilog.json").read_text())
    assert report["drain_reason"].startswith("bv: gpu: GPU4 row remap pending")
    assert report["exit_code"] == 0


def test_a_broken_installation_fails_open(tmp_path: Path) -> None:
    hook_env, base = make_node(tmp_path, BV_SITE=str(tmp_path / "missing-site.yaml"))
    p = run_hook("prolog", hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "9"})
    assert p.returncode == 0
    assert "hook error, nothing checked, exit 0" in p.stderr and "missing-site.yaml" in p.stderr
    bad_node = run_hook("prolog", hook_env, {"SLURMD_NODENAME": "../../etc", "SLURM_JOB_ID": "9"})
    assert bad_node.returncode == 0 and "unsafe node name" in bad_node.stderr
    assert not any((base / "spool").iterdir())


def test_hostile_owner_values_run_nothing_and_name_nothing(tmp_path: Path) -> None:
    """SLURM_JOB_COMMENT, the work dir, stdout... set by the job's owner are inert."""
    hook_env, base = make_node(tmp_path)
    workdir = tmp_path / "work$(touch pwned-workdir)"
    workdir.mkdir()
    canaries = [Path("/tmp/bv-pwned-semicolon"), Path("/tmp/bv-pwned-subst"),
                Path("/tmp/bv-pwned-backtick")]
    for c in canaries:
        c.unlink(missing_ok=True)
    for i, value in enumerate(HOSTILE, 1):
        owner = {name: value for name in (
            "SLURM_JOB_COMMENT", "SLURM_JOB_NAME", "SLURM_JOB_STDOUT", "SLURM_JOB_STDERR",
            "SLURM_JOB_EXTRA", "SLURM_JOB_CONSTRAINTS")}
        for phase in ("prolog", "epilog"):
            p = run_hook(phase, hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": str(i),
                                           "SLURM_JOB_WORK_DIR": str(workdir), **owner},
                         cwd=tmp_path)
            assert p.returncode == 0, p.stderr
    assert not any(c.exists() for c in canaries)
    assert list(workdir.iterdir()) == []  # nothing written where the owner pointed
    assert not (tmp_path / "pwned-workdir").exists()
    names = sorted(p.name for p in (base / "spool").iterdir())
    assert names == sorted(f"{i}.gpu001.{ph}.json" for i in range(1, len(HOSTILE) + 1)
                           for ph in ("prolog", "epilog"))
    for f in (base / "spool").iterdir():
        text = f.read_text()
        assert "pwned" not in text and "touch" not in text


def test_quick_prolog_imports_nothing_heavy(tmp_path: Path) -> None:
    """The timed path: no torch/numpy/h5py/pynvml (a snapshot is set), not even click/rich."""
    hook_env, _ = make_node(tmp_path)
    state = tmp_path / "node" / "state"
    (state / "nccl_last_pass.json").write_text(json.dumps({"time": 9e18}))  # fresh: no nccl
    p = run_hook("prolog", hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "11"},
                 python_flags=("-X", "importtime"))
    assert p.returncode == 0, p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert "bluevela.hooks.phases" in imported and "bluevela.health.checks.gpu" in imported
    for heavy in HEAVY:
        assert not any(m == heavy or m.startswith(heavy + ".") for m in imported), heavy


def test_prolog_runs_nccl_only_when_stale(tmp_path: Path) -> None:
    hook_env, base = make_node(tmp_path)
    p = run_hook("prolog", hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "12"})
    checks = json.loads((base / "spool" / "12.gpu001.prolog.json").read_text())["health"]
    assert checks["tier"] == "quick+nccl" and checks["checks"][-1]["name"] == "nccl"
    if not Path("/dev/nvidiactl").exists():
        assert checks["checks"][-1]["status"] == "UNKNOWN"  # could not run: never CRITICAL
        assert p.returncode == 0
    (base / "state" / "nccl_last_pass.json").write_text(json.dumps({"time": 9e18}))
    run_hook("prolog", hook_env, {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "13"})
    checks = json.loads((base / "spool" / "13.gpu001.prolog.json").read_text())["health"]
    assert checks["tier"] == "quick" and [c["name"] for c in checks["checks"]] == ["gpu", "ib", "node",
                                                                                 "versions"]


def test_bv_hook_is_the_same_entry(tmp_path: Path) -> None:
    hook_env, base = make_node(tmp_path)
    env = {"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "21",
           "PATH": os.environ.get("PATH", "")}
    p = subprocess.run([sys.executable, "-m", "bluevela", "hook", "prolog"], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    assert (base / "spool" / "21.gpu001.prolog.json").exists()
