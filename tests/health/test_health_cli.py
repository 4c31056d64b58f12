"""`bv health ...` and `bv hook ...`: help for every subcommand (lazy imports), run, snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixture_trees import materialized

REPO = Path(__file__).resolve().parents[2]
FIXTURES = materialized()


def bv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "BV_SITE": str(REPO / "site.yaml"), **(env or {})})


@pytest.mark.parametrize("args", [
    ("health",), ("health", "run"), ("health", "snapshot"), ("health", "nodes"),
    ("health", "resume"), ("health", "dcgm"), ("hook",),
])
def test_help(args: tuple[str, ...]) -> None:
    p = bv(*args, "--help")
    assert p.returncode == 0, p.stderr
    assert "Usage: bv " + " ".join(args) in p.stdout


def _fx(name: str) -> list[str]:
    return ["--sysfs-root", str(FIXTURES / name / "root"),
            "--nvml-snapshot", str(FIXTURES / name / "nvml.json")]


def test_run_json_on_the_healthy_fixture() -> None:
    p = bv("health", "run", "--class", "h100", "--json", *_fx("h100-healthy"))
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["status"] == "OK" and data["tier"] == "quick"
    assert [c["name"] for c in data["checks"]] == ["gpu", "ib", "node", "versions"]
    for c in data["checks"]:
        assert set(c) >= {"name", "status", "summary", "metrics"}
    assert data["checks"][1]["metrics"]["rate_min_gbps"] == 400


def test_run_exit_code_is_the_worst_status() -> None:
    p = bv("health", "run", "--class", "h100", "--check", "ib", *_fx("h100-ib-rate-hdr"))
    assert p.returncode == 2
    assert "mlx5_6/1 rate 200 Gb/s < 400" in p.stdout
    env = {"BV_SYSFS_ROOT": str(FIXTURES / "h100-healthy" / "root"),
           "BV_NVML_SNAPSHOT": str(FIXTURES / "nope.json")}
    p = bv("health", "run", "--class", "h100", "--check", "gpu", "--json", env=env)
    assert p.returncode == 3 and json.loads(p.stdout)["checks"][0]["status"] == "UNKNOWN"


def test_run_refuses_unknown_names_in_one_line() -> None:
    p = bv("health", "run", "--class", "nope")
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0
    assert "no node class 'nope'" in p.stderr
    p = bv("health", "run", "--class", "h100", "--tier", "slow")
    assert p.returncode == 1 and "no health tier 'slow'" in p.stderr


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA GPU")
def test_snapshot_without_nvml_is_a_clean_error(tmp_path: Path) -> None:
    out = tmp_path / "snap.json"
    p = bv("health", "snapshot", "--out", str(out))
    assert p.returncode == 1 and not out.exists()
    assert p.stderr.startswith("bv: error: ") and "Traceback" not in p.stderr


@pytest.mark.gpu
def test_snapshot_on_a_real_gpu_replays(tmp_path: Path) -> None:
    out = tmp_path / "snap.json"
    p = bv("health", "snapshot", "--out", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert data["kind"] == "nvml_snapshot" and data["gpus"]
    from bluevela.health.nvml_snapshot import load_snapshot

    snap = load_snapshot(out)
    assert snap.gpus[0].name and snap.gpus[0].pcie_link_width_max
