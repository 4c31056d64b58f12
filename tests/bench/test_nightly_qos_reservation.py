"""The nightly's QOS and reservation (issue 35): docs/install.md advised a QOS or a reservation
so backfill does not take the idle nodes while the nightly measures them, but `bv bench
nightly` had no way to name either. `--qos` / `--reservation` put them on every benchmark job;
with a reservation, its idle nodes (state RESERVED) are selected too, checked against the dev
cluster's own Slurm."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from bluevela.bench.nightly import NightlyOptions, select_nodes
from bluevela.errors import LaunchError
from bluevela.launch.bench_job import BenchJobRequest, BenchStep
from bluevela.site import load_site
from tests.conftest import REPO, DevCluster

SITE = load_site(REPO / "site.yaml")


def test_qos_and_reservation_on_the_benchmark_jobs() -> None:
    req = BenchJobRequest(steps=(BenchStep(("/py",)),), nodelist=("node1",), qos="bvnightly",
                          reservation="bv-nightly")
    lines = req.materialize().splitlines()
    assert "#SBATCH --qos=bvnightly" in lines and "#SBATCH --reservation=bv-nightly" in lines
    with pytest.raises(LaunchError, match="is not a plain name"):
        BenchJobRequest(steps=(BenchStep(("/py",)),), nodelist=("node1",), reservation="a b")
    with pytest.raises(LaunchError, match="--qos 'x;y' is not a plain name"):
        NightlyOptions(qos="x;y")


def test_help_names_them() -> None:
    import sys

    p = subprocess.run([sys.executable, "-m", "bluevela", "bench", "nightly", "--help"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert "--qos" in p.stdout and "--reservation" in p.stdout


@pytest.mark.cluster
def test_a_reservations_idle_nodes_are_selected(devcluster: DevCluster) -> None:
    name = f"bvtest-{uuid.uuid4().hex[:8]}"
    devcluster.run(["scontrol", "create", "reservation", f"ReservationName={name}",
                    "StartTime=now", "Duration=10", "Users=root", "Nodes=node3"])
    try:
        import os

        from bluevela.slurm.connect import get_client

        old = dict(os.environ)
        os.environ.update(devcluster.env)
        try:
            client = get_client()
            # slurmctld marks a reservation's idle nodes RESERVED on its next periodic pass
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if client.nodes(["node3"])[0].state.upper() == "RESERVED":
                    break
                time.sleep(1)
            without, skipped, _ = select_nodes(client, SITE, None, ["node1", "node3"])
            within, _, _ = select_nodes(client, SITE, None, ["node1", "node3"],
                                        reservation=name)
        finally:
            os.environ.clear()
            os.environ.update(old)
    finally:
        devcluster.run(["scontrol", "delete", f"ReservationName={name}"], check=False)
    assert without == ["node1"] and "RESERVED" in skipped["node3"]
    assert within == ["node1", "node3"]


class _Nodes:
    """A stand-in for the client's one call still_idle makes (states as sinfo reports them)."""

    def nodes(self, names: list[str] | None = None) -> list[object]:
        from bluevela.slurm.client import NodeInfo

        return [NodeInfo("node1", "IDLE"), NodeInfo("node2", "RESERVED"),
                NodeInfo("node3", "ALLOCATED")]


def test_pairs_keep_a_reservations_nodes() -> None:
    from bluevela.bench.nightly import still_idle

    nodes = ["node1", "node2", "node3"]
    assert still_idle(_Nodes(), nodes) == {"node1"}  # type: ignore[arg-type]
    assert still_idle(_Nodes(), nodes, reservation="r") == {"node1", "node2"}  # type: ignore[arg-type]
