"""`bv submit` checks the job's Python before the job queues (issue 35): the batch script runs
`python3 -P -m bluevela.launch.supervisor` with the job's PATH, so a Python older than 3.11
(`Unknown option: -P`) or one without bluevela (`No module named 'bluevela'`) used to fail only
once the job had its nodes. Every interpreter here is a real one: pyenv's or Debian's older
Pythons where the machine has them (skipped with the reason where it has none), a fresh venv
without bluevela, and this test's own interpreter for the good case.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from bluevela import __version__
from bluevela.errors import LaunchError
from bluevela.launch.jobpython import check_job_python, series
from bluevela.launch.request import SubmitRequest
from bluevela.launch.submit import build_request
from bluevela.site_file import parse_site
from tests.conftest import REPO


def _old_python(minor: str) -> str | None:
    """A real interpreter of version `minor` (e.g. '3.10'), or None."""
    for candidate in (shutil.which(f"python{minor}"), *sorted(glob.glob(
            os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}"))),
            f"/usr/bin/python{minor}"):
        if candidate and os.access(candidate, os.X_OK):
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, check=False)
            if out.returncode == 0 and out.stdout.strip() == str(tuple(map(int, minor.split(".")))):
                return candidate
    return None


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv of a Python >= 3.11 without bluevela (no site packages of ours)."""
    base = shutil.which("python3.11") or "/usr/bin/python3"
    root = tmp_path_factory.mktemp("bare") / "venv"
    if Path(base).resolve() == Path(sys.executable).resolve() or not os.access(base, os.X_OK):
        venv.create(root, with_pip=False)
    else:
        subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python3"
    probe = subprocess.run([str(python), "-c", "import bluevela"], capture_output=True,
                           cwd=root, check=False)
    if probe.returncode == 0:
        pytest.skip(f"{base}'s venv imports bluevela (a .pth in the base?)")
    return python


def _bv(*args: str, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "BV_SITE": str(REPO / "site.yaml"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120, check=False, env=full)


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("bv: error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("minor", ["3.10", "3.9", "2.7"])
def test_an_older_python_on_the_jobs_path_is_refused_at_submit(minor: str, tmp_path: Path) -> None:
    """The job's PATH finds a real 3.10 (or older) as `python3`: one line, exit 2, no sbatch."""
    old = _old_python(minor)
    if old is None:
        pytest.skip(f"no real Python {minor} on this machine")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(old)
    path = f"{bindir}:{os.environ['PATH']}"
    line = _one_error_line(_bv("submit", "-N", "1", "t.py", env={"PATH": path}))
    assert f"{bindir}/python3 is Python {minor}." in line
    assert "needs Python >= 3.11" in line and "--python" in line
    # the same through the library, and through --python
    with pytest.raises(LaunchError, match=rf"is Python {minor}\."):
        check_job_python("python3", (), environ={"PATH": path}, cwd=str(tmp_path))
    assert f"{old} is Python {minor}." in _one_error_line(_bv("submit", "--python", old, "t.py"))


def test_a_python_without_bluevela_is_refused(bare_venv: Path, tmp_path: Path) -> None:
    """A venv without bluevela first on the job's PATH (--env PATH=... is the job's PATH)."""
    path = f"{bare_venv.parent}:{os.environ['PATH']}"
    line = _one_error_line(_bv("submit", "--env", f"PATH={path}", "t.py"))
    assert f"{bare_venv} (Python 3." in line and "cannot import bluevela" in line
    assert "No module named 'bluevela'" in line


def test_site_launch_python_is_the_jobs_python(bare_venv: Path, tmp_path: Path) -> None:
    """site.yaml launch.python names the interpreter; the script execs it; the check runs it."""
    text = (REPO / "site.yaml").read_text().replace("launch:\n",
                                                    f"launch:\n  python: {bare_venv}\n", 1)
    site_file = tmp_path / "site.yaml"
    site_file.write_text(text)
    site = parse_site(text, site_file)
    req = build_request(site, "t.py")
    assert req.materialize().splitlines()[-1].startswith(
        f"exec {bare_venv} -P -m bluevela.launch.supervisor")
    line = _one_error_line(_bv("submit", "--site", str(site_file), "t.py"))
    assert "cannot import bluevela" in line
    # --python wins over the site
    assert build_request(site, "t.py", python="python3").python == "python3"


def test_missing_python_and_bad_values(tmp_path: Path) -> None:
    line = _one_error_line(_bv("submit", "--env", f"PATH={tmp_path}", "t.py"))
    assert "there is no 'python3' on the job's PATH" in line
    with pytest.raises(LaunchError, match="neither a command name"):
        SubmitRequest(script="t.py", python="venv/bin/python3")
    with pytest.raises(LaunchError, match="control character"):
        SubmitRequest(script="t.py", python="/x/python3\n#SBATCH --uid=0")


def test_another_release_series_is_refused(tmp_path: Path) -> None:
    """A real interpreter importing a bluevela of another series (a package on PYTHONPATH)."""
    pkg = tmp_path / "other" / "bluevela"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "99.1.0"\n')
    (pkg / "launch" / "__init__.py").write_text("")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path / "other")}
    with pytest.raises(LaunchError, match=rf"imports bluevela 99.1.0, this bv is {__version__}"):
        check_job_python(sys.executable, (), environ=env, cwd=str(tmp_path))


