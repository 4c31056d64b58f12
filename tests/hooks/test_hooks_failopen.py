"""A broken install never drains a node, every hook run leaves one syslog line, and the audit
mode and the kill switch keep the hooks from acting (issue 24).

The shims run as slurmd runs them (root, no PATH, /etc/bluevela bind-mounted in a private mount
namespace: `run_shim`), and syslog is a real AF_UNIX datagram socket bound by the test, named
by `BV_SYSLOG_SOCKET` in hook.env (what /dev/log is on a node). Before the fix, a package that
did not import exited 1 (Slurm drains the node "Prolog error") and nothing reached syslog.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hooks.test_hooks_isolation import (
    FIXTURES,
    REPO,
    SHIMS,
    etc_bluevela,
    fixture_hook_env,
    needs_unshare,
    run_shim,
)

HOOK_SHIMS = ("prolog", "epilog", "healthcheck")
SYSTEM_PY = Path("/usr/bin/python3")  # Debian's python3.11: no bluevela in it


class SyslogSocket:
    """A real datagram socket standing in for /dev/log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def lines(self, wait_s: float = 0.5) -> list[str]:
        """Every datagram received so far (waiting up to `wait_s` for the first)."""
        out: list[str] = []
        self.sock.settimeout(wait_s)
        while True:
            try:
                out.append(self.sock.recv(65536).decode())
            except (TimeoutError, BlockingIOError):
                return out
            self.sock.settimeout(0.05)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def repo_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter whose bluevela is this checkout's (the hooks run `-I`, so PYTHONPATH
    cannot say which): a venv over this Python, the checkout first on its path."""
    venv = tmp_path_factory.mktemp("repo-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "00-bluevela-checkout.pth").write_text(f"{REPO}\n")
    return venv / "bin" / "python3"


@pytest.fixture
def syslog(tmp_path: Path) -> Iterator[SyslogSocket]:
    s = SyslogSocket(tmp_path / "dev-log")
    yield s
    s.close()


def _etc(tmp_path: Path, syslog: SyslogSocket, python: Path, fixture: str = "h100-healthy",
         **extra: str) -> tuple[Path, Path]:
    real = tmp_path / "real"
    env = fixture_hook_env(real, BV_SYSLOG_SOCKET=str(syslog.path), **extra)
    env["BV_SYSFS_ROOT"] = str(FIXTURES / fixture / "root")
    env["BV_NVML_SNAPSHOT"] = str(FIXTURES / fixture / "nvml.json")
    etc = etc_bluevela(tmp_path, env, real)
    (etc / "python").write_text(f"{python}\n")
    # nccl passed a moment ago: the prolog runs the quick tier only
    (real / "state" / "nccl_last_pass.json").write_text(json.dumps({"time": time.time()}))
    return etc, real


def _slurm(phase: str, job: int = 77) -> dict[str, str]:
    env = {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": str(job), "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NODELIST": "gpu001"}
    if phase == "healthcheck":
        del env["SLURM_JOB_ID"]
    return env


def half_installed(tmp_path: Path, how: str) -> Path:
    """A venv of Debian's python3 holding a copy of bluevela broken as an upgrade in progress
    leaves it: `phases` not written yet, or a truncated `__init__.py`."""
    venv = tmp_path / f"venv-{how}"
    subprocess.run([str(SYSTEM_PY), "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    shutil.copytree(REPO / "bluevela", site / "bluevela",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if how == "no-phases":
        (site / "bluevela" / "hooks" / "phases.py").unlink()
    else:
        init = site / "bluevela" / "__init__.py"
        init.write_text(init.read_text()[: len(init.read_text()) // 2] + "\ndef (\n")
    return venv / "bin" / "python3"


needs_system_py = pytest.mark.skipif(
    not SYSTEM_PY.is_file() or subprocess.run(
        [str(SYSTEM_PY), "-I", "-c", "import bluevela"], capture_output=True,
        check=False).returncode == 0,
    reason="needs a python3 without bluevela at /usr/bin/python3")


@needs_unshare
@needs_system_py
@pytest.mark.parametrize("phase", HOOK_SHIMS)
def test_package_missing_fails_open_with_one_logged_line(
        phase: str, tmp_path: Path, syslog: SyslogSocket) -> None:
    etc, real = _etc(tmp_path, syslog, SYSTEM_PY)
    p = run_shim(SHIMS / phase, etc, Path("/"), _slurm(phase))
    assert p.returncode == 0, p.stderr
    assert "hook error, nothing checked, exit 0 (fail open)" in p.stderr, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("<27>"), line  # daemon.err
    assert f"bluevela: {phase} " in line and "action=hook-error" in line
    assert "node=gpu001" in line and (phase == "healthcheck" or "job=77" in line)
    assert "No module named 'bluevela'" in line, line
    assert not (real / "state" / "last_run.json").exists()


@needs_unshare
@needs_system_py
@pytest.mark.parametrize("how, error", [
    ("no-phases", "No module named 'bluevela.hooks.phases'"),
    ("truncated-init", "SyntaxError"),
])
def test_half_installed_package_fails_open(how: str, error: str, tmp_path: Path,
                                           syslog: SyslogSocket) -> None:
    etc, _ = _etc(tmp_path, syslog, half_installed(tmp_path, how))
    p = run_shim(SHIMS / "prolog", etc, Path("/"), _slurm("prolog"))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "action=hook-error" in lines[0] and error in lines[0], lines


@needs_unshare
@pytest.mark.parametrize("python, said", [
    (Path("/bin/false"), "exited 1"),
    (Path("/nonexistent/python3"), "no executable Python at /nonexistent/python3"),
])
def test_no_usable_interpreter_fails_open(python: Path, said: str, tmp_path: Path,
                                          syslog: SyslogSocket) -> None:
    etc, _ = _etc(tmp_path, syslog, python)
    p = run_shim(SHIMS / "epilog", etc, Path("/"), _slurm("epilog"))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "action=hook-error" in lines[0] and said in lines[0], lines


@needs_unshare
def test_a_crashed_interpreter_fails_open(tmp_path: Path, syslog: SyslogSocket,
                                          repo_python: Path) -> None:
    """Killed by a signal mid-run (a segfault in a C extension, the OOM killer): exit 0."""
    etc, _ = _etc(tmp_path, syslog, repo_python)
    # The interpreter killed by SIGSEGV (what a crash in a C extension looks like here).
    crasher = tmp_path / "python-crashes"
    crasher.write_text(f"#!/bin/sh\nkill -SEGV $$\nexec {repo_python} \"$@\"\n")
    crasher.chmod(0o755)
    (etc / "python").write_text(f"{crasher}\n")
    p = run_shim(SHIMS / "prolog", etc, Path("/"), _slurm("prolog"))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "killed by signal 11" in lines[0], lines


@needs_unshare
@pytest.mark.parametrize("phase", HOOK_SHIMS)
def test_every_run_leaves_one_line(phase: str, tmp_path: Path, syslog: SyslogSocket,
                                   repo_python: Path) -> None:
    etc, real = _etc(tmp_path, syslog, repo_python)
    p = run_shim(SHIMS / phase, etc, Path("/"), _slurm(phase))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert "bluevela[" in line and f"]: {phase} " in line, line
    for part in ("node=gpu001", "action=none", "exit=0", "time="):
        assert part in line, line
    # The full tier's nccl cannot run here (no GPU): the line says which check and why.
    assert ("verdict=OK" in line) if phase != "healthcheck" else (
        'verdict=UNKNOWN action=none' in line and 'detail="nccl UNKNOWN: could not run' in line)
    assert (phase == "healthcheck") == ("job=" not in line), line
    assert (real / "state" / "last_run.json").is_file()


@needs_unshare
def test_audit_mode_reports_and_does_not_act(tmp_path: Path, syslog: SyslogSocket,
                                             repo_python: Path) -> None:
    """site.yaml audit: a failing node is checked and reported, nothing is drained (not even
    a call to Slurm), the prolog lets the job start, the line says what would have happened."""
    etc, real = _etc(tmp_path, syslog, repo_python, "h100-ib-port-down")
    site = etc / "site.yaml"
    site.write_text(site.read_text().replace('drain_prefix: "bv:"',
                                             'drain_prefix: "bv:"\n  actions: audit'))
    p = run_shim(SHIMS / "prolog", etc, Path("/"), _slurm("prolog"))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1, lines
    assert "verdict=CRITICAL action=audit-would-drain" in lines[0], lines
    assert "mlx5_3/1 state DOWN" in lines[0] and "mode=audit" in lines[0]
    assert "could not drain" not in p.stderr and "sinfo" not in p.stderr, p.stderr
    assert (real / "spool" / "77.gpu001.prolog.json").is_file()  # reported
    assert (real / "metrics" / "bluevela.prom").is_file()


@needs_unshare
def test_node_file_overrides_site_yaml(tmp_path: Path, syslog: SyslogSocket,
                                       repo_python: Path) -> None:
    """/etc/bluevela/actions: `off` on this node checks nothing; a typo reads as audit."""
    etc, real = _etc(tmp_path, syslog, repo_python, "h100-ib-port-down")
    (etc / "actions").write_text("off\n")
    p = run_shim(SHIMS / "prolog", etc, Path("/"), _slurm("prolog"))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "action=off" in lines[0] and "/etc/bluevela/actions" in lines[0]
    assert not (real / "state" / "last_run.json").exists()
    (etc / "actions").write_text("enforec\n")
    p = run_shim(SHIMS / "prolog", etc, Path("/"), _slurm("prolog", job=78))
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "action=audit-would-drain" in lines[0], lines


def test_the_three_hook_shims_differ_only_in_their_phase() -> None:
    texts = {}
    for ph in HOOK_SHIMS:
        lines = (SHIMS / ph).read_text().splitlines()
        assert lines[1].startswith(f"# bluevela Slurm {ph} hook: ")
        assert lines.count(f"PHASE={ph}") == 1
        texts[ph] = [ln for ln in lines[2:] if ln != f"PHASE={ph}"]
        assert os.access(SHIMS / ph, os.X_OK)
    assert texts["epilog"] == texts["prolog"] == texts["healthcheck"]


def test_syslog_never_blocks_or_fails(tmp_path: Path) -> None:
    """No /dev/log, a file in its place, a receiver that never reads (full queue): the line
    is dropped at once and the caller goes on."""
    from bluevela.hooks import log as hooklog

    env = {"BV_SYSLOG_SOCKET": str(tmp_path / "missing")}
    assert hooklog.send("x", environ=env) is False
    (tmp_path / "file").write_text("")
    assert hooklog.send("x", environ={"BV_SYSLOG_SOCKET": str(tmp_path / "file")}) is False
    assert hooklog.send("x", environ={"BV_SYSLOG_SOCKET": "off"}) is False
    full = SyslogSocket(tmp_path / "full")
    try:
        env = {"BV_SYSLOG_SOCKET": str(full.path)}
        t0 = time.monotonic()
        sent = [hooklog.send("y" * 1000, environ=env) for _ in range(2000)]
        assert time.monotonic() - t0 < 5
        assert sent[0] and not all(sent)  # the queue filled up, the rest was dropped
    finally:
        full.close()


def test_line_is_one_bounded_line_of_fields() -> None:
    from bluevela.hooks import log as hooklog

    line = hooklog.format_fields("prolog", {"job": 5, "node": "n1", "skip": None,
                                            "detail": 'a "b"\nc=d' + "x" * 5000})
    assert "\n" not in line and "skip" not in line
    assert line.startswith('prolog job=5 node=n1 detail="a \\"b\\" c=d')
    assert len(line.encode()) <= hooklog.MAX_LINE
    assert hooklog.facility({"BV_SYSLOG_FACILITY": "local3"}) == 19
    assert hooklog.facility({"BV_SYSLOG_FACILITY": "kern"}) == 3  # unknown: daemon


@needs_unshare
@needs_system_py
def test_epilog_slurmctld_fails_open_and_logs_each_run(tmp_path: Path, syslog: SyslogSocket,
                                                       repo_python: Path) -> None:
    """EpilogSlurmctld: without the package, one line and exit 0 (the timer ingests later);
    with it, one line saying what was ingested."""
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report

    real = tmp_path / "real"
    etc = etc_bluevela(tmp_path, {"BV_ARCHIVE_WAIT_S": "0", "BV_CACHE_DIR": "off",
                                  "BV_SYSLOG_SOCKET": str(syslog.path)}, real)
    for phase in ("prolog", "epilog"):
        write_report(real / "spool", sample_report(51, "n1", phase, nodelist=["n1"],
                                                   time=time.time()))
    (etc / "python").write_text(f"{SYSTEM_PY}\n")
    p = run_shim(SHIMS / "epilog_slurmctld", etc, Path("/"), {"SLURM_JOB_ID": "51"})
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "epilog_slurmctld job=51 action=hook-error" in lines[0], lines
    assert "No module named 'bluevela'" in lines[0]
    (etc / "python").write_text(f"{repo_python}\n")
    p = run_shim(SHIMS / "epilog_slurmctld", etc, Path("/"), {"SLURM_JOB_ID": "51"})
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1 and "epilog_slurmctld job=51 action=ingested" in lines[0], lines


def test_an_error_inside_the_hook_leaves_one_line(tmp_path: Path, syslog: SyslogSocket,
                                                  repo_python: Path) -> None:
    """A site.yaml that does not load (caught by run_hook itself): exit 0, one hook-error
    line naming the problem; the same through `python -m bluevela.hooks` as through a shim."""
    hook_env = tmp_path / "hook.env"
    hook_env.write_text(f"BV_SITE={tmp_path / 'missing' / 'site.yaml'}\n"
                        f"BV_SYSLOG_SOCKET={syslog.path}\nBV_SYSLOG_FACILITY=local3\n")
    hook_env.chmod(0o644)
    p = subprocess.run([str(repo_python), "-I", "-m", "bluevela.hooks", "prolog"],
                       env={"BV_HOOK_ENV": str(hook_env), "SLURMD_NODENAME": "gpu001",
                            "SLURM_JOB_ID": "9"},
                       cwd="/", capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    lines = syslog.lines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("<155>")  # local3.err
    assert "prolog job=9 node=gpu001 verdict=none action=hook-error" in lines[0]
    assert "SiteConfigError" in lines[0] and "cannot read site file" in lines[0]
