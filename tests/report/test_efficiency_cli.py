"""`bv archive show JOB --efficiency [--json] [--html FILE]` on a real archive (ingested spool
reports) with a series file in the issue-12 layout; the HTML page in headless Chromium, and its
size at 1,000 nodes."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from bluevela.archive.ingest import ingest
from bluevela.archive.sample import sample_report
from bluevela.archive.series_layout import series_path
from bluevela.archive.spool import write_report
from bluevela.report.efficiency import analyze
from bluevela.report.efficiency_html import render_html
from tests.report.test_efficiency import T0, make_series, write_h5

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NODES = [f"gpu{i:03d}" for i in range(12)]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Job 4242 on gpu000-gpu011 with a series (gpu009 GPU 3 power-braked); job 4243 without."""
    root = tmp_path_factory.mktemp("eff")
    spool, archive = root / "spool", root / "archive"
    spool.mkdir()
    archive.mkdir()
    for job in (4242, 4243):
        for n in NODES:
            for phase in ("prolog", "epilog"):
                write_report(spool, sample_report(job, n, phase, nodelist=NODES, time=T0))
    ingest(spool, archive, now=T0 + 10)
    s = make_series(nodes=len(NODES), gpus=8)
    s.gpu["power_w"][9, 3, 3:-3] = 410
    s.gpu["clocks_event_reasons"][9, 3, 3:60] = 0x80
    series_path(archive, 4242).parent.mkdir()
    write_h5(series_path(archive, 4242), s)
    return archive


def bv(*args: str, archive: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BV_ARCHIVE_DIR": str(archive),
           "BV_SPOOL_DIR": str(archive.parent / "spool")}
    return subprocess.run([sys.executable, "-m", "bluevela", "archive", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                          check=False)


def test_terminal_summary_names_the_straggler_only(archive: Path) -> None:
    res = bv("show", "4242", "--efficiency", archive=archive)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("job 4242: 12 node(s) x 8 GPU(s), 20 min at 10 s (120 samples)")
    assert "GPU energy" in out and "from the epilogs' NVML counters (12 node(s))" in out
    assert "stragglers: 1 node(s):" in out
    assert re.search(r"gpu009\t3\tgpu009 GPU 3: power 410 W vs job median 6[89]\d W, "
                     r"HW power brake 50% of samples \(job median 0%\)", out), out
    assert "gpu008" not in out  # only outliers are listed, not every node


def test_json(archive: Path) -> None:
    res = bv("show", "4242", "--efficiency", "--json", archive=archive)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["nodes"] == 12 and d["gpus"] == 96
    assert [(s["node"], s["gpu"]) for s in d["stragglers"]] == [("gpu009", 3)]
    assert d["stragglers"][0]["metrics"]["power_w"]["value"] == 410.0
    assert len(d["per_node"]) == 12 and d["energy"]["epilog_nodes"] == 12
    assert d["thresholds"]["mad_k"] == 4.0


def test_job_without_series_is_one_line_error(archive: Path) -> None:
    res = bv("show", "4243", "--efficiency", archive=archive)
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "job 4243 has no time series in the archive" in res.stderr
    assert "Traceback" not in res.stderr
    res = bv("show", "4243", "--efficiency", "--html", "/nonexistent/dir/x.html",
             archive=archive)
    assert res.returncode != 0 and "Traceback" not in res.stderr


def test_html_write_error_is_one_line(archive: Path, tmp_path: Path) -> None:
    res = bv("show", "4242", "--efficiency", "--html", str(tmp_path / "no" / "x.html"),
             archive=archive)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "cannot write" in res.stderr and res.stderr.strip().count("\n") == 0


def _heatmap_rows(page: str) -> list[bytes]:
    """The first embedded palette PNG, decoded (filter 0 rows)."""
    m = re.search(r'href="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert m
    png = base64.b64decode(m.group(1))
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    idat = b"".join(png[i + 8:i + 8 + int.from_bytes(png[i:i + 4], "big")]
                    for i in [m.start() - 4 for m in re.finditer(b"IDAT", png)])
    raw = zlib.decompress(idat)
    return [raw[y * (w + 1) + 1:(y + 1) * (w + 1)] for y in range(h)]


def test_cpu_heatmap_shows_the_throttled_row(tmp_path: Path) -> None:
    s = make_series(nodes=3, gpus=0, samples=20, interval=2.0, ramp=2)
    s.node["cpu_busy_pct"][1, 3:] = 8
    s.node["cpu_throttled_pct"][1, 3:] = 70
    page = render_html(analyze(s))
    rows = _heatmap_rows(page)  # CPU busy heatmap: 3 rows x 20 bins
    assert len(rows) == 3 and len(rows[0]) == 20
    mean = [np.frombuffer(r[3:-2], np.uint8).mean() for r in rows]
    assert mean[1] < 0.5 * min(mean[0], mean[2]), mean
    assert "gpu001: CPU throttled" in page


def _chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_renders_the_page(archive: Path, tmp_path: Path) -> None:
    from tests.bench.test_bench_report import _png_pixels

    page = tmp_path / "eff.html"
    res = bv("show", "4242", "--efficiency", "--html", str(page), archive=archive)
    assert res.returncode == 0, res.stderr
    assert f"wrote {page}" in res.stdout
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") >= 4 and "gpu009" in dom.stdout
    shot = tmp_path / "shot.png"
    res2 = _chromium([f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()],
                     tmp_path)
    assert res2.returncode == 0 and shot.exists(), res2.stderr[-2000:]
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1400)
    assert len(set(pixels)) > 50, "screenshot looks blank"
    # the heatmap: many viridis yellow-green pixels (a busy job)
    green = sum(1 for p in pixels if p[1] > 150 and p[2] < 120)
    assert green > 0.05 * len(pixels), green
    red = sum(1 for p in pixels if p[0] > 150 and p[1] < 60 and p[2] < 80)
    assert red > 50, "the straggler is not marked in red"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_1000_node_page_is_small_and_opens(tmp_path: Path) -> None:
    s = make_series(nodes=1000, gpus=8, samples=400, seed=5)
    s.gpu["power_w"][417, 3, 3:-3] = 410
    s.gpu["clocks_event_reasons"][417, 3, 3:200] = 0x80
    eff = analyze(s)
    assert [(x.node, x.gpu) for x in eff.stragglers] == [("gpu417", 3)]
    page = tmp_path / "big.html"
    page.write_text(render_html(eff))
    size = page.stat().st_size
    assert size <= 2_000_000, size
    assert page.read_text().count("<rect") < 5000  # no per-node SVG cells
    shot = tmp_path / "big.png"
    t0 = time.perf_counter()
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()],
                    tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    assert time.perf_counter() - t0 < 60
