"""The fleet reliability report (`bv report fleet`) over a 1,000-node, 30-day fleet.

The fleet is tests/report/test_report_fleet.py's `big_fleet`: 1,000 nodes, 30 days, 50,000 jobs
(`--quick`: 10,000) of 1-8 nodes (mostly 1) and 10 min to 3 h, every node report validated as ingest does and
written through the archive's writer (`store_reports`, in batches, so the archive has the
segments and compactions a month of ingests leaves), and one nightly record a week. Timed:

- `fleet_report` (gather + compute) in-process, best of 3;
- `bv report fleet --json` end to end (a fresh interpreter, imports included), best of 3;
- `bv report fleet --html` end to end (matplotlib import and five charts included), and the
  page's size; and headless Chromium opening it (screenshot), when Chromium is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import REPO, Figure

sys.path.insert(0, str(REPO))

SITE = """\
cluster: bench
node_classes:
  gpu: {nodes: "gpu[0001-1000]", gpus: 8, gpu_model: H100}
"""


def _best(fn: object, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    from bluevela.report.fleet import fleet_report
    from bluevela.site import load_site
    from tests.report.test_report_fleet import big_fleet

    jobs = 10_000 if args.quick else 50_000
    tmp = Path(tempfile.mkdtemp(prefix="bv-bench-fleet-"))
    try:
        archive = tmp / "archive"
        archive.mkdir()
        t0 = time.perf_counter()
        since, now = big_fleet(archive, jobs=jobs, widths=(1, 1, 1, 1, 1, 2, 4, 8),
                               max_hours=3.0)
        build = time.perf_counter() - t0
        site_path = tmp / "site.yaml"
        site_path.write_text(SITE)
        site = load_site(site_path)
        rep = fleet_report(archive, since=since, now=now, site=site)
        segs = len(json.loads((archive / "MANIFEST.json").read_text())["segments"])
        note = (f"{rep['sources']['jobs']} jobs, {rep['sources']['reports']} reports, "
                f"{segs} segments, {rep['fleet']['incidents']} incidents")
        yield Figure("fleet: synthetic archive build", build, "s", "", note)
        yield Figure("fleet: report (gather+compute)",
                     _best(lambda: fleet_report(archive, since=since, now=now, site=site), 3),
                     "s", "<= 5", "in-process, best of 3")
        env = {k: v for k, v in os.environ.items() if not k.startswith("BV_")}
        base = [sys.executable, "-m", "bluevela", "--site", str(site_path), "report", "fleet",
                "--archive-dir", str(archive), "--since", str(since), "--now", str(now)]

        def cli(*extra: str) -> None:
            subprocess.run([*base, *extra], check=True, capture_output=True, env=env)

        yield Figure("fleet: bv report fleet --json", _best(lambda: cli("--json"), 3), "s",
                     "<= 10", "fresh interpreter, best of 3")
        page = tmp / "fleet.html"
        yield Figure("fleet: bv report fleet --html", _best(lambda: cli("--html", str(page)), 2),
                     "s", "<= 10", "fresh interpreter, five matplotlib charts, best of 2")
        yield Figure("fleet: HTML page size", page.stat().st_size / 1e6, "MB", "<= 2",
                     f"{page.read_text().count('<svg')} charts")
        chromium = shutil.which("chromium")
        if chromium:
            def shot() -> None:
                subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                                f"--user-data-dir={tmp / 'profile'}",
                                f"--screenshot={tmp / 'shot.png'}", "--window-size=1200,1400",
                                page.as_uri()], check=True, capture_output=True, timeout=120,
                               env={**os.environ, "HOME": str(tmp)})
            yield Figure("fleet: Chromium opens the page", _best(shot, 2), "s", "",
                         "headless screenshot, best of 2")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
