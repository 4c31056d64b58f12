"""Which site file a user's command reads (issue 35): `--site`, `$BV_SITE`, then the system
file /etc/bluevela/site.yaml, and ./site.yaml only where there is no system file. A project's
stray ./site.yaml used to replace the site's (and failed the submit); with no file at all the
job silently got no checkpoint signal. `bv submit` now names the file it used, notes a
./site.yaml it passed over, and warns when there is none.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela import site_file
from bluevela.errors import SiteConfigError
from bluevela.site_file import choose_site, find_site_path
from tests.conftest import REPO

STRAY = "cluster: someone-elses\nnode_classes: {x: {nodes: 'a[1-2]', gpus: 0, bogus_key: 1}}\n"

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private mount namespace for /etc/bluevela needs root and unshare")


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A working directory and a stand-in for /etc/bluevela/site.yaml (not yet written)."""
    work = tmp_path / "work"
    work.mkdir()
    etc = tmp_path / "etc" / "site.yaml"
    etc.parent.mkdir()
    monkeypatch.setattr(site_file, "ETC_SITE", etc)
    monkeypatch.delenv("BV_SITE", raising=False)
    monkeypatch.chdir(work)
    return work, etc


def test_the_system_file_comes_before_the_working_directorys(places: tuple[Path, Path]) -> None:
    work, etc = places
    (work / "site.yaml").write_text(STRAY)
    etc.write_text((REPO / "site.yaml").read_text())
    choice = choose_site()
    assert (choice.path, choice.how, choice.ignored) == (etc, "system", Path("site.yaml"))
    assert find_site_path() == etc
    assert choice.lines() == [f"site file: {etc}",
                              f"note: site.yaml ignored: the site's {etc} comes first "
                              "(--site site.yaml to use it)"]


def test_the_working_directorys_file_where_there_is_no_system_file(
        places: tuple[Path, Path]) -> None:
    work, _ = places
    (work / "site.yaml").write_text(STRAY)
    choice = choose_site()
    assert (choice.path, choice.how, choice.ignored) == (Path("site.yaml"), "cwd", None)
    assert "there is no /etc/bluevela/site.yaml" in choice.lines()[0]


def test_explicit_and_env_first(places: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                tmp_path: Path) -> None:
    work, etc = places
    etc.write_text("x")
    (work / "site.yaml").write_text("x")
    monkeypatch.setenv("BV_SITE", str(tmp_path / "env.yaml"))
    assert choose_site().how == "$BV_SITE" and find_site_path() == tmp_path / "env.yaml"
    assert choose_site("mine.yaml").how == "--site"
    assert find_site_path("mine.yaml") == Path("mine.yaml")


def test_none_found_warns(places: tuple[Path, Path]) -> None:
    choice = choose_site()
    assert choice.path is None
    assert choice.lines()[0].startswith("warning: no site file")
    assert "no checkpoint signal" in choice.lines()[0]
    with pytest.raises(SiteConfigError, match="no site file"):
        find_site_path()


def _bv_in(cwd: Path, *args: str, etc: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`bv` as a user runs it in `cwd`, no BV_SITE; /etc/bluevela = `etc` (a private mount) when
    given, else the machine's own (checked to hold no site file)."""
    env = {k: v for k, v in os.environ.items() if k != "BV_SITE"}
    env["BV_CACHE_DIR"] = "off"
    argv = [sys.executable, "-m", "bluevela", *args]
    if etc is None:
        if site_file.ETC_SITE.exists():
            pytest.skip("this machine has an /etc/bluevela/site.yaml")
        return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env,
                              timeout=120, check=False)
    Path("/etc/bluevela").mkdir(exist_ok=True)
    script = 'mount --bind "$1" /etc/bluevela && shift && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                           script, "sh", str(etc), *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120, check=False)


def test_submit_with_no_site_file_warns_and_says_there_is_no_signal(tmp_path: Path) -> None:
    proc = _bv_in(tmp_path, "submit", "--dry-run", "t.py")
    assert proc.returncode == 0, proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if "no site file" in ln]
    assert len(warning) == 1 and warning[0].startswith("bv: warning: no site file")
    assert "--signal" not in proc.stdout


def test_submit_names_the_working_directorys_file(tmp_path: Path) -> None:
    shutil.copy(REPO / "site.yaml", tmp_path / "site.yaml")
    proc = _bv_in(tmp_path, "submit", "--dry-run", "t.py")
    assert proc.returncode == 0, proc.stderr
    assert "bv: site file: site.yaml (./site.yaml: there is no /etc/bluevela/site.yaml)" \
        in proc.stderr.splitlines()
    assert "#SBATCH --signal=B:USR1@120" in proc.stdout
    js = _bv_in(tmp_path, "submit", "--dry-run", "--json", "t.py")
    assert '"site": "site.yaml"' in js.stdout and "site file" not in js.stderr


@needs_unshare
def test_a_stray_site_yaml_does_not_replace_the_systems(tmp_path: Path) -> None:
    """The project carries another cluster's site.yaml (with a key this bv does not know):
    the site's /etc/bluevela/site.yaml is used, the stray one named as ignored."""
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(REPO / "site.yaml", etc / "site.yaml")
    work = tmp_path / "project"
    work.mkdir()
    (work / "site.yaml").write_text(STRAY)
    proc = _bv_in(work, "submit", "--dry-run", "--class", "h100", "t.py", etc=etc)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "bv: site file: /etc/bluevela/site.yaml" in lines
    assert ("bv: note: site.yaml ignored: the site's /etc/bluevela/site.yaml comes first "
            "(--site site.yaml to use it)") in lines
    assert "#SBATCH --gpus-per-node=8" in proc.stdout
