"""slurm/devcluster runs as root and keeps its state in /tmp (issue 23, §5): a directory, or a
symbolic link, that a local user put at the state dir's path first is refused with one line,
and nothing is written through it. Each case uses its own state dir (BV_DEVCLUSTER_DIR) under
a fresh root-owned directory; `monitoring down` is the probe (it takes the state dir's lock,
which 9058adc created with `exist_ok` and opened through whatever was there, and it stops
nothing of a running cluster)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import DEVCLUSTER

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="devcluster runs as root")


@pytest.fixture
def base() -> Iterator[Path]:
    # Short (Slurm's socket paths), root's, 0700: only what the test plants is in it.
    path = Path(tempfile.mkdtemp(prefix="bv-sd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _devcluster(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BV_DEVCLUSTER_DIR": str(state)}
    env.setdefault("BV_DEVCLUSTER_ID", "2")
    return subprocess.run([sys.executable, str(DEVCLUSTER), *args], capture_output=True,
                          text=True, timeout=60, env=env, check=False)


def _module() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("devcluster_mod", str(DEVCLUSTER))
    spec = importlib.util.spec_from_loader("devcluster_mod", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["devcluster_mod"] = mod  # its dataclasses look their module up
    loader.exec_module(mod)
    return mod


def _plant(base: Path, how: str) -> tuple[Path, Path]:
    """(state dir path, the directory a write through it would land in)."""
    state = base / "state"
    target = base / "elsewhere"
    target.mkdir()
    if how == "nobody-dir":
        state.mkdir()
        os.chown(state, NOBODY, NOBODY)
        return state, state
    if how == "world-writable-dir":
        state.mkdir()
        state.chmod(0o777)
        return state, state
    os.chown(target, NOBODY, NOBODY)  # the user's own directory, linked at the path
    state.symlink_to(target)
    if how == "link-to-root-dir":
        os.chown(target, 0, 0)
    return state, target


@pytest.mark.parametrize("how", ["nobody-dir", "world-writable-dir", "link-to-nobody-dir",
                                 "link-to-root-dir"])
def test_a_planted_state_dir_is_refused_and_nothing_written_through_it(base: Path,
                                                                       how: str) -> None:
    state, target = _plant(base, how)
    proc = _devcluster(state, "monitoring", "down")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"devcluster: error: refusing state dir {state}: ")
    want = {"nobody-dir": f"owned by uid {NOBODY}, not root",
            "world-writable-dir": "writable by group or others (mode 0777)"}.get(
                how, f"it is a symbolic link (to {target})")
    assert want in proc.stderr, proc.stderr
    assert list(target.iterdir()) == [], list(target.iterdir())
    # `up` refuses the same way, before it starts or writes anything.
    up = _devcluster(state, "up")
    assert up.returncode == 1 and "refusing state dir" in up.stderr, up.stdout + up.stderr
    assert list(target.iterdir()) == []


def test_a_state_dir_in_a_parent_others_can_write_is_refused(base: Path) -> None:
    parent = base / "open"
    parent.mkdir()
    parent.chmod(0o777)  # no sticky bit: anyone could swap the state dir
    proc = _devcluster(parent / "state", "monitoring", "down")
    assert proc.returncode == 1 and "is not root's alone" in proc.stderr, proc.stderr
    assert list(parent.iterdir()) == []


def test_a_fresh_state_dir_is_created_for_root_alone(base: Path) -> None:
    mod = _module()
    state = base / "new" / "state"
    assert mod.secure_state_dir(state, create=False) is False and not state.parent.exists()
    assert mod.secure_state_dir(state) is True
    st = os.lstat(state)
    assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o755
    assert mod.secure_state_dir(state) is True  # again: the same dir is accepted
    # A link planted inside it anyway is never written through.
    victim = base / "victim"
    victim.write_text("keep\n")
    (state / "prometheus.yml").symlink_to(victim)
    with pytest.raises(mod.DevClusterError, match="symbolic link"):
        mod.write_if_changed(state / "prometheus.yml", "x\n", 0o644)
    assert victim.read_text() == "keep\n"
