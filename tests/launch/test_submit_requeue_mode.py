"""`bv submit --requeue=expedite` (issue 34): Slurm 25.11's expedited requeue, offered where the
running Slurm takes it, refused with one line where it does not. The releases' answers come
from their real `scontrol show config` (tests/data/slurm/<release>/show-config.txt, recorded
on the dev cluster) through a stand-in scontrol; sbatch is a stand-in that records a call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bluevela.launch.sbatch_opts import requeue_mode_problem, take_requeue_value
from bluevela.slurm.releases import expedite_problem, expedite_problem_here
from tests.conftest import DATA, REPO

TAKES_VALUE = {"-N", "--nodes", "-t", "--time", "--env"}


@pytest.mark.parametrize(("argv", "want", "mode"), [
    (["--requeue=expedite", "t.py"], ["--requeue", "t.py"], "expedite"),
    (["-N", "2", "--requeue=expedite", "t.py", "--lr", "3"],
     ["-N", "2", "--requeue", "t.py", "--lr", "3"], "expedite"),
    # a value of bv's own option is not SCRIPT: the scan goes on past it
    (["--time", "1:00:00", "--requeue=x", "t.py"], ["--time", "1:00:00", "--requeue", "t.py"], "x"),
    # the script's own --requeue=... is the script's
    (["-N2", "t.py", "--requeue=expedite"], ["-N2", "t.py", "--requeue=expedite"], None),
    (["--", "--requeue=expedite"], ["--", "--requeue=expedite"], None),
    (["--requeue", "--no-requeue", "t.py"], ["--requeue", "--no-requeue", "t.py"], None),
    (["--requeue=a", "--requeue=expedite", "t.py"], ["--requeue", "--requeue", "t.py"], "expedite"),
])
def test_take_requeue_value(argv: list[str], want: list[str], mode: str | None) -> None:
    assert take_requeue_value(argv, TAKES_VALUE) == (want, mode)


def test_requeue_mode_problem() -> None:
    assert requeue_mode_problem("expedite", True) is None
    assert requeue_mode_problem("expedite", None) is None
    assert "the only value is expedite" in (requeue_mode_problem("fast", True) or "")
    assert "contradict" in (requeue_mode_problem("expedite", False) or "")


def _config(release: str, slurmctld_parameters: str | None = None) -> str:
    text = (DATA / "slurm" / release / "show-config.txt").read_text()
    if slurmctld_parameters is not None:
        lines = [ln for ln in text.splitlines() if not ln.startswith("SlurmctldParameters ")]
        text = "\n".join([*lines, f"SlurmctldParameters     = {slurmctld_parameters}"]) + "\n"
    return text


@pytest.mark.parametrize(("release", "params", "want"), [
    ("22.05", None, "Slurm 22.05.8 has no expedited requeue (Slurm 25.11 and later)"),
    ("24.11", None, "Slurm 24.11.5 has no expedited requeue (Slurm 25.11 and later)"),
    ("24.11", "enable_expedited_requeue", "Slurm 24.11.5 has no expedited requeue"),
    ("25.11", None, "Slurm 25.11.7 refuses it: slurm.conf SlurmctldParameters lacks "
                    "enable_expedited_requeue"),
    ("26.05", None, "Slurm 26.05.3 refuses it"),
    ("25.11", "idle_on_node_suspend,enable_expedited_requeue", None),
    ("26.05", "enable_expedited_requeue", None),
])
def test_expedite_problem_on_each_release(release: str, params: str | None,
                                          want: str | None) -> None:
    """From the release's real running config: before 25.11 there is none (sbatch refuses a
    value for --requeue); from 25.11 slurmctld refuses the job unless slurm.conf allows it."""
    def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        assert argv == ["scontrol", "show", "config"]
        return subprocess.CompletedProcess(argv, 0, _config(release, params), "")

    got = expedite_problem_here(run=run)
    assert (got is None) if want is None else (got is not None and got.startswith(want)), got


def test_expedite_problem_unreadable_config() -> None:
    def down(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "slurm_load_ctl_conf error: "
                                           "Unable to contact slurm controller\n")

    assert expedite_problem_here(run=down) == (
        "cannot read the running Slurm config (scontrol show config: slurm_load_ctl_conf "
        "error: Unable to contact slurm controller)")
    assert expedite_problem({}) is not None  # no version: not offered


def _bv(tmp_path: Path, *args: str, release: str = "25.11",
        params: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`bv submit` with a stand-in scontrol printing the release's config and an sbatch that
    records its script and answers job 7."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (tmp_path / "config.txt").write_text(_config(release, params))
    script = tmp_path / "sbatch.script"
    (fake / "scontrol").write_text(f"#!/bin/sh\ncat {tmp_path / 'config.txt'}\n")
    (fake / "sbatch").write_text(f"#!/bin/sh\ncat > {script}\necho 7\n")
    for name in ("scontrol", "sbatch"):
        (fake / name).chmod(0o755)
    (tmp_path / "t.py").write_text("print('hi')\n")
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "bluevela", "--site", str(REPO / "site.yaml"),
                           "submit", "--no-python-check", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env, cwd=tmp_path)
    return proc, script


def test_submit_expedite_where_slurm_takes_it(tmp_path: Path) -> None:
    """25.11 with enable_expedited_requeue: the batch script asks for it (and only it: the
    plain --requeue line is replaced); the script's own arguments are left alone."""
    proc, script = _bv(tmp_path, "-N", "2", "--requeue=expedite", "t.py", "--requeue=x",
                       params="enable_expedited_requeue")
    assert proc.returncode == 0, proc.stderr
    lines = script.read_text().splitlines()
    assert "#SBATCH --requeue=expedite" in lines and "#SBATCH --requeue" not in lines
    assert "#SBATCH --no-requeue" not in lines
    assert any(ln.endswith("t.py --requeue=x") for ln in lines)
    # what it does to bv's own recovery (measured on 25.11.7) is said at the submit
    assert "bv: note: --requeue=expedite does not fit bv's recovery yet" in proc.stderr
    assert "REQUEUE_HOLD" in proc.stderr


