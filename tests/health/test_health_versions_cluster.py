"""Issue 11 on the REAL dev cluster: a kernel off its CRITICAL pin drains the node with a precise
reason and stands out in `bv health nodes --versions`; a DCGM level-1 failure in the
healthcheck drains, and the level-2 diagnostic gates the resume.

- Versions: every node runs the site copy that pins the cpu class's kernel to the one this
  machine runs (CRITICAL). node2 reads a root whose `proc/sys/kernel/osrelease` says
  6.1.0-17-amd64 (its meminfo and mounts copied from this machine): its prolog drains it.
- DCGM: node3 reads the healthy H100 fixture with a replaying `dcgmi` installed in the copied
  root (tests/data/dcgm-replay/dcgmi prints documented-format fixtures verbatim).

    BV_DEVCLUSTER_ID=2 python -m pytest tests/health/test_health_versions_cluster.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import DevCluster
from tests.fixture_trees import materialized
from tests.hooks.test_hooks_cluster import node_state, point_at, run_in_node

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURES = materialized()


@pytest.fixture
def cluster(devcluster: DevCluster) -> Iterator[DevCluster]:
    """The shared cluster, clean before and restored after (hook.env files, drains)."""
    with devcluster.clean():
        yield devcluster


def site_copy(tmp_path: Path, edit: dict[str, object], cpu: dict[str, object] | None = None,
              h100: dict[str, object] | None = None) -> Path:
    site = yaml.safe_load((REPO / "site.yaml").read_text())
    site["health"].update(edit)
    site["node_classes"]["cpu"].update(cpu or {})
    site["node_classes"]["h100"].update(h100 or {})
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    path.chmod(0o644)
    return path


def test_kernel_off_critical_pin_drains_and_shows_in_versions_view(cluster: DevCluster,
                                                                   tmp_path: Path) -> None:
    real = Path("/proc/sys/kernel/osrelease").read_text().strip()
    old = "6.1.0-17-amd64"
    assert real != old
    site = site_copy(tmp_path, {}, cpu={"versions": {"kernel": real, "critical": ["kernel"]}})
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    root = tmp_path / "node2-root"  # what node2 reads instead of /: an older kernel
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "tmp").mkdir()
    for name in ("meminfo", "mounts"):
        shutil.copyfile(f"/proc/{name}", root / "proc" / name)
    (root / "proc/sys/kernel/osrelease").write_text(old + "\n")
    for node in cluster.nodes:
        cluster.set_hook_env(node, BV_SITE=str(site), BV_SPOOL_DIR=str(spool))
    cluster.set_hook_env("node2", BV_SYSFS_ROOT=str(root))

    for i, node in enumerate(cluster.nodes, start=1):
        p = run_in_node(cluster, node, "prolog", {
            "SLURMD_NODENAME": node, "SLURM_JOB_ID": str(990_000 + i),
            "SLURM_JOB_USER": "root", "SLURM_NODELIST": node, "SLURM_JOB_NUM_NODES": "1"})
        assert p.returncode == (1 if node == "node2" else 0), (node, p.stderr)
    status, reason = node_state(cluster, "node2")
    assert status == "drained", (status, reason)
    assert reason == f"bv: versions: kernel {old}, pinned {real}", reason
    report = json.loads((spool / "990002.node2.prolog.json").read_text())
    versions = next(c for c in report["health"]["checks"] if c["name"] == "versions")
    assert versions["info"] == {"kernel": old} and versions["status"] == "CRITICAL"

    env = cluster.environ(BV_SITE=str(site), BV_SPOOL_DIR=str(spool))
    cli = [sys.executable, "-m", "bluevela", "health", "nodes", "--versions"]
    p = subprocess.run([*cli, "--json"], env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr
    view = json.loads(p.stdout)
    assert view["classes"]["cpu"] == {"pinned": {"kernel": [real]}, "majority": {"kernel": real}}
    assert [(g["nodes"], g["versions"], g["drift"]) for g in view["groups"]] == [
        ("node[1,3]", {"kernel": real}, []), ("node2", {"kernel": old}, ["kernel"])]
    assert view["drifting_nodes"] == 1
    p = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()  # not a terminal: tab-separated rows
    assert lines[0] == "CLASS\tNODES\tN\tDRIVER\tCUDA\tVBIOS\tHCA_FW\tKERNEL", p.stdout
    assert f"cpu\t(pinned)\t\t-\t-\t-\t-\t{real}" in lines
    assert f"cpu\tnode[1,3]\t2\t-\t-\t-\t-\t{real}" in lines
    assert f"cpu\tnode2\t1\t-\t-\t-\t-\t{old} *" in lines
    p = subprocess.run([*cli, "--all"], env=env, capture_output=True, text=True, timeout=60,
                       check=False)
    assert f"cpu\tnode3\t1\t-\t-\t-\t-\t{real}" in p.stdout.splitlines(), p.stdout


def bv_in_node(cluster: DevCluster, node: str, env: dict[str, str],
               *args: str) -> subprocess.CompletedProcess[str]:
    """`bv ARGS` inside the node's namespaces (its hostname: "this host" is the node)."""
    pid = (cluster.state_dir / "run" / f"slurmd.{node}.pid").read_text().strip()
    nsenter = shutil.which("nsenter")
    assert nsenter, "nsenter is needed to enter a node's namespaces"
    assigns = [f"{k}={v}" for k, v in {"SLURM_CONF": cluster.env["SLURM_CONF"], **env}.items()]
    return subprocess.run([nsenter, "-t", pid, "-m", "-u", "-n", "--", "/usr/bin/env", "-i",
                           "PATH=/usr/bin:/bin", *assigns, sys.executable, "-m", "bluevela",
                           *args], capture_output=True, text=True, timeout=120, check=False)


