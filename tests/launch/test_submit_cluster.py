"""`bv submit`, `bv status`, `bv cancel`, `bv logs` against the REAL local Slurm cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, DevCluster

pytestmark = [pytest.mark.cluster]
EXAMPLE = str(REPO / "examples" / "train_ddp.py")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A submit directory with a space and shell syntax in its name."""
    d = tmp_path / "work dir $(touch pwned) ;x"
    d.mkdir()
    return d


def _wait_json(cluster: DevCluster, workdir: Path, *args: str) -> tuple[int, dict[str, object]]:
    proc = cluster.bv("submit", "--wait", "--json", *args, check=False, cwd=workdir, timeout=240)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_ddp_two_nodes_two_procs(devcluster: DevCluster, workdir: Path) -> None:
    rc, info = _wait_json(devcluster, workdir, "-N", "2", "--procs-per-node", "2", EXAMPLE,
                          "--steps", "20")
    assert rc == 0, info
    assert info["state"] == "COMPLETED" and info["exit_code"] == 0
    out = (workdir / f"bv-{info['job_id']}.out").read_text()
    ranks = re.findall(r"^rank=(\d+) world_size=(\d+) host=(\S+) loss=([0-9.]+)$", out, re.M)
    assert sorted(int(r[0]) for r in ranks) == [0, 1, 2, 3], out
    assert {r[1] for r in ranks} == {"4"}
    assert len({r[2] for r in ranks}) == 2
    assert {r[2] for r in ranks} == set(info["nodes"])  # type: ignore[arg-type]
    m = re.search(r"initial_loss=([0-9.]+) final_loss=([0-9.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1))
    assert not (workdir / "pwned").exists()


def test_failing_script_makes_wait_fail(devcluster: DevCluster, workdir: Path) -> None:
    rc, info = _wait_json(devcluster, workdir, "-N", "1", EXAMPLE, "--steps", "2", "--fail")
    assert info["state"] == "FAILED"
    assert info["exit_code"] != 0
    assert rc != 0 and rc == info["wait_exit_status"]


def test_status_json_and_hostile_names_roundtrip(devcluster: DevCluster, workdir: Path) -> None:
    name = "it's $(touch pwned) `x`; y"
    proc = devcluster.bv("submit", "--json", "-J", name, "--comment", name, "-N", "1", EXAMPLE,
                         "--steps", "2", cwd=workdir)
    job_id = json.loads(proc.stdout)["job_id"]
    assert isinstance(job_id, int)
    deadline = time.monotonic() + 120
    while True:
        st = json.loads(devcluster.bv("status", str(job_id), "--json").stdout)
        if st["terminal"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert st["job_id"] == job_id and st["state"] == "COMPLETED" and st["exit_code"] == 0
    assert st["name"] == name
    assert len(st["nodes"]) == 1 and st["nodes"][0].startswith("node")
    logs = devcluster.bv("logs", str(job_id)).stdout
    assert "rank=0 world_size=1" in logs
    assert not (workdir / "pwned").exists()


def test_cancel_running_job(devcluster: DevCluster, workdir: Path) -> None:
    script = workdir / "sleepy.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    job_id = json.loads(devcluster.bv("submit", "--json", str(script), cwd=workdir).stdout)["job_id"]
    deadline = time.monotonic() + 60
    while json.loads(devcluster.bv("status", str(job_id), "--json").stdout)["state"] != "RUNNING":
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.5)
    devcluster.bv("cancel", str(job_id))
    deadline = time.monotonic() + 60
    while True:
        st = json.loads(devcluster.bv("status", str(job_id), "--json").stdout)
        if st["terminal"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert st["state"] == "CANCELLED"


def test_unknown_job_is_one_line_error(devcluster: DevCluster) -> None:
    proc = devcluster.bv("status", "999999", "--json", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "bv: error: unknown job(s): 999999"


def test_controller_down_gives_clear_error_after_retry_budget(
    devcluster: DevCluster, workdir: Path
) -> None:
    """slurmctld stopped: bv retries for the (shortened) budget, then one line, exit 75."""
    pidfile = devcluster.state_dir / "run" / "slurmctld.pid"
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGTERM)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists():
            assert time.monotonic() < deadline, "slurmctld did not stop"
            time.sleep(0.2)
        t0 = time.monotonic()
        proc = devcluster.bv("submit", "--retry-s", "3", EXAMPLE, check=False, cwd=workdir,
                             timeout=120)
        elapsed = time.monotonic() - t0
        assert proc.returncode == 75, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("bv: error: slurmctld unreachable: sbatch failed"), proc.stderr
        assert "Traceback" not in proc.stderr
        assert elapsed >= 3.0
        assert elapsed < 3.0 + 2 * 25  # budget + at most one in-flight sbatch attempt or so
    finally:
        up = devcluster.run([sys.executable, str(REPO / "slurm" / "devcluster"), "up"],
                            check=False, timeout=120)
        assert up.returncode == 0, up.stderr


def test_logs_follow_ends_with_the_job(devcluster: DevCluster, workdir: Path) -> None:
    """`bv logs --follow` started while the job runs prints its lines and returns at the end."""
    proc = devcluster.bv("submit", "--json", EXAMPLE, "--steps", "5", cwd=workdir)
    job_id = json.loads(proc.stdout)["job_id"]
    logs = devcluster.bv("logs", str(job_id), "--follow", timeout=120)
    assert re.search(r"^rank=0 world_size=1 host=node\d loss=", logs.stdout, re.M), logs.stdout
    st = json.loads(devcluster.bv("status", str(job_id), "--json").stdout)
    assert st["terminal"] and st["state"] == "COMPLETED"
