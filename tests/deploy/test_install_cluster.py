"""The demo's job through hooks laid out by `bv install` from the built wheel (issue 24 §4, done
when: "a clean machine installs bv from the built wheel (no checkout) and `bv install` lays out
a working node").

The shared dev cluster is re-`up`ed with `BV_DEVCLUSTER_HOOKS` = the installed shims and
`BV_PYTHON` = `<root>/opt/bluevela/current/bin/python3` (through the `current` switch), so
slurm.conf's Prolog/Epilog/HealthCheckProgram are the installed copies and every node's
/etc/bluevela/python names the venv; the job is submitted with the venv's own `bv`, with the
venv first on PATH (the batch script's `python3 -P -m bluevela.launch.supervisor` is the
wheel's). Afterwards the cluster is re-`up`ed as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEVCLUSTER, DevCluster
from tests.deploy.test_install_wheel import build_wheel, bv, make_venv
from tests.launch.test_rdzv_guard import _shim_wheel

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _up(cluster: DevCluster, **env: str) -> None:
    p = subprocess.run([sys.executable, str(DEVCLUSTER), "up"], capture_output=True, text=True,
                       timeout=300, check=False,
                       env={**os.environ, "BV_PYTHON": sys.executable, **env})
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture
def installed(devcluster: DevCluster, tmp_path: Path) -> Iterator[tuple[DevCluster, Path, Path]]:
    """The dev cluster running the hooks of a wheel installed with `bv install --root`."""
    wheel = build_wheel(tmp_path)
    venv = make_venv(tmp_path / "venv", wheel)
    # torch's torchrun script in the venv, as `pip install torch` writes it there: the job's
    # torchrun must be the venv's own (the rendezvous guard refuses another environment's,
    # e.g. the pyenv shim's, which the venv's torch reached through its .pth line lacks).
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python3"),
                        "install", "-q", "--no-deps", "--no-index", str(_shim_wheel(tmp_path))],
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    root = tmp_path / "root"
    root.mkdir()
    bv(venv, "install", "--root", str(root))
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    try:
        _up(devcluster, BV_DEVCLUSTER_HOOKS=str(root / "opt/bluevela/prolog_epilog"),
            BV_PYTHON=str(root / "opt/bluevela/current/bin/python3"))
        yield devcluster, venv, root
    finally:
        _up(devcluster)


def test_the_demo_job_passes_through_installed_hooks(
        installed: tuple[DevCluster, Path, Path], tmp_path: Path) -> None:
    cluster, venv, root = installed
    config = cluster.run(["scontrol", "show", "config"]).stdout
    hooks = root / "opt/bluevela/prolog_epilog"
    assert f"Prolog                  = {hooks}/prolog" in config
    assert f"Epilog                  = {hooks}/epilog" in config
    assert f"HealthCheckProgram      = {hooks}/healthcheck" in config
    for node in cluster.nodes:
        python = cluster.node_dir(node) / "etc-bluevela" / "python"
        assert python.read_text().strip() == str(root / "opt/bluevela/current/bin/python3")
    # The only bluevela that interpreter sees is the wheel's, in the venv.
    p = subprocess.run([str(root / "opt/bluevela/current/bin/python3"), "-I", "-c",
                        "import bluevela; print(bluevela.__file__)"],
                       capture_output=True, text=True, check=True, cwd="/")
    assert p.stdout.startswith(str(root / "opt/bluevela/current/lib/")), p.stdout

    work = tmp_path / "work"
    work.mkdir()
    env = cluster.environ(PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    sub = subprocess.run([str(venv / "bin" / "bv"), "submit", "-N", "2", "--procs-per-node", "2",
                          "--wait", "--json", str(REPO / "examples" / "train_ddp.py")],
                         capture_output=True, text=True, timeout=240, check=False, cwd=work,
                         env=env)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = json.loads(sub.stdout)
    assert job["state"] == "COMPLETED" and job["restarts"] == 0
    out = (work / f"bv-{job['job_id']}.out").read_text()
    assert out.count("rank=") >= 4 and "final_loss=" in out, out
    spool = Path(cluster.env["BV_SPOOL_DIR"])
    for node in job["nodes"]:
        epilog = spool / f"{job['job_id']}.{node}.epilog.json"
        deadline = time.monotonic() + 30
        while not epilog.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        prolog = json.loads((spool / f"{job['job_id']}.{node}.prolog.json").read_text())
        assert prolog["health"]["status"] in ("OK", "WARNING"), prolog["health"]
        assert json.loads(epilog.read_text())["exit_code"] == 0
    states = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout
    assert "drain" not in states, states
    print(f"demo job through installed hooks: {time.monotonic() - t0:.1f} s")
