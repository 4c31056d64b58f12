"""bv's pyslurm client against a real Slurm (issue 34): PyPI's pyslurm 25.11.2 built against
the 25.11 build (/opt/bluevela-ci/pyslurm-venv, docs/install.md "Slurm releases"), on the dev
cluster running 25.11. Run it in that virtualenv's Python with the cluster on 25.11::

    BV_SLURM=25.11 /opt/bluevela-ci/pyslurm-venv/bin/python -m pytest tests/slurm/test_pyslurm_cluster.py

Skipped, with the reason, where pyslurm does not import or was built for another release than
the cluster's; there the CLI client is the one bv uses (bluevela/slurm/connect.py get_client).
tests/run-releases runs it on 25.11 in that Python with ``BV_PYSLURM_REQUIRED=1``: there a
pyslurm that does not import or does not match fails the test, never skips it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.slurm.cli_client import CliSlurmClient
from bluevela.slurm.client import JobInfo
from tests.conftest import DevCluster

pytestmark = pytest.mark.cluster


def _not_here(why: str) -> None:
    """Skip, or fail where the caller asked for pyslurm by name (BV_PYSLURM_REQUIRED=1)."""
    if os.environ.get("BV_PYSLURM_REQUIRED") == "1":
        pytest.fail(f"BV_PYSLURM_REQUIRED=1 but {why}")
    pytest.skip(why)


def _pyslurm(cluster: DevCluster) -> Any:
    # libslurm reads SLURM_CONF once, when pyslurm is first imported.
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    try:
        import pyslurm
    except ImportError as exc:
        _not_here(f"pyslurm does not import here ({exc}): run this in "
                  "/opt/bluevela-ci/pyslurm-venv's Python")
    return pyslurm


def _submit(cluster: DevCluster, script: str, *opts: str) -> int:
    out = cluster.run(["sbatch", "--parsable", *opts], input=f"#!/bin/sh\n{script}\n").stdout
    return int(out.strip().split(";")[0])


def _wait(cli: CliSlurmClient, job: int, states: set[str], timeout: float = 90) -> JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = cli.job(job)
        if info.state_name in states:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.5)


def _clients(cluster: DevCluster) -> tuple[Any, CliSlurmClient, Any]:
    """pyslurm, the CLI client and bv's pyslurm client for the cluster (skip, or fail where
    asked, when pyslurm is not built for the cluster's release)."""
    pyslurm = _pyslurm(cluster)
    from bluevela.slurm.pyslurm_client import PySlurmClient, pyslurm_matches

    os.environ["PATH"] = cluster.env.get("PATH", os.environ["PATH"])
    cli = CliSlurmClient(retry_s=0)
    if not pyslurm_matches(cli):
        _not_here(f"pyslurm {pyslurm.__version__} is not built for the cluster's Slurm "
                  f"{'.'.join(map(str, cli.version()))}")
    return pyslurm, cli, PySlurmClient(fallback=cli)


def test_pyslurm_client_reads_jobs_as_the_cli_does(devcluster: DevCluster,
                                                   tmp_path: Path) -> None:
    from bluevela.slurm.connect import get_client
    from bluevela.slurm.pyslurm_client import PySlurmClient

    _, cli, ps = _clients(devcluster)
    assert isinstance(get_client(), PySlurmClient)  # what bv picks when they match
    jobs = {
        "done": _submit(devcluster, "true", "-N2", f"--chdir={tmp_path}", "-o", "bv-%j.out"),
        "failed": _submit(devcluster, "exit 3", "-N1", f"--chdir={tmp_path}"),
        "running": _submit(devcluster, "sleep 120", "-N1", f"--chdir={tmp_path}"),
    }
    try:
        _wait(cli, jobs["done"], {"COMPLETED"})
        _wait(cli, jobs["failed"], {"FAILED"})
        _wait(cli, jobs["running"], {"RUNNING"})
        for role, job in jobs.items():
            # pyslurm names a job whose epilog still runs COMPLETING (squeue's first state
            # word is already COMPLETED): compared once the epilogs are done.
            deadline = time.monotonic() + 60
            while (a := ps.job(job)).state_name == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.5)
            b = cli.job(job)
            same = ("job_id", "state", "state_name", "exit_code", "signal", "nodes", "name",
                    "user", "partition", "work_dir", "restarts")
            assert {k: getattr(a, k) for k in same} == {k: getattr(b, k) for k in same}, role
        assert ps.job(jobs["failed"]).exit_code == 3
        assert ps.job(jobs["done"]).stdout == f"{tmp_path}/bv-{jobs['done']}.out"
    finally:
        cli.cancel(list(jobs.values()))


def test_pyslurm_client_names_a_completing_jobs_allocation(devcluster: DevCluster,
                                                          tmp_path: Path) -> None:
    """A 2-node job that ended while node2's epilog cannot end (its slurmd stopped): pyslurm's
    node list then names node2 alone; bv's client names the allocation, as the CLI's does."""
    pyslurm, cli, ps = _clients(devcluster)
    job = _submit(devcluster, "sleep 2", "-N2", "-w", "node1,node2", f"--chdir={tmp_path}")
    pid = int((devcluster.state_dir / "run" / "slurmd.node2.pid").read_text().split()[0])
    try:
        _wait(cli, job, {"RUNNING"})
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while str(pyslurm.Job.load(job).allocated_nodes) != "node2":
            assert time.monotonic() < deadline, "the job never stood completing on node2 alone"
            time.sleep(0.3)
        a = ps.job(job)
        assert a.nodes == ("node1", "node2") and a.nodes == cli.job(job).nodes
    finally:
        os.kill(pid, signal.SIGCONT)
        cli.cancel([job])
