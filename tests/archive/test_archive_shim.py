"""The EpilogSlurmctld shim (prolog_epilog/epilog_slurmctld) and its Python entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bluevela.archive import query
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import write_report
from bluevela.hooks import slurmctld

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "prolog_epilog" / "epilog_slurmctld"


def _spool_job(spool: Path, job_id: int, nodes: list[str]) -> None:
    for n in nodes:
        for phase in ("prolog", "epilog"):
            write_report(spool, sample_report(job_id, n, phase, nodelist=nodes, time=time.time()))


def test_shim_is_posix_sh() -> None:
    dash = shutil.which("dash") or "/bin/sh"
    subprocess.run([dash, "-n", str(SHIM)], check=True)
    assert os.access(SHIM, os.X_OK)


@pytest.mark.parametrize("job", ["", "12a", "1;id", "$(id)", "../1", "-1", " 7"])
def test_shim_refuses_a_job_id_that_is_not_a_number(job: str, tmp_path: Path) -> None:
    # No PATH, as slurmctld runs it. /etc/bluevela/python may or may not exist here: the
    # refusal happens either at the interpreter check or at the job id check, before Python.
    proc = subprocess.run(["/usr/bin/env", "-i", f"SLURM_JOB_ID={job}", "/bin/sh", str(SHIM)],
                          capture_output=True, text=True, timeout=30, cwd=tmp_path, check=False)
    assert proc.returncode == 0
    assert proc.stderr.startswith("bluevela epilog_slurmctld: ") and "skipped" in proc.stderr
    assert proc.stdout == ""


def test_entry_point_ingests_the_job(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    _spool_job(spool, 31, ["n1", "n2"])
    _spool_job(spool, 32, ["n1"])
    env = {"BV_HOOK_ENV": "none", "SLURM_JOB_ID": "31", "BV_SPOOL_DIR": str(spool),
           "BV_ARCHIVE_DIR": str(archive), "BV_ARCHIVE_WAIT_S": "0"}
    assert slurmctld.main(env) == 0
    assert [j["job_id"] for j in query.list_jobs(archive)] == [31]
    assert len(list(spool.glob("32.*.json"))) == 2  # another job's reports are left alone


def test_entry_point_fails_with_one_line(dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    spool, archive = dirs
    env = {"BV_HOOK_ENV": "none", "SLURM_JOB_ID": "../7", "BV_SPOOL_DIR": str(spool),
           "BV_ARCHIVE_DIR": str(archive)}
    assert slurmctld.main(env) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unsafe job id" in err
    env.update(SLURM_JOB_ID="7", BV_ARCHIVE_DIR=str(archive / "missing"))
    assert slurmctld.main(env) == 1
    assert "does not exist" in capsys.readouterr().err


def test_entry_point_waits_for_the_last_epilog(dirs: tuple[Path, Path]) -> None:
    spool, archive = dirs
    nodes = ["n1", "n2"]
    write_report(spool, sample_report(33, "n1", "epilog", nodelist=nodes, time=time.time()))
    env = {"BV_HOOK_ENV": "none", "SLURM_JOB_ID": "33", "BV_SPOOL_DIR": str(spool),
           "BV_ARCHIVE_DIR": str(archive), "BV_ARCHIVE_WAIT_S": "20"}
    proc = subprocess.Popen([sys.executable, "-m", "bluevela.hooks.slurmctld"],
                            env={**os.environ, **env}, cwd=REPO, stderr=subprocess.PIPE,
                            text=True)
    time.sleep(1.0)
    assert proc.poll() is None  # still waiting for n2
    write_report(spool, sample_report(33, "n2", "epilog", nodelist=nodes, time=time.time()))
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    assert query.show_job(archive, 33)["completion"] == "all_reported"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace for /etc/bluevela needs root and unshare")
def test_shim_end_to_end_with_no_path(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """The shim as slurmctld runs it: no PATH, /etc/bluevela/{python,hook.env} (bind-mounted
    in a private mount namespace so the host's /etc is untouched)."""
    spool, archive = dirs
    _spool_job(spool, 41, ["n1", "n2", "n3"])
    etc = tmp_path / "etc-bluevela"
    etc.mkdir()
    (etc / "python").write_text(sys.executable + "\n")
    (etc / "hook.env").write_text(f"BV_SPOOL_DIR={spool}\nBV_ARCHIVE_DIR={archive}\n"
                                  "BV_ARCHIVE_WAIT_S=0\n")
    (etc / "hook.env").chmod(0o644)
    Path("/etc/bluevela").mkdir(exist_ok=True)
    script = 'mount --bind "$1" /etc/bluevela && exec /usr/bin/env -i SLURM_JOB_ID=41 /bin/sh "$2"'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                           script, "sh", str(etc), str(SHIM)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    job = query.show_job(archive, 41)
    assert [n["node"] for n in job["nodes"]] == ["n1", "n2", "n3"]
    assert not list(spool.glob("*.json"))
