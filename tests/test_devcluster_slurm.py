"""slurm/devcluster on a Slurm release slurm/slurm-build built (issue 34): how the release is
chosen and refused, and what `env` hands on. Against a stand-in prefix (the cluster on a real
built release runs in tests/test_slurm_releases.py's recordings and the cluster tests under
BV_SLURM=REL)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEVCLUSTER = REPO / "slurm" / "devcluster"


@pytest.fixture()
def short() -> Iterator[Path]:
    """A directory with a short path (Slurm's unix sockets cap the state dir's length)."""
    path = Path(tempfile.mkdtemp(prefix="bvs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _devcluster(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEVCLUSTER), *args], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, **env})


def _prefix(root: Path, release: str) -> Path:
    prefix = root / f"slurm-{release}"
    (prefix / "sbin").mkdir(parents=True)
    (prefix / "bin").mkdir()
    (prefix / "sbin" / "slurmctld").write_text("")
    (prefix / ".bv-build").write_text("source=x sha256=y configure=z\n")
    return prefix


def test_env_puts_the_clusters_release_first_on_path(short: Path) -> None:
    """`env` of a cluster brought up on 24.11 (cluster.json says so) puts that prefix's bin
    and sbin first on PATH, once, the rest of PATH kept in order."""
    prefix = _prefix(short / "root", "24.11")
    state = short / "state"
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps({"id": 9, "nodes": 3, "slurm": "24.11"}))
    path = f"/usr/bin:{prefix}/sbin:/bin"
    out = _devcluster("env", "--state-dir", str(state),
                      env={"BV_SLURM_ROOT": str(short / "root"), "PATH": path})
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("export PATH="))
    assert line == f"export PATH={prefix}/bin:{prefix}/sbin:/usr/bin:/bin"
    (state / "cluster.json").write_text(json.dumps({"id": 9, "nodes": 3, "slurm": ""}))
    out = _devcluster("env", "--state-dir", str(state), env={"PATH": path})
    assert "export PATH=" not in out.stdout  # the distribution's: PATH left alone


@pytest.mark.parametrize(("release", "why"), [
    ("24.x", "--slurm/BV_SLURM must be a release such as 24.11, not '24.x'"),
    ("25.11", "Slurm 25.11 is not built in {root}/slurm-25.11: "
              "BV_SLURM=25.11 slurm/install-deps"),
])
def test_up_refuses_a_release_that_is_not_built(short: Path, release: str, why: str) -> None:
    """One line, exit 1, and no daemon started (nothing of that release exists)."""
    if os.geteuid() != 0:
        pytest.skip("devcluster up runs as root")
    root = short / "root"
    _prefix(root, "24.11")
    state = short / "st"
    out = _devcluster("up", "--slurm", release, "--state-dir", str(state),
                      env={"BV_SLURM_ROOT": str(root), "BV_DEVCLUSTER_ID": "9"})
    assert out.returncode == 1
    assert out.stderr == f"devcluster: error: {why.format(root=root)}\n"
    assert not (state / "run" / "slurmctld.pid").exists()
