"""The fleet file through a real Prometheus scrape with `label_value_length_limit` set.

Prometheus fails the WHOLE scrape of a target when one label value is longer than the limit
(scrape config `label_value_length_limit`, counted in bytes): one operator's long drain reason
used to take every node's drained, busy and breaker series out of the fleet view. The reason
label is now cut to `REASON_MAX_BYTES` (128); this test serves a rendered fleet file over HTTP to
Debian's prometheus with the limit at exactly that, and reads `up` and the series back.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bluevela.fleet_metrics import render_fleet
from bluevela.site import load_site
from bluevela.slurm.client import NodeInfo

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed "
                                "(slurm/install-deps installs Debian's prometheus)")

# 600 bytes of an operator's reason, multi-byte characters and a control character included
LIMIT = 128  # bluevela.fleet_metrics.REASON_MAX_BYTES, the limit docs/monitoring.md names
LONG = "maint: DIMM B3 swap, ticket 4711 \u2014 w\u00e4rme \x07 " + "x" * 560


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, dict[str, bytes]]]:
    """An HTTP server on 127.0.0.1 serving `files[path]` as Prometheus text."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = files.get(self.path, b"")
            self.send_response(200 if self.path in files else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            del args

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), files
    finally:
        server.shutdown()
        server.server_close()


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_a_long_reason_does_not_fail_the_scrape(
        tmp_path: Path, served: tuple[int, dict[str, bytes]]) -> None:
    site = load_site(REPO / "site.yaml")
    nodes = [NodeInfo("node1", "IDLE+DRAIN", LONG, ("debug",)),
             NodeInfo("node2", "ALLOCATED", "", ("debug",)),
             NodeInfo("node3", "IDLE+DRAIN", "bv: ib: mlx5_3/1 state DOWN", ("debug",))]
    http_port, files = served
    files["/fleet"] = render_fleet(site, nodes).encode()
    prom_port = _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: bluevela-fleet\n"
        "    metrics_path: /fleet\n"
        f"    label_value_length_limit: {LIMIT}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{http_port}']}}]\n")
    proc = subprocess.Popen([PROMETHEUS or "prometheus", f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        up: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                up = _query(prom_port, 'up{job="bluevela-fleet"}')
            except OSError:
                up = []
            if up:
                break
            time.sleep(0.3)
        assert up, "prometheus never scraped the fleet file"
        assert up[0]["value"][1] == "1", "the scrape failed: a label longer than the limit"
        drained = {r["metric"]["node"]: r["metric"]["reason"]
                   for r in _query(prom_port, "bluevela_slurm_node_drained")}
        assert drained["node3"] == "bv: ib: mlx5_3/1 state DOWN"  # short reasons unchanged
        cut = drained["node1"]
        assert len(cut.encode()) <= LIMIT and cut.endswith("\u2026")
        assert cut.startswith("maint: DIMM B3 swap, ticket 4711 \u2014 w\u00e4rme   x")
        assert len(_query(prom_port, "bluevela_slurm_node_busy")) == 3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
