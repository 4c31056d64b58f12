"""The nightly HTML report at 1,000 nodes: page size, render time, and Chromium's time to open it.

The store is the synthetic 1,000-node night of tests/bench/test_bench_report.py (node1's recorded run
spread over +-5 % for every node, 500 pairs plus a second round for 2 slow nodes, judged by the
real evaluation, written by the real nightly store), 7 nights of history, in a temporary dir.
`bv bench report`'s `write_report` is timed end to end (reading 7 nights included), best of 3.

The old page (before the 1,000-node layout: an N x N heatmap and one trend panel per node and
figure) was 202 MB in 3.1 s in issue 12's measurement; unless `--quick`, it is re-measured here
by loading report.py from commit OLD_COMMIT (it writes ~210 MB to the temporary dir).
"""

from __future__ import annotations

import argparse
import importlib.util
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

OLD_COMMIT = "4e29ae9"  # the last commit with the N x N heatmap report


def _store(root: Path) -> None:
    from bluevela.bench.store import write_night
    from tests.bench.test_bench_report import BIG_NIGHTS, BIG_SLOW, big_record

    for i, night in enumerate(BIG_NIGHTS):
        last = i == len(BIG_NIGHTS) - 1
        write_night(root, big_record(night, BIG_SLOW if last else (), 1.0 + 0.01 * i))


def _time_report(write_report: object, root: Path, out: Path, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        write_report(root, None, out)  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def _old_module(tmp: Path) -> object | None:
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:bluevela/bench/report.py"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    if src.returncode != 0:
        return None
    path = tmp / "old_report.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("old_report", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def figures(args: argparse.Namespace) -> Iterator[Figure]:
    from bluevela.report.nightly_html import write_report

    with tempfile.TemporaryDirectory(prefix="bv-bench-report-") as d:
        tmp = Path(d)
        root = tmp / "nightly"
        _store(root)
        page = tmp / "new.html"
        secs = _time_report(write_report, root, page, 1 if args.quick else 3)
        size = page.stat().st_size
        old_note = "old: 202 MB in 3.1 s (issue 12)"
        if not args.quick:
            old = _old_module(tmp)
            if old is not None:
                old_page = tmp / "old.html"
                old_s = _time_report(old.write_report, root, old_page, 1)  # type: ignore[attr-defined]
                old_note = (f"old ({OLD_COMMIT}) on this machine: "
                            f"{old_page.stat().st_size / 1e6:.0f} MB in {old_s:.1f} s")
                old_page.unlink()
        yield Figure("bench.report_1000node_html_mb", size / 1e6, "MB", "<= 2",
                     f"7 nights, 502 pair measurements; {old_note}")
        yield Figure("bench.report_1000node_s", secs, "s", "<= 3.1",
                     "write_report incl. reading 7 nights, best of "
                     f"{1 if args.quick else 3}; {old_note}")
        chromium = shutil.which("chromium")
        if chromium:
            shot = tmp / "shot.png"
            t0 = time.perf_counter()
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                            f"--user-data-dir={tmp / 'profile'}", f"--screenshot={shot}",
                            "--window-size=1200,1400", page.as_uri()], capture_output=True,
                           timeout=120, check=False, env={**os.environ, "HOME": str(tmp)})
            yield Figure("bench.report_1000node_chromium_s", time.perf_counter() - t0, "s",
                         "<= 30", "headless Chromium start, load and screenshot"
                         + ("" if shot.exists() else " (no screenshot)"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    for fig in figures(parser.parse_args()):
        print(fig.line())
