"""The nightly HTML report: content, escaping, and real rendering in headless Chromium.

The page is made from recorded figures (tests/data/bench/) over five nights, the last with a
slow node3. Chromium dumps the DOM after rendering (the SVG plots are there) and takes a
screenshot, decoded here with zlib alone (no imaging library), that must not be blank.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from bluevela.bench.report import render_html, write_report
from bluevela.bench.store import write_night
from bluevela.errors import ArchiveError
from tests.test_bench_store import sample_record

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NIGHTS = ("2026-11-16", "2026-11-17", "2026-11-18", "2026-11-19")


@pytest.fixture()
def nightly_root(tmp_path: Path) -> Path:
    root = tmp_path / "nightly"
    for i, night in enumerate(NIGHTS):
        write_night(root, sample_record(night, slow=None, scale=1.0 + 0.05 * i))
    write_night(root, sample_record("2026-11-20", slow="node3"))
    return root


def test_page_has_plots_failures_and_drained_nodes(nightly_root: Path, tmp_path: Path) -> None:
    out = write_report(nightly_root, None, tmp_path / "r.html")
    text = out.read_text()
    assert "Nightly acceptance 2026-11-20" in text and "CRITICAL" in text
    assert text.count('class="trend"') >= 3 * 5  # 3 nodes x (gemm, hbm, allreduce, pair, mpi)
    assert 'class="heatmap"' in text and text.count('class="cell"') == 9
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
    assert html.count("<polyline") >= 15 and html.count("<circle") >= 15 * 5
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