def test_the_working_directory_is_not_on_the_jobs_path(tmp_path: Path) -> None:
    """The job runs `-P`: a bluevela/ in the submit directory is not what the job imports."""
    (tmp_path / "bluevela").mkdir()
    (tmp_path / "bluevela" / "__init__.py").write_text('__version__ = "99.0.0"\n')
    found = check_job_python(sys.executable, (), cwd=str(tmp_path))
    assert found.bluevela == __version__


def test_a_good_python_passes(tmp_path: Path) -> None:
    found = check_job_python(sys.executable, (("PATH", os.environ["PATH"]),), cwd=str(tmp_path))
    assert found.path == sys.executable and found.version[:2] >= (3, 11)
    assert series(found.bluevela) == series(__version__)
    assert series("0.1.3") == series("0.1.0+local") != series("0.2.0")


def test_dry_run_and_opt_out_do_not_run_the_python(tmp_path: Path) -> None:
    """--dry-run touches nothing (no probe: it stays cheap); --no-python-check skips it."""
    proc = _bv("submit", "--dry-run", "--env", f"PATH={tmp_path}", "t.py")
    assert proc.returncode == 0, proc.stderr
    assert f"export PATH={tmp_path}" in proc.stdout


def test_bluevela_without_torch_is_refused(bare_venv: Path, tmp_path: Path) -> None:
    """bv's own venv (no torch) as the job's Python: the agent runs torch's torchrun in it."""
    env = {"PATH": f"{bare_venv.parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    with pytest.raises(LaunchError, match=rf"has bluevela {__version__} but no torch"):
        check_job_python("python3", (), environ=env, cwd=str(tmp_path))


def _stand_in(tmp_path: Path, name: str, body: str) -> str:
    """An executable that answers the probe as `body` says (a shell script, or raw bytes)."""
    path = tmp_path / name
    path.write_text(body)
    path.chmod(0o755)
    return str(path)


def test_each_way_a_job_python_can_fail_has_its_one_line(tmp_path: Path) -> None:
    """The refusals the real interpreters above cannot all reach (no old Python on this machine,
    a hang, a broken file), each with its message: stand-ins that print the probe's lines. They
    pin the order of the checks (version before bluevela, series before torch) and each text."""
    cases = [
        ("hang", "#!/bin/sh\nexec sleep 30\n", r"did not answer within 0\.5 s \(a hung file system"),
        ("garbage", "\x7fELF not really\n", r"cannot run: Exec format error; put a Python >= 3\.11"),
        ("silent", "#!/bin/sh\necho Unknown option: -P >&2\nexit 2\n", r"did not run \(exit 2\); put"),
        ("old", "#!/bin/sh\necho python 3.10.4\necho bluevela 99.0.0\n",
         r"is Python 3\.10\.4; the job needs Python >= 3\.11 with bluevela \(it runs `.*old -P"),
        ("nobv", "#!/bin/sh\necho python 3.12.1\necho \"error ModuleNotFoundError: nope\"\n",
         rf"\(Python 3\.12\.1\) cannot import bluevela \(ModuleNotFoundError: nope\): install "
         rf"bluevela {__version__} there"),
        ("nobv-quiet", "#!/bin/sh\necho python 3.12.1\nexit 7\n", r"cannot import bluevela \(exit 7\)"),
        ("other", "#!/bin/sh\necho python 3.12.1\necho bluevela 99.0.0\necho torch no\n",
         r"imports bluevela 99\.0\.0, this bv is"),
    ]
    for name, body, message in cases:
        path = _stand_in(tmp_path, name, body)
        with pytest.raises(LaunchError, match=message):
            check_job_python(path, (), cwd=str(tmp_path), timeout_s=0.5)
    notorch = _stand_in(tmp_path, "notorch",
                        f"#!/bin/sh\necho python 3.12.1\necho bluevela {__version__}\necho torch no\n")
    with pytest.raises(LaunchError, match=r"but no torch: .*, or put a Python >= 3\.11"):
        check_job_python(notorch, (), cwd=str(tmp_path))
    found = check_job_python(notorch, (), cwd=str(tmp_path), need_torch=False)
    assert (found.path, found.version, found.bluevela) == (notorch, (3, 12, 1), __version__)
    with pytest.raises(LaunchError, match=r"there is no '\./missing' \(PATH="):
        check_job_python("./missing", (), cwd=str(tmp_path))
