"""An older bv reading a newer site.yaml (issue 35): a key this bv does not know used to fail
the whole file, so during a rollout an old node's hooks failed open (nothing checked) the moment
the admin added a key for the new release. Now the key is dropped and reported (a warning per
key, with its line), the rest of the file is used; `bv site validate` still fails on it (a typo
must not pass), `--allow-unknown` reports it as a warning. A wrong value is still an error.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.errors import SiteConfigError
from bluevela.site_file import load_site, parse_site
from tests.conftest import REPO
from tests.hooks.test_hooks_isolation import (
    SHIMS,
    etc_bluevela,
    fixture_hook_env,
    needs_unshare,
    run_shim,
)

BASE = (REPO / "site.yaml").read_text()


def newer(text: str = BASE) -> str:
    """The repo's site with three keys a later bv might add: top level, launch, a class's gpu."""
    text = text.replace("launch:\n", "launch:\n  python_wheel_url: https://x/bv.whl\n", 1)
    text = text.replace("cluster: bluevela-dev\n", "cluster: bluevela-dev\nscheduler: {x: 1}\n", 1)
    return text.replace("      max_temp_c: 87\n", "      max_temp_c: 87\n      max_hbm_temp_c: 95\n", 1)


def test_unknown_keys_are_dropped_and_reported(tmp_path: Path) -> None:
    site = parse_site(newer(), tmp_path / "site.yaml")
    assert site.cluster == "bluevela-dev" and site.node_class(name="h100").gpu.max_temp_c == 87
    lines = site.unknown_keys
    assert [ln.split(": ")[1] for ln in lines] == [
        "scheduler", "launch.python_wheel_url", "node_classes.h100.gpu.max_hbm_temp_c"]
    assert all(ln.startswith(f"{tmp_path / 'site.yaml'}:") for ln in lines)
    assert "a key this bv" in lines[0] and "a newer bv's, or a typo" in lines[0]
    with pytest.raises(SiteConfigError) as err:
        parse_site(newer(), tmp_path / "site.yaml", strict=True)
    assert len(err.value.problems) == 3


def test_a_wrong_value_is_still_an_error(tmp_path: Path) -> None:
    """An unknown key beside a bad value: the file is refused, every problem listed."""
    text = newer().replace("  max_restarts: 0\n", "  max_restarts: -1\n", 1)
    with pytest.raises(SiteConfigError) as err:
        parse_site(text, tmp_path / "site.yaml")
    assert any("launch.max_restarts" in p for p in err.value.problems)
    assert any("launch.python_wheel_url" in p for p in err.value.problems)


def test_load_warns_every_time_the_cache_included(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(newer())
    monkeypatch.setenv("BV_CACHE_DIR", str(tmp_path / "cache"))
    for _ in range(2):  # the second load is a cache hit: it must still say so
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bluevela.site_file"):
            site = load_site(path)
        assert len(site.unknown_keys) == 3
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 3 and all(m.endswith("; ignored") for m in warned)
    assert list((tmp_path / "cache").glob("site-*.json"))
    with pytest.raises(SiteConfigError):  # strict from the cache too
        load_site(path, strict=True)


def _bv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "BV_CACHE_DIR": "off"})


def test_site_validate_fails_on_them_and_allow_unknown_warns(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(newer())
    strict = _bv("site", "validate", str(path))
    assert strict.returncode == 1 and "Traceback" not in strict.stderr
    assert f"{path}:17: launch.python_wheel_url: Unexpected keyword argument: a key this bv" \
        in strict.stderr
    lenient = _bv("site", "validate", "--allow-unknown", str(path))
    assert lenient.returncode == 0 and ": OK (" in lenient.stdout, lenient.stderr
    assert lenient.stderr.count("bv: WARNING: ") == 3
    sub = _bv("--site", str(path), "submit", "--dry-run", "--class", "h100", "t.py")
    assert sub.returncode == 0 and "#SBATCH --gpus-per-node=8" in sub.stdout, sub.stderr
    assert sub.stderr.count("; ignored") == 3


@needs_unshare
def test_an_old_nodes_prolog_keeps_checking(tmp_path: Path) -> None:
    """The prolog shim as slurmd runs it, /etc/bluevela/site.yaml carrying a newer bv's keys:
    the checks run (no 'hook error, nothing checked'), the keys are named in its log."""
    real = tmp_path / "real"
    etc = etc_bluevela(tmp_path, fixture_hook_env(real), real)
    (etc / "site.yaml").write_text(newer((etc / "site.yaml").read_text()))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    slurm = {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "78", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NODELIST": "gpu001"}
    p = run_shim(SHIMS / "prolog", etc, cwd, slurm)
    assert p.returncode == 0, p.stderr
    assert "hook error" not in p.stderr, p.stderr
    assert "launch.python_wheel_url: Unexpected keyword argument" in p.stderr, p.stderr
    last = json.loads((real / "state" / "last_run.json").read_text())
    assert [c["name"] for c in last["health"]["checks"]][:3] == ["gpu", "ib", "node"]
