"""`python -m bluevela.fleet_metrics --every S` as the daemon bv-fleet-metrics.service runs:
any bytes from Slurm, a bad cycle that logs one line while the loop goes on, an unprivileged
user writing into the documented sticky textfile directory, and systemd's own review of the
unit.

`sinfo` and `scontrol` here are small executables on PATH that print what a real sinfo prints
for a node drained with a reason typed on a Latin-1 terminal (the bytes Slurm stores and hands
back unchanged); the daemon runs them as real processes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "prolog_epilog" / "bv-fleet-metrics.service"
SITE = REPO / "site.yaml"

# `sinfo -h -N -o %N|%T|%P|%E`: node1 drained by an operator whose terminal sent Latin-1
# ("café" as 63 61 66 e9), node2 running a job.
SINFO = b"node1|drained|debug|caf\xe9 maint\nnode2|allocated|debug*|none\n"


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "sinfo.out").write_bytes(SINFO)
    for name, body in (("sinfo", f"exec cat {bin_dir / 'sinfo.out'}"), ("scontrol", "exit 0")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)


def _daemon(out: Path, bin_dir: Path, every: str = "0.2",
            stderr: Path | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "SLURM_CONF": "/nonexistent/slurm.conf"}
    with open(stderr or os.devnull, "w") as err:  # the child keeps its own copy of the fd
        return subprocess.Popen([sys.executable, "-m", "bluevela.fleet_metrics", "--out",
                                 str(out), "--every", every, "--site", str(SITE)],
                                env=env, stdout=subprocess.DEVNULL,
                                stderr=err if stderr else subprocess.PIPE, text=True)


def _wait(what: str, probe: Callable[[], object], timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err or ""


def _samples(path: Path) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value)
            for f in text_string_to_metric_families(path.read_text(encoding="utf-8"))
            for s in f.samples]


def test_a_non_utf8_reason_is_written_and_the_loop_goes_on(tmp_path: Path) -> None:
    _fake_slurm(tmp_path / "bin")
    out = tmp_path / "out"
    fleet = out / "bluevela_fleet.prom"
    proc = _daemon(out, tmp_path / "bin")
    try:
        _wait("first file", lambda: fleet.exists() or proc.poll() is not None)
        assert proc.poll() is None, "the daemon died on Slurm's output"
        first = fleet.stat().st_mtime_ns
        # the loop goes on: the file is rewritten by later cycles, and the process lives
        _wait("a later cycle", lambda: fleet.stat().st_mtime_ns != first)
        assert proc.poll() is None
    finally:
        rc, err = _stop(proc)
    assert rc == 0 and "Traceback" not in err, err
    got = _samples(fleet)
    assert ("bluevela_fleet_scrape_success", {}, 1.0) in got
    drained = {lab["node"]: lab["reason"] for n, lab, _ in got
               if n == "bluevela_slurm_node_drained"}
    assert drained == {"node1": "caf\ufffd maint"}  # the undecodable byte, replaced


def test_a_failing_cycle_logs_one_line_and_the_next_one_runs(tmp_path: Path) -> None:
    _fake_slurm(tmp_path / "bin")
    real = tmp_path / "textfile"
    real.mkdir()
    out = tmp_path / "out"
    out.symlink_to(real)  # refused as the output directory (not a plain directory)
    log = tmp_path / "stderr"
    proc = _daemon(out, tmp_path / "bin", stderr=log)
    try:
        # two refused cycles logged (every 0.2 s): the loop went on after the first
        _wait("two failed cycles", lambda: proc.poll() is not None
              or log.read_text().count("cycle failed") >= 2)
        assert proc.poll() is None, "the daemon died on a bad cycle"
        out.unlink()
        out.mkdir()  # the operator repairs it; the next cycle writes
        _wait("file after the repair", (out / "bluevela_fleet.prom").exists)
        assert proc.poll() is None
    finally:
        rc, _ = _stop(proc)
    err = log.read_text()
    assert rc == 0 and "Traceback" not in err, err
    failed = [ln for ln in err.splitlines() if "cycle failed" in ln]
    assert failed and all(ln.startswith("bluevela fleet_metrics: cycle failed: ") for ln in failed)
    assert "not a plain directory" in failed[0], err
    assert not (real / "bluevela_fleet.prom").exists()  # never written through the link


# The writer as nobody: setuid in the child after the interpreter and the modules it needs are
# loaded (this test's Python lives under root's 0700 home, which nobody cannot open).
AS_NOBODY = """
import os, sys
from bluevela import fleet_metrics
from bluevela.fleet import nodestate
from bluevela.site import load_site
from bluevela.slurm import cli_client
load_site(sys.argv[1], cwd=False)
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
sys.exit(fleet_metrics.main(sys.argv[2:]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the writer as nobody")
def test_unprivileged_writer_in_the_sticky_textfile_dir(request: pytest.FixtureRequest) -> None:
    """The unit's layout: the textfile dir root:<group> 1775, the writer as that group's user.
    It writes and replaces its own file; it cannot replace or remove the hooks' root file."""
    # pytest's own tmp root is 0700: nobody needs a path it can walk to the files
    base = Path(tempfile.mkdtemp(prefix="bv-fleet-nobody-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    _fake_slurm(base / "bin")
    textfile = base / "textfile"
    textfile.mkdir()
    os.chown(textfile, 0, 65534)  # root:nogroup, nobody's group
    textfile.chmod(0o1775)
    hooks = textfile / "bluevela.prom"
    hooks.write_text("bluevela_node_status 0\n")
    env = {"PATH": f"{base / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(REPO),
           "SLURM_CONF": "/nonexistent/slurm.conf", "BV_CACHE_DIR": "off"}
    argv = [sys.executable, "-c", AS_NOBODY, str(SITE), "--out", str(textfile),
            "--site", str(SITE)]
    for _ in range(2):  # the second run replaces the file the first wrote
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd="/")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    fleet = textfile / "bluevela_fleet.prom"
    st = fleet.stat()
    assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o644
    assert ("bluevela_fleet_scrape_success", {}, 1.0) in _samples(fleet)
    # The sticky bit: nobody cannot swap the hooks' file for its own, nor remove it.
    attack = ("import os, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
              "try:\n    os.rename(sys.argv[1], sys.argv[2])\nexcept PermissionError:\n"
              "    pass\nelse:\n    sys.exit('renamed')\n"
              "try:\n    os.unlink(sys.argv[2])\nexcept PermissionError:\n    sys.exit(0)\n"
              "sys.exit('removed')\n")
    p = subprocess.run([sys.executable, "-c", attack, str(fleet), str(hooks)],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert p.returncode == 0, p.stderr
    assert hooks.read_text() == "bluevela_node_status 0\n" and hooks.stat().st_uid == 0


# -- the unit ----------------------------------------------------------------------------------

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (package systemd)")


def _keys(text: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def _unit_copy(tmp: Path, text: str | None = None) -> Path:
    """The unit with ExecStart's interpreter replaced by this one (verify needs it to exist)."""
    text = UNIT.read_text() if text is None else text
    text = text.replace("ExecStart=/opt/bluevela/current/bin/python3",
                        f"ExecStart={Path(sys.executable).resolve()}")
    path = tmp / "bv-fleet-metrics.service"
    path.write_text(text)
    return path


def test_unit_runs_the_daemon_unprivileged() -> None:
    keys = _keys(UNIT.read_text())
    exec_start = keys["ExecStart"][0].split()
    assert exec_start[:4] == ["/opt/bluevela/current/bin/python3", "-I", "-m",
                              "bluevela.fleet_metrics"]
    assert exec_start[exec_start.index("--every") + 1] == "30"
    out = exec_start[exec_start.index("--out") + 1]
    assert keys["ReadWritePaths"] == [out] and keys["ProtectSystem"] == ["strict"]
    assert keys["User"] == ["bvfleet"] and keys["NoNewPrivileges"] == ["yes"]
    assert keys["CapabilityBoundingSet"] == [""] and keys["Restart"] == ["always"]
    assert keys["Type"] == ["simple"]


@needs_systemd
def test_unit_verifies_and_scores_well(tmp_path: Path) -> None:
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(_unit_copy(tmp_path))],
                       capture_output=True, text=True, timeout=60)
    about = [ln for ln in (p.stdout + p.stderr).splitlines() if "bv-fleet-metrics" in ln]
    assert p.returncode == 0 and not about, p.stdout + p.stderr
    bad = subprocess.run(["systemd-analyze", "verify", "--man=no", str(_unit_copy(
        tmp_path, UNIT.read_text().replace("[Service]\n", "[Service]\nProtectSystem=strct\n")))],
        capture_output=True, text=True, timeout=60)
    assert "strct" in bad.stdout + bad.stderr  # the check can fail
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(_unit_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", p.stdout + p.stderr)
    assert m is not None, p.stdout + p.stderr
    assert float(m.group(1)) <= 2.0, p.stdout  # systemd's scale: 0 best, 10 worst (root: 9.6)


def test_docs_start_the_unit_not_a_cron_daemon() -> None:
    for doc in ("install.md", "monitoring.md"):
        text = (REPO / "docs" / doc).read_text()
        assert "bv-fleet-metrics" in text, doc
        # a command line (a path, python, or a crontab entry) that runs the loop
        cron = [ln for ln in text.splitlines()
                if re.match(r"\s*([/*0-9@]|python)", ln) and "bluevela.fleet_metrics" in ln
                and "--every" in ln]
        assert not cron, f"{doc}: a command line that starts a daemon: {cron}"
