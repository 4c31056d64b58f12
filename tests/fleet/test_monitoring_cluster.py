"""bv's alerts end to end on the REAL dev cluster: Debian's node_exporter in each node's
namespaces reads the node's bluevela.prom, Debian's prometheus scrapes them and the
controller's fleet file, and evaluates bv's rules; a real fault on one node fires the matching
alerts for that node only (Prometheus's own /api/v1/alerts), and they resolve after the repair
and `bv health resume`. With it, a GPU falls off the bus on a second node (NVML lists 7 GPUs,
the kernel logged XID 79 for the missing address): its alert fires, named by PCI address, and
the breaker (full) keeps the node in service, so BluevelaCriticalNodeNotDrained fires; then
the fleet view goes (its writer stopped, its file removed): the alerts on it go silent and
BluevelaFleetViewStale fires instead, until the writer is back.

The rules are a TEST COPY of prolog_epilog/prometheus/ with every `for:` shortened to
FOR_S and the recording group's interval to the scrape interval (the shipped values are
minutes); the expressions are the shipped ones, byte for byte.

    BV_DEVCLUSTER_ID=4 python -m pytest tests/fleet/test_monitoring_cluster.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DevCluster
from tests.fixture_trees import materialized

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "slurm" / "devcluster"
RULES = REPO / "prolog_epilog" / "prometheus"
FIXTURES = materialized()
SCRAPE_S = 1
FOR_S = 3


def rules_copy(dest: Path) -> Path:
    """The shipped rules with `for:` set to FOR_S and group intervals to SCRAPE_S."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("bluevela.rules.yml", "bluevela.recording.yml"):
        text = (RULES / name).read_text()
        text, n = re.subn(r"(?m)^(\s+for:) \d+[smh]$", rf"\1 {FOR_S}s", text)
        text = re.sub(r"(?m)^(\s+interval:) \d+[smh]$", rf"\1 {SCRAPE_S}s", text)
        text = re.sub(r"(?m)^(\s+keep_firing_for:) \d+[smh]$", rf"\1 {FOR_S}s", text)
        assert n > 0 or name == "bluevela.recording.yml"
        (dest / name).write_text(f"# TEST COPY: for: shortened to {FOR_S}s "
                                 f"(tests/fleet/test_monitoring_cluster.py)\n" + text)
    return dest


def site_without_nccl(dest: Path) -> Path:
    """site.yaml with the full tier's nccl left out: this machine has no GPU, so nccl on the
    h100 fixture is UNKNOWN on every node (true, and BluevelaCheckUnknown would say so)."""
    text = (REPO / "site.yaml").read_text()
    text, n = re.subn(r"full: \{checks: \[gpu, ib, node, versions, nccl\]",
                      "full: {checks: [gpu, ib, node, versions]", text)
    assert n == 1, "site.yaml's full tier changed: update site_without_nccl"
    dest.write_text(text)
    return dest


def point_at(cluster: DevCluster, node: str, fixture: str) -> None:
    cluster.set_hook_env(node, SLURM_CONF=cluster.env["SLURM_CONF"], BV_NODE_CLASS="h100",
                         BV_SYSFS_ROOT=str(FIXTURES / fixture / "root"),
                         BV_NVML_SNAPSHOT=str(FIXTURES / fixture / "nvml.json"))


