"""bv's alerts reach a person, on the REAL dev cluster: Prometheus (as in
test_monitoring_cluster.py) sends to Debian's Alertmanager running the shipped routing
(prolog_epilog/prometheus/alertmanager.example.yml, its receivers pointed at a webhook server
in this test process, its timings shortened by `slurm/devcluster monitoring up --webhook`).

The same faults as test_monitoring_cluster.py: node2's InfiniBand port goes DOWN (bv drains
it), node3's GPU falls off the bus with the fleet breaker full (bv cannot drain it). What a
person gets: node3's page ONCE, its three alerts in one notification, each with its runbook
link; node2's page never (its drain alert, a ticket, inhibits it), node2's and node3's
tickets once each; after the repair, the resolves of exactly those.

The rules are a TEST COPY with `for:` shortened: 3 s, the drain alerts 1 s (shipped: 1m
before the node's own 2m, the order the inhibition relies on) and their keep_firing_for 3 s
(shipped 2m: the inhibition outlasts the node's own alerts at the repair), and the two
capacity alerts (BluevelaClassDrainedHigh, BluevelaFleetBreakerFull) left at their shipped
minutes: one drained node is a third of this 3-node class, a fleet event no single fault is
at a site.

    BV_DEVCLUSTER_ID=7 python -m pytest tests/fleet/test_alertmanager_cluster.py
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DevCluster
from tests.fleet.test_alertmanager_config import Webhook
from tests.fleet.test_monitoring_cluster import (
    DEVCLUSTER,
    RULES,
    XID79,
    Prom,
    healthcheck,
    point_at,
    site_without_nccl,
    wait_for,
)

pytestmark = [pytest.mark.cluster]

SCRAPE_S = 1
FOR_S = 3
FOR_DRAIN_S = 1
SHIPPED_FOR = {"BluevelaClassDrainedHigh", "BluevelaFleetBreakerFull"}
DRAIN_ALERTS = {"BluevelaNodeDrained", "BluevelaNightlyRegression"}
GROUP_INTERVAL_S = 2  # slurm/devcluster's DEV_ALERT_TIMINGS


def rules_copy(dest: Path) -> Path:
    """The shipped rules with `for:` shortened per alert (module docstring)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("bluevela.rules.yml", "bluevela.recording.yml"):
        out, alert = [], ""
        for line in (RULES / name).read_text().splitlines(keepends=True):
            if m := re.match(r"\s+- alert: (\S+)$", line):
                alert = m.group(1)
            if (m := re.fullmatch(r"(\s+for:) \d+[smh]\n", line)) and alert not in SHIPPED_FOR:
                line = f"{m.group(1)} {FOR_DRAIN_S if alert in DRAIN_ALERTS else FOR_S}s\n"
            line = re.sub(r"^(\s+keep_firing_for:) \d+[smh]$", rf"\1 {FOR_S}s", line)
            out.append(re.sub(r"^(\s+interval:) \d+[smh]$", rf"\1 {SCRAPE_S}s", line))
        (dest / name).write_text("# TEST COPY (tests/fleet/test_alertmanager_cluster.py)\n"
                                 + "".join(out))
    return dest


@pytest.fixture
def alerting(devcluster: DevCluster, tmp_path: Path
             ) -> Iterator[tuple[DevCluster, Prom, Webhook, str]]:
    saved = {n: devcluster.hook_env(n).read_text() for n in devcluster.nodes}
    devcluster.wait_idle(timeout=120)
    devcluster.resume_all()
    site = site_without_nccl(tmp_path / "site.yaml")
    for n in devcluster.nodes:
        devcluster.set_hook_env(n, BV_SITE=str(site))
        (devcluster.node_dir(n) / "var" / "last_results.json").unlink(missing_ok=True)
    hook = Webhook()
    try:
        up = devcluster.run([sys.executable, str(DEVCLUSTER), "monitoring", "up",
                             "--scrape-interval", f"{SCRAPE_S}s", "--rules",
                             str(rules_copy(tmp_path / "rules")), "--webhook", hook.url],
                            timeout=120)
        port = re.search(r"prometheus http://127\.0\.0\.1:(\d+)", up.stdout)
        am = re.search(r"alertmanager (http://127\.0\.0\.1:\d+)", up.stdout)
        assert port and am, up.stdout
        yield devcluster, Prom(f"http://127.0.0.1:{port.group(1)}"), hook, am.group(1)
    finally:
        for n, text in saved.items():
            devcluster.hook_env(n).write_text(text)
        devcluster.resume_all()
        devcluster.run([sys.executable, str(DEVCLUSTER), "monitoring", "down"], timeout=120)
        hook.close()