def _replay(root: Path, level: int, fixture: str) -> None:
    shutil.copyfile(FIXTURES / fixture, root / "usr/share/bv-dcgm-replay" / f"r{level}.json")


def test_dcgm_level1_failure_drains_and_level2_gates_the_resume(cluster: DevCluster,
                                                                tmp_path: Path) -> None:
    site = site_copy(tmp_path, {
        "dcgm": {"healthcheck_level": 1, "before_resume_level": 2,
                 "healthcheck_timeout_s": 20, "before_resume_timeout_s": 20},
        "tiers": {"quick": {"checks": ["gpu", "ib", "node"], "cap_s": 5, "check_timeout_s": 3},
                  "full": {"checks": ["gpu", "ib", "node", "versions"], "cap_s": 30,
                           "check_timeout_s": 10}}})
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "h100-healthy" / "root", root, symlinks=True)
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(DATA / "dcgm-replay" / "dcgmi", root / "usr/bin/dcgmi")
    (root / "usr/share/bv-dcgm-replay").mkdir(parents=True)
    _replay(root, 1, "dcgm-diag-4x-r1-rowremap-fail.json")
    _replay(root, 2, "dcgm-diag-4x-r2-memory-fail.json")
    point_at(cluster, "node3", "h100-healthy")
    cluster.set_hook_env("node3", BV_SITE=str(site), BV_SYSFS_ROOT=str(root))

    hc = run_in_node(cluster, "node3", "healthcheck")
    assert hc.returncode == 0, hc.stderr
    status, reason = node_state(cluster, "node3")
    assert status == "drained", (status, reason, hc.stderr)
    assert reason.startswith("bv: dcgm: diag r1 GPU 3 software failed: GPU 3 had uncorrectable "
                             "memory errors and row remapping failed."), reason

    # Level 1 passes now, but the level-2 diagnostic before the resume finds GPU 3's memory bad.
    _replay(root, 1, "dcgm-diag-3x-r1-pass.json")
    hc = run_in_node(cluster, "node3", "healthcheck")
    assert ("stays drained (" + reason) in hc.stderr, hc.stderr
    assert "DCGM diag r2 before resume: CRITICAL: diag r2 GPU 3 memory failed" in hc.stderr
    assert node_state(cluster, "node3")[0] == "drained"
    # An operator's `bv health resume` on the node itself re-checks the same way: refused.
    p = bv_in_node(cluster, "node3", {"BV_SITE": str(site), "BV_SYSFS_ROOT": str(root),
                                      "BV_NODE_CLASS": "h100", "BV_NVML_SNAPSHOT":
                                      str(FIXTURES / "h100-healthy" / "nvml.json")},
                   "health", "resume", "node3")
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("node3: REFUSED: re-check failed: DCGM diag r2 before resume: "
                               "CRITICAL: diag r2 GPU 3 memory failed"), p.stderr
    assert node_state(cluster, "node3")[0] == "drained"

    _replay(root, 2, "dcgm-diag-4x-r2-pass.json")
    hc = run_in_node(cluster, "node3", "healthcheck")
    assert "resumed node3" in hc.stderr and "DCGM diag r2 passes" in hc.stderr, hc.stderr
    assert node_state(cluster, "node3") == ("idle", "")
