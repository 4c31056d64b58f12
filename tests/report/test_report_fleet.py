"""The fleet reliability report (`bv report fleet`): exact figures on a small synthetic fleet,
the JSON shape, errors, the HTML page in headless Chromium, and readability at 1,000 nodes.

The small fleet goes through the real path: node reports written by the spool writer
(`spool.write_report`), archived by `ingest`, and a nightly record written by the nightly store
(`bench.store.write_night`). Its ten jobs and one night are laid out so that every figure can
be computed by hand (the comments under FLEET_* give the arithmetic).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bluevela.archive.ingest import ingest, store_reports
from bluevela.archive.reports import validate_report
from bluevela.archive.sample import sample_report
from bluevela.archive.spool import SpoolEntry, report_name, write_report
from bluevela.bench.store import NightRecord, NodeRow, ResultRow, nightly_dir, write_night
from bluevela.report.fleet import compute, fleet_report
from bluevela.report.fleet_facts import NodeClassInfo
from bluevela.report.fleet_gather import gather
from tests.bench.test_bench_report import CHROMIUM, _chromium, _png_pixels

H = 3600.0
T0 = 1793491200.0  # 2026-11-01T00:00:00Z
NOW = T0 + 240 * H  # a ten-day window
CLASSES = {"a": NodeClassInfo(frozenset({"a1", "a2", "a3"}), 8),
           "b": NodeClassInfo(frozenset({"b1", "b2"}), 4)}
SITE_YAML = """\
cluster: fleet-test
node_classes:
  a: {nodes: "a[1-3]", gpus: 8, gpu_model: H100}
  b: {nodes: "b[1-2]", gpus: 4, gpu_model: A100}
