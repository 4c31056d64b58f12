"""Issue 24 on the REAL dev cluster: slurmd runs the real shims (prolog_epilog/), each node
with its own /etc/bluevela. A broken install drains nothing, the audit mode and the kill
switch act nowhere, and every hook run leaves one syslog line (a real datagram socket bound
by the test, named by BV_SYSLOG_SOCKET in each node's hook.env).

Before the fix (9058adc) node1/node2's prologs exited 1 (ModuleNotFoundError) and Slurm
drained both "Prolog error". One test, three short jobs and a healthcheck (~15 s here):

    BV_DEVCLUSTER_ID=6 python -m pytest tests/hooks/test_hooks_failopen_cluster.py
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster
from tests.fixture_trees import materialized
from tests.hooks.test_hooks_cluster import run_in_node
from tests.hooks.test_hooks_failopen import SYSTEM_PY, SyslogSocket, half_installed, needs_system_py

pytestmark = [pytest.mark.cluster, pytest.mark.slow, needs_system_py]

FIXTURES = materialized()


def node_state(cluster: DevCluster, node: str) -> tuple[str, str]:
    out = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"]).stdout.strip()
    state, _, reason = out.splitlines()[0].partition("|")
    return state.rstrip("*~#!%$@^-"), ("" if reason == "none" else reason)


def run_job(cluster: DevCluster, nodes: str, tmp_path: Path, timeout: float = 90) -> int:
    """Submit `true` on `nodes`; return once it COMPLETED. Fails early (not after a requeue's
    two minutes) as soon as one of the nodes is drained."""
    job = int(cluster.run(["sbatch", "--parsable", "-N", str(len(nodes.split(","))), "-w",
                           nodes, "-o", "/dev/null", "--wrap", "true"],
                          cwd=tmp_path).stdout.strip().split(";")[0])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        drained = {n: node_state(cluster, n) for n in nodes.split(",")}
        bad = {n: s for n, s in drained.items() if s[0].startswith("drain")}
        assert not bad, f"job {job}: drained {bad}"
        out = cluster.run(["squeue", "-h", "-j", str(job), "-o", "%T"], check=False).stdout
        if not out.strip():
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job} not done after {timeout} s")


def lines_of(syslog: SyslogSocket, want: int, job: int | None = None,
             timeout: float = 30) -> list[str]:
    """Datagrams until `want` have come (the epilog runs after the job leaves squeue): those of
    `job` when one is named, else those of a healthcheck. A line of a healthcheck that slurmd
    runs at times of its own (HealthCheckProgram), or of an EARLIER job's hook that ran late
    (CI: the grow test before this one on the same cluster lost node2 from its job 69; node2's
    epilog for job 69 ran 72 s later, once this test had pointed node2's hooks at its socket),
    or this job's own epilog on a node a second time, even while a later healthcheck is
    awaited, may come at any moment: it is set aside and printed, but it must have done nothing
    to a node. Any other line fails the test."""
    mark = f"job={job} " if job is not None else "healthcheck "
    got: list[str] = []
    others: list[str] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout

    def take(wait_s: float) -> None:
        for line in syslog.lines(wait_s=wait_s):
            run = re.search(r" (prolog|epilog|healthcheck) (?:job=\d+ )?node=(\S+) ", line)
            key = run.group(0) if run else line
            # This job's epilog on a node once more (the same resent terminate): set aside.
            again = key in seen and run is not None and run.group(1) == "epilog"
            (got if mark in line and not again else others).append(line)
            seen.add(key)

    while len(got) < want and time.monotonic() < deadline:
        take(0.5)
    take(1.0)  # and nothing more
    for line in others:
        sys.stderr.write(f"another hook's line: {line}\n")
        earlier = re.search(r" (?:prolog|epilog) job=(\d+) ", line)
        # While a healthcheck is awaited, every job this test ran has ended: a job's hook line
        # then is an earlier one's (CI: the grow test's job 424 lost node2 at 10:12:18 and
        # ended at 10:13:12; node2's epilog for it came at 10:13:30, during part 4's
        # healthcheck here).
        assert "healthcheck " in line or (earlier is not None and (
            job is None or int(earlier.group(1)) <= job)), (line, got)
        assert not re.search(r"action=(drained|resumed|held)\b", line), (line, got)
    return got


@pytest.fixture
def cluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    etc = {n: devcluster.hook_env(n).parent for n in devcluster.nodes}
    saved = {n: (devcluster.hook_env(n).read_text(), (etc[n] / "python").read_text())
             for n in devcluster.nodes}
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    try:
        yield devcluster
    finally:
        devcluster.run(["scontrol", "delete", "ReservationName=bv-actions-off"], check=False)
        for n, (hook_env, python) in saved.items():
            devcluster.hook_env(n).write_text(hook_env)
            (etc[n] / "python").write_text(python)
            (etc[n] / "actions").unlink(missing_ok=True)
        try:
            devcluster.wait_idle(timeout=120)
        finally:
            devcluster.resume_all()


def test_broken_install_audit_and_kill_switch_act_nowhere(cluster: DevCluster,
                                                          tmp_path: Path) -> None:
    syslog = SyslogSocket(tmp_path / "dev-log")
    try:
        for n in cluster.nodes:
            cluster.set_hook_env(n, BV_SYSLOG_SOCKET=str(syslog.path))
        etc = {n: cluster.hook_env(n).parent for n in cluster.nodes}
        python = {n: (etc[n] / "python").read_text() for n in cluster.nodes}

        # 1. node1's interpreter has no bluevela; node2's is an upgrade half done.
        (etc["node1"] / "python").write_text(f"{SYSTEM_PY}\n")
        (etc["node2"] / "python").write_text(f"{half_installed(tmp_path, 'no-phases')}\n")
        job = run_job(cluster, "node1,node2", tmp_path)
        lines = lines_of(syslog, 4, job)
        assert len(lines) == 4, "\n".join(lines)
        for node, error in (("node1", "No module named 'bluevela'"),
                            ("node2", "No module named 'bluevela.hooks.phases'")):
            for phase in ("prolog", "epilog"):
                mine = [ln for ln in lines if f"{phase} job={job} node={node} " in ln]
                assert len(mine) == 1 and "action=hook-error" in mine[0], (node, phase, lines)
                assert error in mine[0], mine
            assert node_state(cluster, node) == ("idle", "")
        for n in ("node1", "node2"):
            (etc[n] / "python").write_text(python[n])

        # 2. Audit on node3 (its own /etc/bluevela/actions), a port down: reported, not acted on.
        cluster.set_hook_env("node3", BV_NODE_CLASS="h100",
                             BV_SYSFS_ROOT=str(FIXTURES / "h100-ib-port-down" / "root"),
                             BV_NVML_SNAPSHOT=str(FIXTURES / "h100-ib-port-down" / "nvml.json"))
        (etc["node3"] / "actions").write_text("audit\n")
        job = run_job(cluster, "node3", tmp_path)
        lines = lines_of(syslog, 2, job)
        assert len(lines) == 2, "\n".join(lines)
        for ln in lines:
            assert f"job={job} node=node3 verdict=CRITICAL action=audit-would-drain" in ln, ln
            assert "mlx5_3/1 state DOWN" in ln and "mode=audit" in ln
        assert node_state(cluster, "node3") == ("idle", "")
        spool = Path(cluster.env["BV_SPOOL_DIR"])
        assert (spool / f"{job}.node3.prolog.json").is_file()  # everything reported

        # 3. Enforce on node3 again, but the kill switch is on the controller: no action.
        (etc["node3"] / "actions").unlink()
        cluster.run(["scontrol", "create", "reservation", "ReservationName=bv-actions-off",
                     "StartTime=now+3650days", "Duration=1", "Nodes=ALL", "Users=root",
                     "Flags=IGNORE_JOBS,OVERLAP"])
        job = run_job(cluster, "node3", tmp_path)
        lines = lines_of(syslog, 2, job)
        assert len(lines) == 2, "\n".join(lines)
        for ln in lines:
            assert f"job={job} node=node3 verdict=CRITICAL action=off-would-drain" in ln, ln
            assert "reservation bv-actions-off" in ln
        assert node_state(cluster, "node3") == ("idle", "")
        out = cluster.run(["scontrol", "show", "reservation", "-o"], check=False).stdout
        assert "bv-drain-" not in out  # not even a breaker slot was taken

        # 4. ... nor a resume: node3 passes again, drained by bv, and its healthcheck leaves it.
        cluster.set_hook_env("node3",
                             BV_SYSFS_ROOT=str(FIXTURES / "h100-healthy" / "root"),
                             BV_NVML_SNAPSHOT=str(FIXTURES / "h100-healthy" / "nvml.json"))
        cluster.run(["scontrol", "update", "NodeName=node3", "State=DRAIN",
                     "Reason=bv: ib: mlx5_3/1 state DOWN"])
        hc = run_in_node(cluster, "node3", "healthcheck")
        assert hc.returncode == 0, hc.stderr
        lines = lines_of(syslog, 1)
        assert len(lines) == 1 and "healthcheck node=node3 " in lines[0], lines
        assert "action=off-would-resume" in lines[0] and "reservation bv-actions-off" in lines[0]
        assert node_state(cluster, "node3") == ("drained", "bv: ib: mlx5_3/1 state DOWN")
    finally:
        syslog.close()
