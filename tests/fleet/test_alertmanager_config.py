"""The shipped Alertmanager routing (prolog_epilog/prometheus/alertmanager.example.yml) without
a cluster: `amtool check-config`, `amtool config routes test` for every alert of
bluevela.rules.yml (critical -> bluevela-pager, warning -> bluevela-ticket), the inhibit rule
against the rules' real names, the dev config slurm/devcluster derives from it, and Debian's
Alertmanager itself fed alerts through its API: a node's alerts in one notification per
receiver, a drained node's own alerts inhibited, and the resolve.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "prolog_epilog" / "prometheus"
EXAMPLE = PROM_DIR / "alertmanager.example.yml"
DEVCLUSTER = REPO / "slurm" / "devcluster"
AMTOOL = shutil.which("amtool")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool not installed "
                                  "(prometheus-alertmanager; slurm/install-deps)")
MAX_BODY = 1 << 20


def alert_rules() -> dict[str, tuple[str, dict[str, str]]]:
    """{alert name: (its rule group, its labels)} from bluevela.rules.yml."""
    doc = yaml.safe_load((PROM_DIR / "bluevela.rules.yml").read_text())
    return {r["alert"]: (g["name"], r.get("labels", {}))
            for g in doc["groups"] for r in g["rules"] if "alert" in r}


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AMTOOL or "amtool", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def devcluster_module() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("devcluster_am", str(DEVCLUSTER))
    spec = importlib.util.spec_from_loader("devcluster_am", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["devcluster_am"] = mod  # its dataclasses look their module up
    loader.exec_module(mod)
    return mod


@needs_amtool
def test_shipped_config_checks_and_a_broken_one_does_not(tmp_path: Path) -> None:
    p = amtool("check-config", str(EXAMPLE))
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr
    assert "1 inhibit rules" in p.stdout and "2 receivers" in p.stdout, p.stdout
    broken = tmp_path / "broken.yml"  # a route to a receiver that is not defined
    broken.write_text(EXAMPLE.read_text().replace("receiver: bluevela-pager",
                                                  "receiver: bluevela-pagr"))
    p = amtool("check-config", str(broken))
    assert p.returncode != 0 and "bluevela-pagr" in p.stdout + p.stderr, p.stdout + p.stderr


@needs_amtool
def test_every_alert_routes_by_its_severity() -> None:
    rules = alert_rules()
    assert len(rules) >= 20
    for name, (_, labels) in sorted(rules.items()):
        want = {"critical": "bluevela-pager", "warning": "bluevela-ticket"}[labels["severity"]]
        p = amtool("config", "routes", "test", f"--config.file={EXAMPLE}",
                   f"--verify.receivers={want}", f"alertname={name}", "node=gpu001",
                   *(f"{k}={v}" for k, v in sorted(labels.items())))
        assert p.returncode == 0 and p.stdout.strip() == want, (name, p.stdout, p.stderr)
    # ... and the check itself can fail: a warning is not paged
    p = amtool("config", "routes", "test", f"--config.file={EXAMPLE}",
               "--verify.receivers=bluevela-pager", "alertname=BluevelaNodeDrained",
               "severity=warning", "node=gpu001")
    assert p.returncode != 0 and "bluevela-ticket" in p.stdout, p.stdout
    # anything without a severity still reaches a person: a ticket
    p = amtool("config", "routes", "test", f"--config.file={EXAMPLE}", "alertname=Other")
    assert p.stdout.strip() == "bluevela-ticket", p.stdout


def test_inhibit_rule_covers_exactly_the_node_alerts_by_bvs_drains() -> None:
    """The rule names alerts by regex: every alert of the rules' node group is a target (one
    added there later included), no fleet alert is, and only bv's drains are sources."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    assert cfg["route"]["group_by"] == ["node"]
    (rule,) = cfg["inhibit_rules"]
    assert rule["equal"] == ["node"]

    def regex(matchers: list[str]) -> re.Pattern[str]:
        (m,) = matchers
        got = re.fullmatch(r'alertname=~"(.+)"', m)
        assert got, m
        return re.compile(got.group(1))

    source, target = regex(rule["source_matchers"]), regex(rule["target_matchers"])
    rules = alert_rules()
    node_group = {n for n, (g, _) in rules.items() if g == "bluevela-node"}
    assert {n for n in rules if target.fullmatch(n)} == node_group
    assert {n for n in rules if source.fullmatch(n)} == {"BluevelaNodeDrained",
                                                          "BluevelaNightlyRegression"}
    for name in ("BluevelaCriticalNodeNotDrained", "BluevelaFleetBreakerFull"):
        assert not target.fullmatch(name)  # a node bv could not drain still pages


@needs_amtool
def test_dev_config_is_the_example_pointed_at_the_webhook(tmp_path: Path) -> None:
    dc = devcluster_module()
    text = dc.alertmanager_config(EXAMPLE.read_text(), "http://127.0.0.1:8999/hook")
    cfg = yaml.safe_load(text)
    shipped = yaml.safe_load(EXAMPLE.read_text())
    urls = {r["name"]: r["webhook_configs"][0]["url"] for r in cfg["receivers"]}
    assert urls == {"bluevela-pager": "http://127.0.0.1:8999/hook/pager",
                    "bluevela-ticket": "http://127.0.0.1:8999/hook/ticket"}
    assert cfg["inhibit_rules"] == shipped["inhibit_rules"]
    assert cfg["route"]["routes"] == shipped["route"]["routes"]
    assert cfg["route"]["group_wait"] == "3s" and cfg["global"]["resolve_timeout"] == "10s"
    (tmp_path / "am.yml").write_text(text)
    assert amtool("check-config", str(tmp_path / "am.yml")).returncode == 0
    for bad in ("http://127.0.0.1:1/x'\n  - url: 'http://evil", "https://pager.example",
                "http://10.0.0.1:80/"):
        with pytest.raises(dc.DevClusterError, match="expected http://127.0.0.1:PORT"):
            dc.alertmanager_config(EXAMPLE.read_text(), bad)


