"""The efficiency page's axes read at a glance, and the goodput time line's queue row (issue 28
§4).

A flat job (GPU utilisation 41 % +- 0.1, CPU busy exactly 35 %, CPU never throttled) drew its
distributions on axes from 40.98 % to 41.01 %, 34 % to 36 % and -1 % to 1 %, and coloured the
0.2-point noise of its utilisation from purple to yellow: here each axis and colour range is at
least 10 points wide around the values, the throttled share starts at 0, and equal values say
so. The goodput time line named the wait before the first start "attempt 0"; it is "queued".
The page is opened in headless Chromium and its histograms' axis labels and its time line's
row labels read from the DOM it rendered.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bluevela.report import goodput as G
from bluevela.report.efficiency import analyze
from bluevela.report.efficiency_html import render_html
from tests.goodput.test_goodput_ledger import T, _launch, _rec
from tests.report.test_efficiency import make_series

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _flat_job(ledger: dict[str, Any] | None = None) -> str:
    s = make_series(nodes=4, gpus=2, samples=60)
    noise = np.sign(np.random.default_rng(2).normal(size=s.gpu["util_pct"].shape))
    s.gpu["util_pct"][:] = 41.0 + 0.1 * noise
    s.node["cpu_busy_pct"][:] = 35.0
    s.node["cpu_throttled_pct"][:] = 0.0
    return render_html(analyze(s), ledger)


def _requeued_ledger() -> dict[str, Any]:
    """A job queued 5 s, lost node2 in attempt 1, requeued, waited again, ended in attempt 2."""
    first = _rec(0, submit=0, start=5, requeue=32, launches=[
        _launch(1, 1, 6, 10, [(4, 20, 22)], "lost", gone=31, failed=30, detected=30.5,
                nodes=["node2"])])
    second = _rec(1, submit=31, start=55, launches=[
        _launch(1, 2, 57, 65, [(8, 75, 76)], "ok", gone=90)])
    return G.build_ledger(9, [second, first]).to_dict()


def _timeline_labels(page: str) -> list[str]:
    line = re.search(r'<svg [^>]*class="timeline".*?</svg>', page, re.S)
    assert line is not None
    return re.findall(r">(queued|attempt \d+)</text>", line.group(0))


def _hist(page: str, title: str) -> tuple[list[float], str]:
    """The x-axis tick values of the histogram `title` and its right-hand title."""
    svg = next(m for m in re.findall(r'<svg [^>]*class="hist".*?</svg>', page, re.S)
               if f">{title}</text>" in m)
    ticks = [float(x) for x in re.findall(r">(-?[0-9.]+)(?:%| W)</text>", svg)]
    right = re.search(r">([0-9]+ values, [^<]*)</text>", svg)
    assert right is not None
    return ticks, right.group(1)


def test_a_flat_jobs_distributions_are_drawn_as_flat(tmp_path: Path) -> None:
    page = _flat_job()
    ticks, right = _hist(page, "GPU utilisation per GPU")
    assert max(ticks) - min(ticks) >= 10, ticks  # 9058adc: 40.98 % to 41.01 %
    assert min(ticks) < 41 < max(ticks)
    assert "all equal" not in right and "41.0–41.0%" in right
    ticks, right = _hist(page, "CPU busy per node")
    assert max(ticks) - min(ticks) >= 10 and min(ticks) < 35 < max(ticks), ticks
    assert "4 values, all equal: 35.0%" in right  # 9058adc: "4 values, log-scaled counts"
    ticks, right = _hist(page, "CPU throttled per node (share of time)")
    assert min(ticks) == 0 and max(ticks) >= 10, ticks  # 9058adc: -1.0 % to 1.0 %
    assert "all equal: 0.0%" in right
    # the utilisation heatmap's colours span 10 points, not the noise's 0.2
    note = re.search(r"GPU utilisation per node over time</h2><p class='note'>[^<]*colours "
                     r"(\d+)–(\d+)%", page)
    assert note is not None and int(note[2]) - int(note[1]) >= 10, note


def test_a_real_spread_keeps_its_shape() -> None:
    """A busy job's utilisation (94-96 %) is drawn on 10 points, its power on its own range
    with the braked GPU's 410 W on the axis."""
    s = make_series(nodes=12, gpus=8)
    s.gpu["power_w"][9, 3, 3:-3] = 410
    s.gpu["clocks_event_reasons"][9, 3, 3:60] = 0x80
    page = render_html(analyze(s))
    ticks, _ = _hist(page, "GPU utilisation per GPU")
    assert 90 <= min(ticks) and max(ticks) <= 100 and max(ticks) - min(ticks) == 10, ticks
    ticks, right = _hist(page, "GPU power per GPU")
    assert min(ticks) <= 410 and 690 <= max(ticks) <= 750, ticks
    assert "gpu009 GPU 3 410 W" in page


def test_the_goodput_time_line_names_the_queue_wait() -> None:
    led = _requeued_ledger()
    assert led["pieces"][0]["attempt"] == 0 and led["pieces"][0]["phase"] == "queue_hold"
    assert led["start_unix_s"] == T
    s = make_series(nodes=2, gpus=2, samples=10)
    labels = _timeline_labels(render_html(analyze(s), led))
    assert labels == ["queued", "attempt 1", "attempt 2"], labels  # 9058adc: "attempt 0"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_renders_the_flat_jobs_axes(tmp_path: Path) -> None:
    page = tmp_path / "flat.html"
    page.write_text(_flat_job(_requeued_ledger()))
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=120, check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    ticks, right = _hist(dom.stdout, "CPU throttled per node (share of time)")
    assert min(ticks) == 0 and max(ticks) >= 10 and "all equal" in right
    # the goodput time line as rendered: the wait before the first start is "queued"
    labels = _timeline_labels(dom.stdout)
    assert labels == ["queued", "attempt 1", "attempt 2"], labels
    shot = tmp_path / "flat.png"
    res = subprocess.run([*argv, f"--screenshot={shot}", "--window-size=1200,1800",
                          page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0 and shot.stat().st_size > 10_000, res.stderr[-2000:]
    if os.environ.get("BV_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["BV_KEEP_SCREENSHOT"])