@pytest.mark.parametrize(("release", "params", "want"), [
    ("24.11", None, "bv: error: --requeue=expedite: Slurm 24.11.5 has no expedited requeue "
                    "(Slurm 25.11 and later); submit with --requeue\n"),
    ("25.11", None, "bv: error: --requeue=expedite: Slurm 25.11.7 refuses it: slurm.conf "
                    "SlurmctldParameters lacks enable_expedited_requeue (`bv site validate "
                    "--cluster` reports it)\n"),
])
def test_submit_expedite_refused_in_one_line(tmp_path: Path, release: str, params: str | None,
                                            want: str) -> None:
    """Where the running Slurm would not take it: one line, exit 2, and sbatch never runs."""
    proc, script = _bv(tmp_path, "--requeue=expedite", "t.py", release=release, params=params)
    assert (proc.returncode, proc.stderr.splitlines()[-1] + "\n") == (2, want)
    assert not script.exists()


@pytest.mark.parametrize(("args", "want"), [
    (["--requeue=later"], "bv: error: --requeue=later: the only value is expedite (Slurm 25.11 "
                          "and later), or give --requeue alone"),
    (["--requeue=expedite", "--no-requeue"],
     "bv: error: --requeue=expedite and --no-requeue contradict each other: give one"),
])
def test_submit_requeue_value_refused(tmp_path: Path, args: list[str], want: str) -> None:
    proc, script = _bv(tmp_path, "--dry-run", *args, "t.py")
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, want)
    assert not script.exists()


def test_dry_run_renders_expedite_without_asking_slurm(tmp_path: Path) -> None:
    """A dry run touches no Slurm (24.11's config here would refuse it): it shows the line."""
    proc, _ = _bv(tmp_path, "--dry-run", "--requeue=expedite", "t.py", release="24.11")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --requeue=expedite\n" in proc.stdout
