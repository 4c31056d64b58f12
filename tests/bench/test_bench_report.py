"""The nightly HTML report: content, escaping, and real rendering in headless Chromium.

The page is made from recorded figures (tests/data/bench/) over five nights, the last with a
slow node3. Chromium dumps the DOM after rendering (the SVG plots are there) and takes a
screenshot, decoded here with zlib alone (no imaging library), that must not be blank.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from bluevela.bench import pairing
from bluevela.bench.catalog import get
from bluevela.bench.evaluate import evaluate
from bluevela.bench.nightly import NightlyOutcome, SubjectResult, to_record
from bluevela.bench.result import Facts
from bluevela.bench.runner import facts_from_document
from bluevela.bench.store import NightRecord, write_night
from bluevela.errors import ArchiveError
from bluevela.fleet.nodestate import DrainOutcome
from bluevela.report.nightly_html import render_html, write_report
from tests.bench.test_bench_store import (
    BENCH,
    _pair_facts,
    _site,
    sample_record,
    write_sample_nights,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture()
def nightly_root(tmp_path: Path) -> Path:
    return write_sample_nights(tmp_path / "nightly")


def test_page_has_plots_failures_and_drained_nodes(nightly_root: Path, tmp_path: Path) -> None:
    out = write_report(nightly_root, None, tmp_path / "r.html")
    text = out.read_text()
    assert "Nightly acceptance 2026-11-20" in text and "CRITICAL" in text
    assert text.count('class="trend"') >= 3 * 5  # 3 nodes x (gemm, hbm, allreduce, pair, mpi)
    assert 'class="heatmap"' in text and text.count('id="cell-') == 9
    assert 'id="drained"' in text and "node3" in text and "pairwise bandwidth slow" in text
    assert "floor 0.02" in text  # the pair floor drawn on the trend
    assert "<script" not in text and "http://" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained


def test_text_from_the_record_is_escaped(nightly_root: Path) -> None:
    rec = sample_record("2026-11-21", slow="node3")
    rec.nodes[2] = type(rec.nodes[2])("node3", "cpu", 2, True, True, "<script>alert(1)</script>")
    page = render_html(rec, [])
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_unknown_night_is_an_archive_error(nightly_root: Path, tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="no nightly record for 2026-01-01"):
        write_report(nightly_root, "2026-01-01", tmp_path / "x.html")
    with pytest.raises(ArchiveError, match="no nightly record yet"):
        write_report(tmp_path / "empty", None, tmp_path / "x.html")


def _chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "HOME": str(tmp)})


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG into rows of pixel bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 4 if ctype == 6 else 3
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_renders_the_plots(nightly_root: Path, tmp_path: Path) -> None:
    page = write_report(nightly_root, "2026-11-20", tmp_path / "report.html")
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<svg") >= 16
    # matplotlib: each trend's line is a group `series`, each night's point a marker `<use>`
    assert html.count('id="series"') >= 15 and html.count("<use") >= 15 * 5
    assert 'class="heatmap"' in html and "node3" in html

    shot = tmp_path / "shot.png"
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()], tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1400)
    colors = set(pixels)
    non_white = sum(1 for p in pixels if p != b"\xff\xff\xff")
    assert len(colors) > 50, "screenshot looks blank"
    assert non_white > 0.05 * len(pixels)
    red = sum(1 for p in pixels if p[0] > 180 and p[1] < 140 and p[2] < 140)
    assert red > 100  # the slow node's cells, points and floor lines are drawn in red


# -- a 1,000-node night ---------------------------------------------------------------------

BIG_NODES = 1000
BIG_NIGHTS = tuple(f"2026-11-{d:02d}" for d in range(14, 21))  # 7 nights, the last one judged
BIG_SLOW = ("gpu0613", "gpu0877")  # tonight's culprits, each slow with both of its partners


def big_outcome(night: str, slow: tuple[str, ...] = (), scale: float = 1.0) -> NightlyOutcome:
    """A 1,000-node night the way the nightly builds it: node1's recorded run stands in for
    every node, spread over +-5 % (so the histograms have a shape), judged by the real
    evaluation; 500 pairs (each node once), plus a second round pairing each slow node with
    another partner: the healthy recorded pair figures, the throttled ones for a slow node."""
    site = _site()
    th = site.node_class(name="cpu").bench
    nodes = [f"gpu{i:04d}" for i in range(1, BIG_NODES + 1)]
    node_facts = facts_from_document(json.loads((BENCH / "cpu_node1_run.json").read_text()))
    out = NightlyOutcome(night, nodes, {}, dict.fromkeys(nodes, "cpu"),
                         started_utc=f"{night}T01:00:00Z", finished_utc=f"{night}T03:10:00Z")
    for i, node in enumerate(nodes):
        k = scale * (0.95 + 0.1 * ((i * 37) % 101) / 100)
        facts = [Facts(f.measurement, tuple(type(x)(x.name, x.value * k, x.unit, x.device, x.size)
                                            for x in f.figures), f.applicable, f.ran, f.note,
                       (node,)) for f in node_facts]
        out.singles[node] = SubjectResult((node,), [evaluate(get(f.measurement), f, th)
                                                    for f in facts], 10_000 + i)
    healthy = [[evaluate(get(f.measurement), f, th) for f in _pair_facts(False)]]
    throttled = [evaluate(get(f.measurement), f, th) for f in _pair_facts(True)]
    plan = [(nodes[i], nodes[i + 1], 1) for i in range(0, len(nodes), 2)]
    for s in slow:  # round 2: the slow node with the first node of the next pair
        j = nodes.index(s)
        plan.append((s, nodes[(j // 2 * 2 + 2) % len(nodes)], 2))
    obs = []
    for n, (a, b, rnd) in enumerate(plan):
        bad = a in slow or b in slow
        out.pairs.append(SubjectResult((a, b) if a < b else (b, a),
                                       throttled if bad else healthy[0], 20_000 + n, rnd))
        obs.append(pairing.Observation((a, b) if a < b else (b, a), bad))
    out.verdict = pairing.verdict(obs)
    for node, partners in out.verdict.culprits.items():
        out.culprits[node] = f"nightly {night}: pairwise bandwidth slow with {', '.join(partners)}"
        out.drains.append(DrainOutcome(node, True, "bv: " + out.culprits[node]))
    return out


def big_record(night: str, slow: tuple[str, ...] = (), scale: float = 1.0) -> NightRecord:
    return to_record(big_outcome(night, slow, scale), _site())


@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "nightly"
    for i, night in enumerate(BIG_NIGHTS):
        last = i == len(BIG_NIGHTS) - 1
        write_night(root, big_record(night, BIG_SLOW if last else (), 1.0 + 0.01 * i))
    return root


def test_a_1000_node_night_is_small_and_failures_come_first(big_root: Path,
                                                            tmp_path: Path) -> None:
    """Was 202 MB (a 1,000 x 1,000 heatmap of SVG cells and 3,000 trend panels)."""
    t0 = time.perf_counter()
    page = write_report(big_root, None, tmp_path / "big.html")
    elapsed = time.perf_counter() - t0
    size = page.stat().st_size
    text = page.read_text()
    assert size <= 2 * 1024 * 1024, f"{size / 1e6:.1f} MB"
    # no bigger than before the page module: 232,449 bytes at 03ec1b1^ on this data (issue 28
    # §4; 9058adc: 317,653, without the hover values)
    assert size <= 232_449, size
    assert elapsed < 10, elapsed
    assert 'id="cell-' not in text  # no N x N matrix
    assert text.count('class="trend"') < 300  # not one panel per node and figure
    assert text.count('class="hist"') >= 5  # the distributions, pairs included
    # the failing nodes and their slow pairs come before any healthy node is named
    first_healthy = text.index("gpu0001")
    for node in BIG_SLOW:
        assert text.index(node) < first_healthy, node
    table = text[text.index('id="pairs"'):]
    assert table.index("gpu0613") < table.index("among the slowest")
    # every node still has its row, failing first
    rows = text[text.index('id="node-rows"'):]
    assert rows.count("\ngpu") == BIG_NODES
    assert rows.index("gpu0613") < rows.index("gpu0001")


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_opens_the_1000_node_page(big_root: Path, tmp_path: Path) -> None:
    page = write_report(big_root, None, tmp_path / "big.html")
    shot = tmp_path / "big.png"
    t0 = time.perf_counter()
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()], tmp_path)
    elapsed = time.perf_counter() - t0
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    assert elapsed < 30, elapsed
    if os.environ.get("BV_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["BV_KEEP_SCREENSHOT"])
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1400)
    assert len(set(pixels)) > 50, "screenshot looks blank"
    assert sum(1 for p in pixels if p != b"\xff\xff\xff") > 0.05 * len(pixels)
    red = sum(1 for p in pixels if p[0] > 180 and p[1] < 140 and p[2] < 140)
    assert red > 100  # the failing nodes are in red at the top