def healthcheck(cluster: DevCluster, node: str) -> subprocess.CompletedProcess[str]:
    """The node's HealthCheckProgram, run in its namespaces as slurmd runs it."""
    pid = (cluster.state_dir / "run" / f"slurmd.{node}.pid").read_text().strip()
    nsenter = shutil.which("nsenter")
    assert nsenter
    return subprocess.run([nsenter, "-t", pid, "-m", "-u", "-n", "--", "/usr/bin/env", "-i",
                           sys.executable, "-m", "bluevela.hooks", "healthcheck"],
                          capture_output=True, text=True, timeout=120, check=False)


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """{node label (or the whole label set): value} of an instant query."""
        out: dict[str, float] = {}
        for r in self.get("/api/v1/query", query=expr)["result"]:
            key = r["metric"].get("node") or json.dumps(r["metric"], sort_keys=True)
            out[key] = float(r["value"][1])
        return out

    def firing(self) -> set[tuple[str, str]]:
        """(alertname, node or partition/class) of every firing alert."""
        return {(a["labels"]["alertname"],
                 a["labels"].get("node") or a["labels"].get("partition")
                 or a["labels"].get("class", ""))
                for a in self.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"}


def wait_for(what: str, probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not after {timeout:.0f} s (last: {last})")


@pytest.fixture
def monitored(devcluster: DevCluster, tmp_path: Path) -> Iterator[tuple[DevCluster, Prom]]:
    saved = {n: devcluster.hook_env(n).read_text() for n in devcluster.nodes}
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    rules = rules_copy(tmp_path / "rules")
    site = site_without_nccl(tmp_path / "site.yaml")
    for n in devcluster.nodes:
        devcluster.set_hook_env(n, BV_SITE=str(site))
        # results of checks other tests ran here (an nccl UNKNOWN) would stay in the file
        (devcluster.node_dir(n) / "var" / "last_results.json").unlink(missing_ok=True)
    up = devcluster.run([sys.executable, str(DEVCLUSTER), "monitoring", "up",
                         "--scrape-interval", f"{SCRAPE_S}s", "--rules", str(rules)],
                        timeout=120)
    port = re.search(r"prometheus http://127\.0\.0\.1:(\d+)", up.stdout)
    assert port, up.stdout
    try:
        yield devcluster, Prom(f"http://127.0.0.1:{port.group(1)}")
    finally:
        for n, text in saved.items():
            devcluster.hook_env(n).write_text(text)
        devcluster.resume_all()
        devcluster.run([sys.executable, str(DEVCLUSTER), "monitoring", "down"], timeout=120)


XID79 = ("NVRM: Xid (PCI:0000:db:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
         "the bus.\n")  # the driver's line (tests/data/health/h100-gpu-xid79)


def stop_fleet_writer(cluster: DevCluster) -> None:
    """Stop the fleet writer that `monitoring up` started (by its pid file) and remove its file."""
    pid = int((cluster.state_dir / "run" / "monitor.fleet.pid").read_text().split()[0])
    assert b"bluevela.fleet_metrics" in Path(f"/proc/{pid}/cmdline").read_bytes()
    os.kill(pid, signal.SIGTERM)
    wait_for("fleet writer stopped", lambda: not Path(f"/proc/{pid}").exists()
             or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], 30)
    (cluster.state_dir / "fleet-metrics" / "bluevela_fleet.prom").unlink()


# The fleet writer as nobody, as bv-fleet-metrics.service runs it as bvfleet: setuid after the
# interpreter and its modules are loaded (this Python lives under root's 0700 home).
AS_NOBODY = """
import os, sys
os.environ["BV_CACHE_DIR"] = "off"  # parse site.yaml in both loads: yaml imported before setuid
from bluevela import fleet_metrics
from bluevela.fleet import nodestate
from bluevela.site import load_site
from bluevela.slurm import cli_client
load_site(sys.argv[1], cwd=False)
import time; time.strptime("2026", "%Y")  # loads _strptime (reservation start times)
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
sys.exit(fleet_metrics.main(sys.argv[2:]))
"""


def fleet_as_nobody(cluster: DevCluster) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One run of the fleet writer as nobody into a root:nogroup 1775 directory (the unit's
    layout); its families as {name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    base = Path(tempfile.mkdtemp(prefix="bv-fleet-nobody-", dir="/tmp"))
    try:
        base.chmod(0o755)
        out = base / "textfile"
        out.mkdir()
        os.chown(out, 0, 65534)
        out.chmod(0o1775)
        site = cluster.env["BV_SITE"]
        p = cluster.run([sys.executable, "-c", AS_NOBODY, site, "--out", str(out),
                         "--site", site], cwd=Path("/"), timeout=120)
        assert "Traceback" not in p.stderr, p.stderr
        text = (out / "bluevela_fleet.prom").read_text()
        assert (out / "bluevela_fleet.prom").stat().st_uid == 65534
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fams: dict[str, list[tuple[dict[str, str], float]]] = {}
    for f in text_string_to_metric_families(text):
        for smp in f.samples:
            fams.setdefault(smp.name, []).append((dict(smp.labels), smp.value))
    return fams


def test_fault_on_one_node_fires_its_alerts_only_and_resolves(
        monitored: tuple[DevCluster, Prom], tmp_path: Path) -> None:
    cluster, prom = monitored
    nodes = cluster.nodes
    t_start = time.monotonic()
    for n in nodes:
        point_at(cluster, n, "h100-healthy")
        assert healthcheck(cluster, n).returncode == 0

    # Healthy: node_exporter's real textfile collector parses every node's file, Prometheus
    # has each node's status 0, and no alert fires.
    def healthy() -> bool:
        status = prom.query("bluevela_node_status")
        errors = prom.query('node_textfile_scrape_error{job="node"}')
        return (status == {n: 0.0 for n in nodes} and errors == {n: 0.0 for n in nodes}
                and prom.query("bluevela_node_gpus_expected") == {n: 8.0 for n in nodes})

    wait_for("healthy nodes scraped", healthy, 30)
    time.sleep(FOR_S + 2 * SCRAPE_S)  # long enough for any alert to turn firing
    assert prom.firing() == set(), prom.get("/api/v1/alerts")

    # The fault: node2's mlx5_3/1 goes DOWN; its healthcheck sees it, drains node2.
    point_at(cluster, "node2", "h100-ib-port-down")
    hc = healthcheck(cluster, "node2")
    t_fault = time.monotonic()
    assert "drained node2" in hc.stderr or "drain" in hc.stderr, hc.stderr
    # node3's GPU at DB:00 falls off the bus: NVML no longer lists it, the kernel logged XID 79.
    (tmp_path / "kmsg").write_text(XID79)
    point_at(cluster, "node3", "h100-gpu-missing")
    cluster.set_hook_env("node3", BV_KMSG=str(tmp_path / "kmsg"))
    healthcheck(cluster, "node3")
    gpu_gone = {("BluevelaCheckCritical", "node3"), ("BluevelaGpuMissing", "node3"),
                ("BluevelaGpuFallenOffBus", "node3")}
    node_level = {("BluevelaCheckCritical", "node2"), ("BluevelaIbPortDown", "node2")} | gpu_gone
    on_fleet_view = {("BluevelaNodeDrained", "node2"),
                     # 1 of 3 nodes is the breaker's whole budget at 15 %, and 33 % > 10 % of
                     # the class is drained: the fleet alerts fire too, naming the partition
                     # and class; the full breaker keeps node3 in service.
                     ("BluevelaFleetBreakerFull", "debug"), ("BluevelaClassDrainedHigh", "cpu"),
                     ("BluevelaCriticalNodeNotDrained", "node3")}
    expected = node_level | on_fleet_view
    fired = wait_for("alerts firing", lambda: expected <= prom.firing() and prom.firing(),
                     FOR_S + 2 * SCRAPE_S + 20)
    took = time.monotonic() - t_fault
    assert fired == expected, fired  # nothing about node1, node3, nothing else
    alerts = {a["labels"]["alertname"]: a for a in prom.get("/api/v1/alerts")["alerts"]
              if a["labels"].get("node") == "node2"}
    assert alerts["BluevelaIbPortDown"]["labels"]["device"] == "mlx5_3"
    assert alerts["BluevelaNodeDrained"]["labels"]["reason"].startswith(
        "bv: ib: mlx5_3/1 state DOWN")
    assert "node2" in alerts["BluevelaNodeDrained"]["annotations"]["summary"]
    fell = [a for a in prom.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == "BluevelaGpuFallenOffBus"]
    assert [a["labels"]["pci_bus_id"] for a in fell] == ["00000000:DB:00.0"], fell
    assert "gpu" not in fell[0]["labels"] and "00000000:DB:00.0" in fell[0]["annotations"]["summary"]
    # for: + two scrape intervals (+ one evaluation), + the fleet file's own 1 s period and
    # sinfo's time; slack for a loaded 2-core CI machine (measured 4.9-6.5 s here)
    assert took <= FOR_S + 3 * SCRAPE_S + 5, f"alerts fired {took:.1f} s after the fault"
    for a in alerts.values():  # pending as soon as the fault was scraped, firing after for:
        assert a["state"] == "firing"

    # The dashboard: every panel's query parses in this Prometheus and returns series, but
    # for the nightly's (no nightly ran, and nccl cannot run without a GPU).
    dash = json.loads((RULES / "grafana-dashboard.json").read_text())
    empty: list[str] = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$node", ".*")
            if not prom.get("/api/v1/query", query=expr)["result"]:
                empty.append(panel["title"])
    assert sorted(empty) == sorted(p["title"] for p in dash["panels"]
                                   if p["title"].startswith("Nightly")), empty

    # Unprivileged, the writer reads the same: sinfo and the breaker's reservation as nobody.
    fams = fleet_as_nobody(cluster)
    assert fams["bluevela_fleet_scrape_success"] == [({}, 1.0)]
    assert [lab["node"] for lab, _ in fams["bluevela_slurm_node_drained"]] == ["node2"]
    assert fams["bluevela_breaker_drained_nodes"] == [({"partition": "debug"}, 1.0)]

    # The fleet view goes: what only Slurm knows is no longer known. The alerts on it go silent
    # (node3 is still CRITICAL and not drained: no page from an unknown view), the node-level
    # ones stay, and BluevelaFleetViewStale says why.
    stop_fleet_writer(cluster)
    t_gone = time.monotonic()
    want = node_level | {("BluevelaFleetViewStale", "")}
    got = wait_for("fleet view stale", lambda: prom.firing() == want or None,
                   FOR_S + 2 * SCRAPE_S + 20)
    print(f"\nfleet view gone: stale alert after {time.monotonic() - t_gone:.1f} s")
    assert got
    # ... and back: `monitoring up` starts what is not running (the writer).
    cluster.run([sys.executable, str(DEVCLUSTER), "monitoring", "up", "--scrape-interval",
                 f"{SCRAPE_S}s", "--rules", str(tmp_path / "rules")], timeout=120)
    wait_for("fleet view back", lambda: prom.firing() == expected or None,
             FOR_S + 2 * SCRAPE_S + 20)

    # Repair: the port is back; `bv health resume node2` from this login node, then node2's
    # next healthcheck (slurmd runs it every HealthCheckInterval) rewrites its file; node3's
    # GPU is back after its reboot (no XID in the new boot's log).
    point_at(cluster, "node3", "h100-healthy")
    cluster.set_hook_env("node3", BV_KMSG="")
    assert healthcheck(cluster, "node3").returncode == 0
    point_at(cluster, "node2", "h100-healthy")
    p = cluster.bv("health", "resume", "node2")
    assert "node2: resumed" in p.stdout, p.stdout
    assert healthcheck(cluster, "node2").returncode == 0
    t_repair = time.monotonic()
    wait_for("alerts resolved", lambda: prom.firing() == set() or None,
             2 * SCRAPE_S + 20)
    resolved = time.monotonic() - t_repair
    print(f"\nfired {took:.1f} s after the fault (for: {FOR_S} s, scrape {SCRAPE_S} s), "
          f"resolved {resolved:.1f} s after the repair; test {time.monotonic() - t_start:.0f} s")