"""


def _rep(job: int, node: str, phase: str, t_h: float, nodelist: str, *, status: int = 0,
         exit_code: int = 0, signal: int = 0, drained: bool = False,
         reason: str | None = None) -> dict[str, Any]:
    r = sample_report(job, node, phase, nodelist=nodelist, time=T0 + t_h * H,
                      exit_code=exit_code, status_code=status)
    r.update(drained=drained, drain_reason=reason)
    if phase == "epilog":
        r["exit_signal"] = signal
    return r


def fleet_reports() -> list[dict[str, Any]]:
    """Ten jobs on a1-a3 (8 GPUs) and b1-b2 (4 GPUs), times in hours after T0."""
    return [
        # 101 a1,a2 1h-3h exit 0: completed, 2 x 8 x 2 = 32 GPU h
        _rep(101, "a1", "prolog", 1, "a[1-2]"), _rep(101, "a2", "prolog", 1, "a[1-2]"),
        _rep(101, "a1", "epilog", 3, "a[1-2]"), _rep(101, "a2", "epilog", 3, "a[1-2]"),
        # 102 a1 10h-12h, epilog CRITICAL gpu, drained, exit 1: lost to a node, 16 GPU h
        _rep(102, "a1", "prolog", 10, "a1"),
        _rep(102, "a1", "epilog", 12, "a1", status=2, exit_code=1, drained=True,
             reason="bv: gpu: XID 79 on GPU 3"),
        # 103 a1 20h-21h: a1 back in service after 8 h; completed, 8 GPU h
        _rep(103, "a1", "prolog", 20, "a1"), _rep(103, "a1", "epilog", 21, "a1"),
        # 104: prolog CRITICAL ib on b1 at 30h (drained, Slurm requeues), runs on b2
        # 30.5h-32.5h: completed, start 30h (earliest prolog) -> 4 x 2.5 = 10 GPU h;
        # b1 never comes back: out 240 - 30 = 210 h
        _rep(104, "b1", "prolog", 30, "b1", status=2, drained=True,
             reason="bv: ib: mlx5_0/1 state DOWN"),
        _rep(104, "b2", "prolog", 30.5, "b2"), _rep(104, "b2", "epilog", 32.5, "b2"),
        # 105 a2,a3 40h-50h, a3's epilog never comes (node lost at 50h), SIGKILL:
        # lost to a node, 2 x 8 x 10 = 160 GPU h
        _rep(105, "a2", "prolog", 40, "a[2-3]"), _rep(105, "a3", "prolog", 40, "a[2-3]"),
        _rep(105, "a2", "epilog", 50, "a[2-3]", signal=9),
        # 106 a3 60h-70h exit 2: a3 back after 10 h; failed (application), 80 GPU h
        _rep(106, "a3", "prolog", 60, "a3"), _rep(106, "a3", "epilog", 70, "a3", exit_code=2),
        # 107 b2 80h-90h SIGTERM: signalled (cancel, time limit or requeue), 40 GPU h
        _rep(107, "b2", "prolog", 80, "b2"), _rep(107, "b2", "epilog", 90, "b2", signal=15),
        # 108 asks 1 node, runs on a2 (100h-100.5h), requeued with no failure, then on a1
        # 101h-103h: completed, start 100h end 103h, 2 nodes x 8 x 3 = 48 GPU h
        _rep(108, "a2", "prolog", 100, "a2"), _rep(108, "a2", "epilog", 100.5, "a2"),
        _rep(108, "a1", "prolog", 101, "a1"), _rep(108, "a1", "epilog", 103, "a1"),
        # (night of 2026-11-05, finished 102h: a2 CRITICAL gemm, drained)
        # 109 a2 110h-111h: a2 back after 8 h; completed, 8 GPU h
        _rep(109, "a2", "prolog", 110, "a2"), _rep(109, "a2", "epilog", 111, "a2"),
        # 110 b2 120h-121h exit 0, epilog CRITICAL gpu not drained (no reason: the fleet
        # breaker held it): completed, 4 GPU h; b2 not out of service
        _rep(110, "b2", "prolog", 120, "b2"),
        _rep(110, "b2", "epilog", 121, "b2", status=2),
    ]


def fleet_night() -> NightRecord:
    rec = NightRecord(night="2026-11-05", cluster="fleet-test",
                      started_utc="2026-11-05T02:00:00+00:00",
                      finished_utc="2026-11-05T06:00:00+00:00")  # T0 + 102 h
    for node in ("a1", "a2", "a3", "b1", "b2"):
        bad = node == "a2"
        rec.nodes.append(NodeRow(node, node[0], 2 if bad else 0, bad, False,
                                 "bv: nightly 2026-11-05: gemm 310 < 400 TFLOP/s" if bad else ""))
        for m in ("gemm", "hbm"):
            rec.results.append(ResultRow("node", node, "", m, 2 if bad and m == "gemm" else 0,
                                         True, True, "", ""))
    return rec


@pytest.fixture()
def fleet(tmp_path: Path) -> Path:
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    archive.mkdir()
    for r in fleet_reports():
        write_report(spool, r)
    res = ingest(spool, archive)
    assert len(res.jobs_archived) == 10 and not res.quarantined
    write_night(nightly_dir(archive), fleet_night())
    (tmp_path / "site.yaml").write_text(SITE_YAML)
    return archive


def test_figures_match_the_hand_computed_ones(fleet: Path) -> None:
    rep = compute(gather(fleet, T0, NOW), since=T0, now=NOW, classes=CLASSES)
    assert rep["window"]["hours"] == 240
    assert rep["sources"]["jobs"] == 10 and rep["sources"]["nights"] == ["2026-11-05"]
    causes = {(c["cause"], c["source"]): c["count"] for c in rep["interruptions"]["by_cause"]}
    assert causes == {("gpu", "epilog"): 2, ("ib", "prolog"): 1, ("node lost", "job"): 1,
                      ("requeue", "job"): 1, ("gemm", "nightly"): 1}
    assert rep["interruptions"]["total"] == 6
    assert rep["requeues"] == {"jobs_requeued": 2, "requeues_min": 2,
                               "by_cause": {"prolog failure": 1, "unknown": 1},
                               "requeues": 0, "jobs_exact": 0, "jobs_heuristic": 2,
                               "attempts": 0, "requeue_gap_h": 0.0}
    nodes = {n["node"]: n for n in rep["nodes"]}
    # MTBF = (240 h - hours out of service) / incidents
    assert {n: (v["incidents"], v["out_of_service_h"], v["mtbf_h"]) for n, v in nodes.items()} \
        == {"a1": (1, 8, 232), "a2": (1, 8, 232), "a3": (1, 10, 230), "b1": (1, 210, 30),
            "b2": (1, 0, 240)}
    assert nodes["b1"]["out_now"] and not nodes["b2"]["out_now"]
    cls = {c["class"]: c for c in rep["mtbf"]["by_class"]}
    assert cls["a"]["mtbf_h"] == round((232 + 232 + 230) / 3, 3) and cls["a"]["nodes"] == 3
    assert cls["b"]["mtbf_h"] == (30 + 240) / 2 and cls["b"]["incidents"] == 2
    assert rep["fleet"]["mtbf_h"] == (232 + 232 + 230 + 30 + 240) / 5
    assert rep["fleet"]["out_now"] == ["b1"]
    assert [w["node"] for w in rep["worst_nodes"]] == ["b1", "a3", "a1", "a2", "b2"]
    rts = rep["return_to_service"]
    assert (rts["returned"], rts["still_out"], rts["hours"]) == (3, 1, [8, 8, 10])
    assert (rts["median_h"], rts["p90_h"], rts["max_h"]) == (8, 9.6, 10)
    g = rep["goodput"]
    assert g["gpu_hours"] == {"completed": 110, "signalled": 40, "failed": 80,
                              "lost_node": 176, "unknown": 0}
    assert g["jobs_by_outcome"] == {"completed": 6, "signalled": 1, "failed": 1,
                                    "lost_node": 2, "unknown": 0}
    assert g["gpu_hours_total"] == 406 and g["basis"] == "gpu_hours"
    assert g["goodput_pct"] == round(100 * 110 / 406, 2)
    assert g["goodput_upper_pct"] == round(100 * 150 / 406, 2)
    assert g["lost_to_nodes_pct"] == round(100 * 176 / 406, 2)


def test_requeues_are_counted_exactly_from_the_restart_counts(tmp_path: Path) -> None:
    """Three requeued jobs whose reports carry SLURM_JOB_RESTART_COUNT (each attempt archived
    beside the others): 4 requeues, one per cause of the attempt each ended, and the gaps."""
    def at(k: int, *args: Any, **kw: Any) -> dict[str, Any]:
        r = _rep(*args, **kw)
        r["restart"] = k
        return r

    reports = [
        # 201 a[1-2]: attempt 0 1h-3h (requeued by an operator), attempt 1 4h-6h: gap 1 h
        *(at(0, 201, n, p, t, "a[1-2]", exit_code=15) for n in ("a1", "a2")
          for p, t in (("prolog", 1), ("epilog", 3))),
        *(at(1, 201, n, p, t, "a[1-2]") for n in ("a1", "a2")
          for p, t in (("prolog", 4), ("epilog", 6))),
        # 202 b1: attempt 0's prolog CRITICAL (Slurm requeues), attempt 1 11h-12h: no gap known
        at(0, 202, "b1", "prolog", 10, "b1", status=2, drained=True, reason="bv: ib: down"),
        at(1, 202, "b1", "prolog", 11, "b1"), at(1, 202, "b1", "epilog", 12, "b1"),
        # 203: attempt 0 on a3 lost (no epilog), 1 on b2 21h-22h, 2 on b2 23h-24h: gap 1 h
        at(0, 203, "a3", "prolog", 20, "a3"),
        at(1, 203, "b2", "prolog", 21, "b2"), at(1, 203, "b2", "epilog", 22, "b2"),
        at(2, 203, "b2", "prolog", 23, "b2"), at(2, 203, "b2", "epilog", 24, "b2"),
    ]
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    archive.mkdir()
    for r in reports:
        write_report(spool, r)
    res = ingest(spool, archive, now=NOW)
    assert res.jobs_archived == [201, 202, 203] and res.reports_ingested == len(reports)
    rep = compute(gather(archive, T0, NOW, nightly=False), since=T0, now=NOW, classes=CLASSES)
    assert rep["requeues"] == {"jobs_requeued": 3, "requeues_min": 4, "requeues": 4,
                               "jobs_exact": 3, "jobs_heuristic": 0, "attempts": 7,
                               "requeue_gap_h": 2.0,
                               "by_cause": {"node lost": 1, "prolog failure": 1, "requeue": 2}}
    causes = {(c["cause"], c["source"]): c["count"] for c in rep["interruptions"]["by_cause"]}
    assert causes[("requeue", "job")] == 2 and causes[("node lost", "job")] == 1


def test_window_cuts_events_and_job_hours(fleet: Path) -> None:
    # From 45 h: 101-104 ended before; 105 (40h-50h) counts from 45 h only.
    since = T0 + 45 * H
    rep = compute(gather(fleet, since, NOW), since=since, now=NOW, classes=CLASSES)
    assert rep["sources"]["jobs"] == 6
    assert rep["goodput"]["gpu_hours"]["lost_node"] == 2 * 8 * 5
    assert {(c["cause"], c["source"]) for c in rep["interruptions"]["by_cause"]} == {
        ("gpu", "epilog"), ("node lost", "job"), ("requeue", "job"), ("gemm", "nightly")}


def _bv(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BV_")}
    return subprocess.run([sys.executable, "-m", "bluevela", *args], capture_output=True,
                          text=True, timeout=120, check=False, env=env, cwd=cwd)


def test_cli_json_shape(fleet: Path) -> None:
    site = fleet.parent / "site.yaml"
    res = _bv("--site", str(site), "report", "fleet", "--archive-dir", str(fleet),
              "--since", str(T0), "--now", str(NOW), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert set(rep) >= {"format", "schema_version", "window", "sources", "fleet",
                        "interruptions", "requeues", "mtbf", "worst_nodes", "nodes",
                        "return_to_service", "goodput"}
    assert rep["format"] == "bluevela-fleet-report" and rep["schema_version"] == 1
    assert rep["fleet"]["nodes"] == 5 and rep["goodput"]["gpu_hours_total"] == 406
    assert set(rep["worst_nodes"][0]) == {"node", "class", "incidents", "events", "mtbf_h",
                                          "out_of_service_h", "causes", "last_failure_utc",
                                          "out_now"}
    assert rep["worst_nodes"][0]["class"] == "b"


def test_cli_text_names_the_worst_nodes(fleet: Path) -> None:
    site = fleet.parent / "site.yaml"
    res = _bv("--site", str(site), "report", "fleet", "--archive-dir", str(fleet),
              "--since", str(T0), "--now", str(NOW))
    assert res.returncode == 0, res.stderr
    assert "b1" in res.stdout and "MTBF" in res.stdout and "goodput" in res.stdout.lower()


@pytest.mark.parametrize("since", ["30x", "yesterday", "", "-5d"])
def test_bad_since_is_one_line(fleet: Path, since: str) -> None:
    res = _bv("report", "fleet", "--archive-dir", str(fleet), "--since", since)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--since" in lines[0] and "Traceback" not in res.stderr


def test_missing_archive_is_one_line(tmp_path: Path) -> None:
    res = _bv("report", "fleet", "--archive-dir", str(tmp_path / "nope"), "--since", "30d")
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and "does not exist" in res.stderr


def test_future_since_is_an_error(fleet: Path) -> None:
    with pytest.raises(Exception, match="not before now"):
        fleet_report(fleet, since=NOW + 1, now=NOW)


# ------------------------------------------------------------------------------ the page


@pytest.fixture()
def page(fleet: Path, tmp_path: Path) -> Path:
    out = tmp_path / "fleet.html"
    res = _bv("--site", str(fleet.parent / "site.yaml"), "report", "fleet", "--archive-dir",
              str(fleet), "--since", str(T0), "--now", str(NOW), "--html", str(out))
    assert res.returncode == 0, res.stderr
    return out


def test_page_is_self_contained(page: Path) -> None:
    text = page.read_text()
    assert "<script" not in text and not re.search(r"(src|href)=\"https?:", text)
    assert text.count("<svg") == 5  # causes, over time, MTBF, return to service, goodput
    for name in ("b1", "a3", "gemm", "node lost"):
        assert name in text


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")
def test_chromium_renders_the_page(page: Path, tmp_path: Path) -> None:
    dom = _chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.sub(r"<[^>]+>", " ", dom.stdout)
    assert "b1" in body and "still out" in body and "Goodput" in body
    shot = tmp_path / "shot.png"
    res = _chromium([f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()], tmp_path)
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1200, 1400)
    assert len(set(pixels)) > 50, "screenshot looks blank"
    assert sum(1 for p in pixels if p != b"\xff\xff\xff") > 0.05 * len(pixels)


# ------------------------------------------------------------------------- 1,000 nodes


def big_fleet(archive: Path, nodes: int = 1000, days: int = 30, jobs: int = 6000,
              seed: int = 7, widths: tuple[int, ...] = (1, 1, 1, 2, 4, 8, 16, 64),
              batch: int = 40000, max_hours: float = 8.0) -> tuple[float, float]:
    """A synthetic `nodes`-node fleet over `days` days, archived through `store_reports` (the
    ingest writer without a spool) and the nightly store; returns (since, now).

    Jobs of 1-64 nodes run back to back; about 2 % of nodes fail once (half drained by the
    epilog, half by the prolog), a few are lost, one nightly a week drains two nodes.
    """
    import random

    rnd = random.Random(seed)
    names = [f"gpu{i:04d}" for i in range(1, nodes + 1)]
    since, now = T0, T0 + days * 86400.0
    reports: list[dict[str, Any]] = []
    free_at = dict.fromkeys(names, since)
    jid = 1000
    per_day = jobs // days
    for day in range(days):
        # submissions in time order, each started when its nodes are free
        for submit in sorted(since + day * 86400.0 + rnd.uniform(0, 86400.0)
                             for _ in range(per_day)):
            jid += 1
            width = rnd.choice(widths)
            for _try in range(8):  # the scheduler places a job away from drained nodes
                first = rnd.randrange(0, nodes - width)
                group = names[first:first + width]
                start = max(submit, *(free_at[n] for n in group))
                if start - submit < 3600:
                    break
            dur = rnd.uniform(600, max_hours * 3600)
            if start + dur > now:
                continue
            nl = f"gpu[{first + 1:04d}-{first + width:04d}]" if width > 1 else group[0]
            fail = rnd.random()
            for k, n in enumerate(group):
                free_at[n] = start + dur
                p = sample_report(jid, n, "prolog", nodelist=nl, time=start)
                if k == 0 and fail < 0.005:
                    p["health"]["status_code"] = 2
                    p.update(drained=True, drain_reason="bv: ib: mlx5_0/1 state DOWN")
                    free_at[n] = start + rnd.uniform(2, 48) * 3600
                reports.append(p)
                if k == 0 and 0.005 <= fail < 0.007:
                    continue  # node lost
                e = sample_report(jid, n, "epilog", nodelist=nl, time=start + dur,
                                  exit_code=1 if fail < 0.05 else 0)
                if k == 0 and 0.007 <= fail < 0.012:
                    e["health"]["status_code"] = 2
                    e.update(drained=True, drain_reason="bv: gpu: XID 79 on GPU 1")
                    free_at[n] = start + dur + rnd.uniform(2, 72) * 3600
                reports.append(e)
            if len(reports) >= batch:
                _store(archive, reports)
    _store(archive, reports)
    for week in range(days // 7):
        night = f"2026-11-{1 + 7 * week + 3:02d}"
        rec = NightRecord(night=night, cluster="big", started_utc=f"{night}T02:00:00+00:00",
                          finished_utc=f"{night}T06:00:00+00:00")
        for i, n in enumerate(names):
            bad = i in (17 + week, 500 + week)
            rec.nodes.append(NodeRow(n, "gpu", 2 if bad else 0, bad, False, ""))
            rec.results.append(ResultRow("node", n, "", "gemm", 2 if bad else 0, True, True,
                                         "", ""))
        write_night(nightly_dir(archive), rec)
    return since, now


def _store(archive: Path, reports: list[dict[str, Any]]) -> None:
    """Validate (as ingest does) and archive `reports`, then empty the list."""
    checked = [validate_report({"schema": 1, "kind": "node_report", **r},
                               SpoolEntry(report_name(r["job_id"], r["node"], r["phase"]),
                                          r["job_id"], r["node"], r["phase"]))
               for r in reports]
    if checked:
        store_reports(archive, checked)
    reports.clear()


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, float]:
    archive = tmp_path_factory.mktemp("big") / "archive"
    archive.mkdir()
    since, now = big_fleet(archive)
    return archive, since, now


def test_1000_nodes_stays_small_and_readable(big: tuple[Path, float, float],
                                             tmp_path: Path) -> None:
    from bluevela.report.fleet_html import write_html

    archive, since, now = big
    classes = {"gpu": NodeClassInfo(frozenset(f"gpu{i:04d}" for i in range(1, 1001)), 8)}
    rep = compute(gather(archive, since, now), since=since, now=now, classes=classes)
    assert rep["fleet"]["nodes"] == 1000 and rep["fleet"]["incidents"] > 20
    out = write_html(rep, tmp_path / "big.html")
    text = out.read_text()
    assert out.stat().st_size < 2_000_000
    assert text.count("<svg") == 5  # distributions, never a chart per node
    assert text.count("<tr") <= 20 + 40  # top-20 worst nodes plus the small tables
    worst = rep["worst_nodes"][0]["node"]
    assert worst in text


def test_text_from_the_records_is_escaped(fleet: Path, tmp_path: Path) -> None:
    from bluevela.report.fleet_html import write_html

    rec = fleet_night()
    rec.night, rec.finished_utc = "2026-11-06", "2026-11-06T06:00:00+00:00"
    rec.results = [ResultRow("node", "a2", "", "<script>", 2, True, True, "", "")]
    write_night(nightly_dir(fleet), rec)
    rep = compute(gather(fleet, T0, NOW), since=T0, now=NOW, classes=CLASSES)
    assert any(c["cause"] == "<script>" for c in rep["interruptions"]["by_cause"])
    text = write_html(rep, tmp_path / "x.html").read_text()
    assert "<script" not in text and "&lt;script&gt;" in text


def test_a_jobs_advice_reads_its_class_mtbf_from_the_fleet_report(
        fleet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bv archive show --goodput`'s advice (report/fleet_advice.py): the MTBF and failure
    count of the job's node class over the last 30 days of the fleet report; a missing
    archive gives no advice and says why."""
    from bluevela.report import goodput as G
    from bluevela.report.fleet_advice import fleet_advice
    from bluevela.site import load_site
    from tests.goodput.test_ledger_mtbf import _job

    monkeypatch.setenv("BV_SITE", str(fleet.parent / "site.yaml"))
    led = G.build_ledger(11, _job(11, 6900, "node3", 7000, 8000).goodput, gpus_per_node=8)
    adv = fleet_advice(fleet, led, {"nodes": [{"node": "b2"}]}, now=NOW)
    rep = fleet_report(fleet, since=NOW - 30 * 24 * H, now=NOW, site=load_site())
    (row,) = [r for r in rep["mtbf"]["by_class"] if r["class"] == "b"]
    assert adv["node_class"] == "b" and adv["history_days"] == 30.0
    assert adv["node_mtbf_s"] == pytest.approx(row["mtbf_h"] * 3600)
    assert adv["failures_seen"] == row["incidents"] == 2
    none = fleet_advice(tmp_path / "none", led, {"nodes": [{"node": "b2"}]}, now=NOW)
    assert none["verdict"].startswith("no advice: the fleet's history could not be read")
