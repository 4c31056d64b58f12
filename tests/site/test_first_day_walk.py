"""A researcher's and an admin's first day, walked from a fresh clone with the docs' own
commands (issue 35): README's "Using it" and "The job's Python", docs/byos.md's module launch,
docs/install.md's staging (`bv install --root`, `bv site validate` of the example production
site, `--cluster` against the dev cluster). Each step is the docs' command with the dev
cluster's names; the bv that runs is the clone's (PYTHONPATH), so what is checked is what a
newcomer would get from the repository as committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, DevCluster

pytestmark = [pytest.mark.cluster]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and the repository's history")
    dest = tmp_path_factory.mktemp("walk") / "bluevela"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    return dest


def _bv(cluster: DevCluster, clone: Path, *args: str, cwd: Path,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = cluster.environ(PYTHONPATH=str(clone), BV_CACHE_DIR="off")
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout, check=False)


def test_a_researchers_first_day(devcluster: DevCluster, clone: Path, tmp_path: Path) -> None:
    # README, "Using it": the dry run of a GPU job shows its GPUs and one rank per GPU.
    dry = _bv(devcluster, clone, "submit", "--dry-run", "-N", "16", "--class", "h100",
              "train.py", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --gpus-per-node=8" in dry.stdout and "--nproc-per-node=8" in dry.stdout
    assert re.search(r"^bv: site file: \S+site\.yaml \(\$BV_SITE\)$", dry.stderr, re.M)
    # README: the first real job, then its status and its output.
    example = str(clone / "examples" / "train_ddp.py")
    run = _bv(devcluster, clone, "submit", "-N", "2", "--procs-per-node", "2", "--wait",
              "--json", example, "--steps", "20", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    job = json.loads(run.stdout)
    assert job["state"] == "COMPLETED" and job["site"]
    status = _bv(devcluster, clone, "status", str(job["job_id"]), "--json", cwd=tmp_path)
    assert json.loads(status.stdout)["state"] == "COMPLETED"
    logs = _bv(devcluster, clone, "logs", str(job["job_id"]), cwd=tmp_path)
    assert re.search(r"^rank=3 world_size=4 ", logs.stdout, re.M), logs.stdout[-2000:]
    # README, "The job's Python": a venv that is not the training env is refused before
    # queueing (here it finds the clone's bluevela through PYTHONPATH, but no torch).
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    refused = _bv(devcluster, clone, "submit", "--python", str(bare / "bin" / "python3"),
                  example, cwd=tmp_path)
    assert refused.returncode == 2 and "but no torch" in refused.stderr, refused.stderr
    # docs/byos.md / README: a module, named after it.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(example, pkg / "train.py")
    mod = _bv(devcluster, clone, "submit", "--dry-run", "-m", "pkg.train", "--steps", "5",
              cwd=tmp_path)
    assert "#SBATCH --job-name=pkg.train" in mod.stdout and " -m pkg.train --steps 5" in mod.stdout


def test_an_admins_first_day(devcluster: DevCluster, clone: Path, tmp_path: Path) -> None:
    # install.md 1.2: stage the layout first (the root must exist), nothing on this host. bv
    # install runs from a venv (1.1); this one sees the clone's bluevela, a checkout, so it
    # needs --force (a production venv holds the wheel: tests/deploy/test_install_wheel.py).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True, timeout=120)
    stage = tmp_path / "stage"
    stage.mkdir()
    env = {**os.environ, "PYTHONPATH": str(clone)}
    dry = subprocess.run([str(venv / "bin" / "python3"), "-m", "bluevela", "install", "--root",
                          str(stage), "--dry-run", "--force"], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert dry.returncode == 0 and "dry run, nothing written" in dry.stdout, dry.stderr
    # install.md 1.1/1.5: the example production site validates as shipped, strictly.
    example = clone / "examples" / "site-h100.yaml"
    val = _bv(devcluster, clone, "site", "validate", str(example), cwd=tmp_path)
    assert val.returncode == 0 and ": OK (my-cluster: 1 node classes)" in val.stdout, val.stderr
    # ... and the dev cluster's site against the cluster (exit: the worst finding).
    cl = _bv(devcluster, clone, "site", "validate", "--cluster", cwd=tmp_path)
    assert "Traceback" not in cl.stderr and "slurm.conf: the lines bv expects" in cl.stdout, (
        cl.stdout + cl.stderr)