# --------------------------------------------------------------------------------------------
# Debian's Alertmanager with the dev config, fed alerts as Prometheus sends them


class Webhook:
    """Alertmanager's webhook receiver in this process: every POST kept as (path, payload)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any]]] = []
        lock = threading.Lock()
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 < size <= MAX_BODY:
                    self.send_response(413)
                    self.end_headers()
                    return
                body = json.loads(self.rfile.read(size))
                with lock:
                    got.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def notes(self, path: str) -> list[tuple[str, str, set[str]]]:
        """(status, the group's node, alert names) of each notification to `path`."""
        return [(b["status"], b["groupLabels"].get("node", ""),
                 {a["labels"]["alertname"] for a in b["alerts"]})
                for p, b in list(self.got) if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def alertmanager() -> Iterator[tuple[str, Webhook]]:
    if ALERTMANAGER is None:
        pytest.skip("prometheus-alertmanager not installed (slurm/install-deps)")
    hook = Webhook()
    base = Path(tempfile.mkdtemp(prefix="bv-am-"))
    cfg = base / "alertmanager.yml"
    cfg.write_text(devcluster_module().alertmanager_config(EXAMPLE.read_text(), hook.url))
    url = f"http://127.0.0.1:{_free_port()}"
    with open(base / "log", "wb") as log:
        proc = subprocess.Popen([ALERTMANAGER, f"--config.file={cfg}",
                                 f"--storage.path={base / 'data'}",
                                 f"--web.listen-address={url.removeprefix('http://')}",
                                 "--cluster.listen-address="],
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (base / "log").read_text()
            time.sleep(0.1)
        yield url, hook
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        hook.close()
        shutil.rmtree(base, ignore_errors=True)


def post_alerts(url: str, alerts: list[tuple[str, str, str]], *, resolved: bool = False) -> None:
    """(alertname, severity, node) posted as Prometheus posts them: startsAt when the alert
    turned firing (an older one skips group_wait: Alertmanager flushes a group at once when
    its first alert's startsAt + group_wait has passed), endsAt a few evaluations ahead or,
    resolved, now."""
    now = datetime.now(UTC)
    ends = now if resolved else now + timedelta(minutes=4)
    body = [{"labels": {"alertname": n, "severity": s, "node": node},
             "annotations": {"runbook_url": f"docs/monitoring.md#{n.lower()}"},
             "startsAt": (now - timedelta(seconds=1)).isoformat(),
             "endsAt": ends.isoformat()} for n, s, node in alerts]
    req = urllib.request.Request(f"{url}/api/v2/alerts", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _wait(what: str, probe: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_alertmanager_groups_by_node_inhibits_a_drained_node_and_resolves(
        alertmanager: tuple[str, Webhook]) -> None:
    url, hook = alertmanager
    node3 = [("BluevelaGpuMissing", "critical", "node3"),
             ("BluevelaGpuFallenOffBus", "critical", "node3"),
             ("BluevelaCheckCritical", "warning", "node3")]
    node2 = [("BluevelaIbPortDown", "critical", "node2"),
             ("BluevelaCheckCritical", "warning", "node2"),
             ("BluevelaNodeDrained", "warning", "node2")]
    post_alerts(url, node2 + node3)
    _wait("notifications", lambda: len(hook.got) >= 3, 20)
    time.sleep(5)  # two more group intervals: nothing else comes
    assert hook.notes("/pager") == [
        ("firing", "node3", {"BluevelaGpuMissing", "BluevelaGpuFallenOffBus"})]
    assert sorted(hook.notes("/ticket"), key=str) == sorted(
        [("firing", "node3", {"BluevelaCheckCritical"}),
         ("firing", "node2", {"BluevelaNodeDrained"})], key=str)
    for _, body in hook.got:
        for a in body["alerts"]:
            assert a["annotations"]["runbook_url"].startswith("docs/monitoring.md#")
    with urllib.request.urlopen(f"{url}/api/v2/alerts", timeout=5) as r:
        states = {(a["labels"]["alertname"], a["labels"]["node"]): a["status"]
                  for a in json.load(r)}
    assert states[("BluevelaIbPortDown", "node2")]["state"] == "suppressed"
    assert states[("BluevelaIbPortDown", "node2")]["inhibitedBy"]

    post_alerts(url, node3, resolved=True)
    _wait("resolve", lambda: len(hook.notes("/pager")) >= 2, 20)
    assert hook.notes("/pager")[1] == (
        "resolved", "node3", {"BluevelaGpuMissing", "BluevelaGpuFallenOffBus"})
    # the drain ends (bv health resume) before the port is fixed: node2's page goes out now
    post_alerts(url, [("BluevelaNodeDrained", "warning", "node2")], resolved=True)
    _wait("node2 paged", lambda: len(hook.notes("/pager")) >= 3, 20)
    assert hook.notes("/pager")[2] == ("firing", "node2", {"BluevelaIbPortDown"})


def test_bv_install_lays_out_the_example() -> None:
    """`bv install` puts the file a site copies next to the rules it routes."""
    from bluevela.deploy import layout

    items = {i.path: i for i in layout.plan(Path("/nonexistent-venv"), Path("/"))}
    item = items["/opt/bluevela/prolog_epilog/prometheus/alertmanager.example.yml"]
    assert item.mode == 0o644 and item.content == EXAMPLE.read_bytes()
