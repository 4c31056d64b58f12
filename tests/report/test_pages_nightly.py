"""The nightly page's hover values and size (issue 28 §4).

Before the page module (03ec1b1^) every trend point and heatmap cell carried an SVG `<title>`
(its night and value; its pair and busbw) that a browser shows on hover; drawn with matplotlib
they had none, and the 1,000-node page grew 36 % (232,449 -> 317,653 bytes on the same data).
Here the titles are checked where a person meets them: headless Chromium renders the page, and
a script added to a copy of it asks, at the centre of each point, which element the pointer
is over and which `<title>` the browser would show there. The 1,000-node page's size is
checked in tests/bench/test_bench_report.py, beside the fixture that builds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bluevela.report.nightly_html import write_report
from tests.bench.test_bench_store import NIGHTS, write_sample_nights

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# the same five nights rendered by 03ec1b1^'s hand-written SVG (measured with its checkout)
SMALL_BEFORE_THE_MOVE = 29_616

HIT_TEST = """<script>
const out = [];
for (const u of document.querySelectorAll("svg use, svg [id^=cell-], svg [id^=value-]")) {
  const mine = Array.from(u.children).find(c => c.tagName === "title");
  if (!mine) continue;
  const r = u.getBoundingClientRect();
  let el = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
  let shown = null;
  for (; el && shown === null; el = el.parentElement) {
    const t = Array.from(el.children).find(c => c.tagName === "title");
    if (t) shown = t.textContent;
  }
  out.push([mine.textContent, shown]);
}
const pre = document.createElement("pre");
pre.id = "hits";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


@pytest.fixture()
def nightly_root(tmp_path: Path) -> Path:
    return write_sample_nights(tmp_path / "nightly")


def _trends(text: str) -> list[str]:
    return re.findall(r'<svg [^>]*class="trend".*?</svg>', text, re.S)


def test_every_trend_point_and_heatmap_cell_has_its_value_as_a_title(
        nightly_root: Path, tmp_path: Path) -> None:
    text = write_report(nightly_root, None, tmp_path / "r.html").read_text()
    trends = _trends(text)
    assert len(trends) == 18  # 3 nodes x 6 figures
    for svg in trends:
        label = re.search(r'aria-label="([^"]*)"', svg)
        assert label is not None
        series = svg[svg.index('id="series"'):]
        titles = re.findall(r"<use [^>]*><title>([^<]*)</title></use>", series)
        assert [t.split(":")[0] for t in titles[:5]] == [*NIGHTS, "2026-11-20"], label[1]
        unit = label[1].rpartition("(")[2].rstrip(")")
        assert all(re.fullmatch(r"2026-11-\d\d: [0-9.e+-]+ " + re.escape(unit), t)
                   for t in titles), titles
    # node3's slow pair night: its red point says its value too
    mpi = next(s for s in trends if 'aria-label="node3 mpi_bw_gbs' in s)
    assert re.search(r'id="out-of-bounds".*<title>2026-11-20: [0-9.]+ GB/s</title>', mpi, re.S)
    cells = re.findall(r'<g id="cell-(\d)-(\d)">.*?</g>', text, re.S)
    assert len(cells) == 9
    assert "<title>node1 – node3: 0.00481 GB/s</title>" in text
    assert text.count("GB/s</title>") >= 6  # every measured pair, both ways


def test_the_small_page_stays_near_its_size_before_the_move(
        nightly_root: Path, tmp_path: Path) -> None:
    size = write_report(nightly_root, None, tmp_path / "r.html").stat().st_size
    # 9058adc: 77,551 bytes (2.6x); the values on hover are back, in no more than that size
    # (a chart's marker said once per page, no clip path where nothing can overflow)
    assert size <= SMALL_BEFORE_THE_MOVE, size


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_shows_each_points_value_where_the_pointer_is(
        nightly_root: Path, tmp_path: Path) -> None:
    page = write_report(nightly_root, None, tmp_path / "r.html")
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", HIT_TEST + "</body>"))
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,4000", "--dump-dom", probe.as_uri()]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<pre id="hits">(.*?)</pre>', dom.stdout, re.S)
    assert m is not None, dom.stdout[-2000:]
    hits = json.loads(m.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    assert len(hits) >= 18 * 5 + 2 * 6, len(hits)  # the points; the cells and their numbers
    assert all(mine == shown for mine, shown in hits), [h for h in hits if h[0] != h[1]][:5]