def test_fault_pages_once_grouped_with_runbook_and_resolves(
        alerting: tuple[DevCluster, Prom, Webhook, str], tmp_path: Path) -> None:
    cluster, prom, hook, am_url = alerting
    t_start = time.monotonic()
    for n in cluster.nodes:
        point_at(cluster, n, "h100-healthy")
        assert healthcheck(cluster, n).returncode == 0
    wait_for("healthy nodes scraped",
             lambda: prom.query("bluevela_node_status") == {n: 0.0 for n in cluster.nodes}, 30)

    # node2: port DOWN, drained by bv (the breaker's one slot of 3 nodes at 15 %); node3: a GPU
    # off the bus, held in service by the full breaker.
    point_at(cluster, "node2", "h100-ib-port-down")
    assert "drain" in healthcheck(cluster, "node2").stderr
    (tmp_path / "kmsg").write_text(XID79)
    point_at(cluster, "node3", "h100-gpu-missing")
    cluster.set_hook_env("node3", BV_KMSG=str(tmp_path / "kmsg"))
    healthcheck(cluster, "node3")
    t_fault = time.monotonic()

    page = {"BluevelaGpuMissing", "BluevelaGpuFallenOffBus", "BluevelaCriticalNodeNotDrained"}
    want_pager = [("firing", "node3", page)]
    want_ticket = sorted([("firing", "node2", {"BluevelaNodeDrained"}),
                          ("firing", "node3", {"BluevelaCheckCritical"})])

    def arrived() -> bool:
        return (len(hook.notes("/pager")) >= 1 and len(hook.notes("/ticket")) >= 2)

    wait_for("notifications", arrived, 40)
    took = time.monotonic() - t_fault
    # node2's own alerts did fire in Prometheus: their silence is the inhibition's doing
    firing = prom.firing()
    assert {("BluevelaIbPortDown", "node2"), ("BluevelaCheckCritical", "node2")} <= firing
    with urllib.request.urlopen(f"{am_url}/api/v2/alerts", timeout=5) as resp:
        held = {a["labels"]["alertname"]: a["status"] for a in json.load(resp)
                if a["labels"].get("node") == "node2"}
    for name in ("BluevelaIbPortDown", "BluevelaCheckCritical"):
        assert held[name]["state"] == "suppressed" and held[name]["inhibitedBy"], held
    time.sleep(2 * GROUP_INTERVAL_S + 1)  # nothing more comes: no second page, no update
    assert hook.notes("/pager") == want_pager, hook.notes("/pager")
    assert sorted(hook.notes("/ticket"), key=str) == sorted(want_ticket, key=str), \
        hook.notes("/ticket")
    (_, body), = [(p, b) for p, b in hook.got if p == "/pager"]
    assert body["receiver"] == "bluevela-pager" and body["groupLabels"] == {"node": "node3"}
    for p, b in hook.got:
        assert b["receiver"] == f"bluevela-{p.strip('/')}", (p, b["receiver"])
        for a in b["alerts"]:
            name = a["labels"]["alertname"]
            assert a["annotations"]["runbook_url"] == f"docs/monitoring.md#{name.lower()}"
            assert a["labels"]["node"] == b["groupLabels"]["node"]
    fell = [a for a in body["alerts"] if a["labels"]["alertname"] == "BluevelaGpuFallenOffBus"]
    assert "00000000:DB:00.0" in fell[0]["annotations"]["summary"]

    # Repair: node3's GPU back (a reboot: no XID in the new boot's log), node2's port back;
    # each node's healthcheck passes (node2's resumes it).
    n_before = len(hook.got)
    point_at(cluster, "node3", "h100-healthy")
    cluster.set_hook_env("node3", BV_KMSG="")
    assert healthcheck(cluster, "node3").returncode == 0
    point_at(cluster, "node2", "h100-healthy")
    hc = healthcheck(cluster, "node2")
    assert hc.returncode == 0, hc.stderr
    if "resumed" not in hc.stderr:
        assert "node2: resumed" in cluster.bv("health", "resume", "node2").stdout
    t_repair = time.monotonic()

    def closed(path: str, node: str) -> bool:
        last = [b for p, b in hook.got[n_before:] if p == path
                and b["groupLabels"].get("node") == node]
        return bool(last) and last[-1]["status"] == "resolved"

    wait_for("resolves", lambda: closed("/pager", "node3") and closed("/ticket", "node3")
             and closed("/ticket", "node2"), 30)
    resolved = time.monotonic() - t_repair
    time.sleep(2 * GROUP_INTERVAL_S + 1)  # and nothing after them
    # What the repair sent, per receiver and node: {alert: its last status}. The alerts of a
    # group resolve in rule evaluations a second apart, so a group may close in two updates
    # (the first still "firing", its resolved alerts listed as such), never with a new page.
    before: dict[tuple[str, str], set[str]] = {}
    for p, b in hook.got[:n_before]:
        before.setdefault((p, b["groupLabels"]["node"]), set()).update(
            a["labels"]["alertname"] for a in b["alerts"])
    after: dict[tuple[str, str], dict[str, str]] = {}
    for p, b in hook.got[n_before:]:
        key = (p, b["groupLabels"].get("node", ""))
        after.setdefault(key, {}).update(
            {a["labels"]["alertname"]: a["status"] for a in b["alerts"]})
        assert {a["labels"]["alertname"] for a in b["alerts"]
                if a["status"] == "firing"} <= before.get(key, set()), (p, b)
    assert after[("/pager", "node3")] == dict.fromkeys(page, "resolved"), after
    assert after[("/ticket", "node3")] == {"BluevelaCheckCritical": "resolved"}, after
    # node2's own check, muted while its drain alert fired, may be listed resolved with it
    assert after[("/ticket", "node2")]["BluevelaNodeDrained"] == "resolved", after
    assert set(after[("/ticket", "node2")].values()) == {"resolved"}, after
    # node2 never paged: not while drained, not when the drain ended with the repair
    assert set(after) == {("/pager", "node3"), ("/ticket", "node3"), ("/ticket", "node2")}
    print(f"\npaged {took:.1f} s after the fault, resolved {resolved:.1f} s after the repair; "
          f"test {time.monotonic() - t_start:.0f} s")
