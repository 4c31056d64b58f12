"""The idle hot spares' hours in the goodput ledger: the job's (`bv archive show JOB --goodput`,
the efficiency page) and the fleet's (`bv report fleet`, its page), as their own line beside the
phases, never folded into productive. Every number is worked out by hand in the comments."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.goodput.events import validate
from bluevela.report import goodput as G
from bluevela.report import goodput_bounds as GB
from bluevela.report.fleet import compute
from bluevela.report.fleet_facts import FleetFacts, JobFacts, NodeClassInfo

T = 1_800_000_000.0
NODES = [f"node{i}" for i in range(1, 7)]  # Slurm gave 6 nodes: 4 train, 2 hot spares
CLASSES = {"gpu": NodeClassInfo(frozenset(NODES), 8)}


def _launch(n: int, attempt: int, start: float, progress: float, nodes: list[str], spares: int,
            kind: str, gone: float, failed: float | None = None,
            detected: float | None = None, lost: list[str] | None = None) -> dict[str, Any]:
    return {"launch": n, "attempt": attempt, "start": T + start, "n_nodes": len(nodes),
            "nodes": nodes, "spares": spares, "first_progress": T + progress, "ckpts": [],
            "ckpt_more": [0, 0.0],
            "end": {"kind": kind, "cause": kind, "nodes": lost or [],
                    "failed": None if failed is None else T + failed,
                    "detected": None if detected is None else T + detected, "gone": T + gone}}


def _swap_record() -> dict[str, Any]:
    """4 nodes + 2 spares; node2 dies at 400, the step goes on with node5 (1 spare left)."""
    return validate({"v": 1, "host": "node1", "job": 9, "restart": 0, "opened": T + 100,
                     "slurm": {"submit": T, "start": T + 100, "time_limit_s": None},
                     "requeue": None, "launches": [
                         _launch(1, 1, 110, 130, NODES[:4], 2, "lost", 405, 400, 401,
                                 ["node2"]),
                         _launch(2, 2, 410, 420, ["node1", "node5", "node3", "node4"], 1,
                                 "ok", 1000)]})


def test_the_spares_are_their_own_line_and_the_node_hours_add_up() -> None:
    led = G.build_ledger(9, [_swap_record()], gpus_per_node=8)
    # queue 0->100; start-up 100->130 and 410->420; re-done 130->400 (no checkpoint);
    # detection 400->401; teardown 401->410; productive 420->1000.
    assert {k: round(v, 6) for k, v in led.phases.items()} == {
        "productive": 580.0, "redone": 270.0, "checkpoint": 0.0, "detection": 1.0,
        "teardown_relaunch": 9.0, "startup": 40.0, "queue_hold": 100.0, "unattributed": 0.0}
    # 2 spares from the allocation's start to the end of attempt 1 (100->405: 305 s), then
    # 1 spare from there to the end (405->1000: 595 s): 610 + 595 node-seconds.
    assert led.spare_node_s == pytest.approx(1205.0)
    assert led.spares == 2
    nh, gh = led.node_hours(), led.gpu_hours()
    assert nh["productive"] == pytest.approx(4 * 580 / 3600)  # the spares are not productive
    assert nh[G.IDLE_SPARE] == pytest.approx(1205 / 3600)
    assert gh[G.IDLE_SPARE] == pytest.approx(1205 * 8 / 3600)
    # phases (4 nodes x 1000 s) + spares = 5205 node-s; less the queue (4 x 100) = what the
    # allocation held: 6 nodes x 305 s + 5 x 595 s (node2 is out after its failure) = 4805.
    assert sum(nh.values()) == pytest.approx(5205 / 3600)
    assert led.allocated_node_hours() == pytest.approx((6 * 305 + 5 * 595) / 3600)
    d = led.to_dict()
    assert d["node_hours"][G.IDLE_SPARE] == pytest.approx(1205 / 3600)
    assert d["total_node_hours"] == pytest.approx(5205 / 3600)
    assert G.IDLE_SPARE not in d["phases_s"] and math.isclose(sum(d["phases_s"].values()), 1000)
    lines = G.summary_lines(led)
    spare = next(x for x in lines if x.strip().startswith("idle spare"))
    assert "2 spare(s)" in spare and f"{1205 * 8 / 3600:.2f} GPU-h" in spare
    assert any("in all: 1.446 node-h (1.335 allocated" in x for x in lines)


def test_without_a_failure_the_ledger_holds_slurms_allocation_exactly() -> None:
    rec = validate({"v": 1, "host": "node1", "job": 9, "restart": 0, "opened": T + 50,
                    "slurm": {"submit": T, "start": T + 50, "time_limit_s": None},
                    "requeue": None,
                    "launches": [_launch(1, 1, 60, 70, NODES[:2], 1, "ok", 650)]})
    alloc = GB.Allocation(3, frozenset(NODES[:3]), T + 50, T + 650)
    led = G.build_ledger(9, [rec], gpus_per_node=8, alloc=alloc)
    # Slurm held 3 nodes for 600 s: 2 training + 1 spare
    assert led.allocated_node_hours() == pytest.approx(3 * 600 / 3600)
    assert led.node_hours()[G.IDLE_SPARE] == pytest.approx(600 / 3600)


def test_a_forged_spare_count_is_held_to_slurms_node_count() -> None:
    rec = validate({"v": 1, "host": "node1", "job": 9, "restart": 0, "opened": T + 50,
                    "slurm": {"submit": T, "start": T + 50, "time_limit_s": None},
                    "requeue": None,
                    "launches": [_launch(1, 1, 60, 70, NODES[:2], 900, "ok", 650)]})
    led = G.build_ledger(9, [rec], gpus_per_node=8,
                         alloc=GB.Allocation(3, frozenset(NODES[:3]), T + 50, T + 650))
    assert led.spares == 1 and led.spare_node_s == pytest.approx(600.0)
    assert any("spare count" in n for n in led.notes)


def _fleet_report() -> dict[str, Any]:
    job = JobFacts(9, T + 100, T + 1000, 6, 0, 0, list(NODES), [], [], [], 6,
                   goodput=[_swap_record()])
    return compute(FleetFacts(jobs=[job], nodes_seen=set(NODES)), since=T - 3600,
                   now=T + 3600, classes=CLASSES)


def test_the_fleet_ledger_shows_the_spares_hours() -> None:
    led = _fleet_report()["ledger"]
    h = led["hours_by_phase"]
    assert h["idle_spare"] == pytest.approx(1205 * 8 / 3600, abs=1e-4)
    assert h["productive"] == pytest.approx(580 * 32 / 3600, abs=1e-4)
    # phases: 4 nodes x 8 GPUs x 1000 s; spares 1205 node-s x 8 GPUs
    assert sum(h.values()) == pytest.approx((32 * 1000 + 8 * 1205) / 3600, abs=1e-3)
    # the fleet's ETTR is productive over every hour paid for, the spares' included
    assert led["ettr_pct"] == pytest.approx(100 * 580 * 32 / (32 * 1000 + 8 * 1205), abs=0.01)
    (row,) = led["per_job"]
    assert row["spares"] == 2 and row["idle_spare_h"] == pytest.approx(1205 * 8 / 3600, abs=1e-4)


def test_the_real_supervisors_spare_reaches_the_ledger(tmp_path: Path) -> None:
    """End to end on the REAL supervisor (tests/supervisor_standins.py: stand-in srun and
    torchrun, real sockets): 3 nodes, 2 training and 1 hot spare. Its own events file, read by
    the epilog's reader, gives a ledger whose idle-spare line is that one node over the whole
    launch, and whose productive hours are the 2 training nodes' alone."""
    import os
    import socket

    from bluevela.goodput import events_epilog
    from tests.supervisor_standins import Job

    ev = tmp_path / "events"
    ev.mkdir()
    ev.chmod(0o1777)  # a shared layout, like /tmp (events_dir.dir_layout)
    job = Job(tmp_path, ("n1", "n2", "n3"), options=["--nodes=2", "--spare-nodes=1"],
              extra_env={"BV_EVENTS_DIR": str(ev)})
    try:
        job.start()
        for node in ("n1", "n2"):
            job.wait_for(f"ready.{node}", 60)
        time.sleep(1.5)  # some progress beats, then the ranks end by themselves
        job.finish()
        assert job.wait(60) == 0, job.stdout() + job.stderr()
    finally:
        job.kill()
    assert not (tmp_path / "ready.n3").exists()  # the spare ran nothing
    got = events_epilog.collect_files(77, 0, socket.gethostname(), os.getuid(),
                                      {"BV_EVENTS_DIR": str(ev)})
    assert got is not None
    (la,) = got.record["launches"]
    assert la["nodes"] == ["n1", "n2"] and la["spares"] == 1 and la["end"]["kind"] == "ok", la
    led = G.build_ledger(77, [got.record], gpus_per_node=8)
    assert led.nodes == 2 and led.spares == 1
    # one spare over all the time the launch owns (no queue: the stand-ins give no Slurm times)
    owned = led.wall_s - led.phases["queue_hold"]
    assert led.spare_node_s == pytest.approx(owned, abs=1e-6) and led.spare_node_s > 1.0
    nh, gh = led.node_hours(), led.gpu_hours()
    assert nh[G.IDLE_SPARE] == pytest.approx(owned / 3600)
    assert gh[G.IDLE_SPARE] == pytest.approx(8 * owned / 3600)
    assert led.phases["productive"] > 0
    assert nh["productive"] == pytest.approx(2 * led.phases["productive"] / 3600)
    assert any(x.strip().startswith("idle spare") for x in G.summary_lines(led))


def test_the_pages_show_the_idle_spare_line() -> None:
    from bluevela.report.efficiency_html import _ledger_section
    from bluevela.report.fleet_html import render_html

    html = render_html(_fleet_report())
    assert "idle spare: 2.68 (" in html  # the fleet page's bar legend, GPU-h and share
    assert "2.678 (2 spare(s))" in html  # the per-job table
    led = G.build_ledger(9, [_swap_record()], gpus_per_node=8).to_dict()
    led["interruptions"] = [{**i, "evidence": []} for i in led["interruptions"]]
    page = "".join(_ledger_section(led))
    assert "<tr><td>idle spare</td><td>2 spare(s)</td><td></td><td>0.335</td><td>2.68</td>" \
        in page


def test_the_fleet_pages_job_table_says_when_it_is_cut() -> None:
    """The per-job ledger table shows the jobs with the lowest ETTR; past MAX_LEDGER_JOBS the
    page says how many there are and where every one is (a fleet has thousands)."""
    import copy

    from bluevela.report.fleet_html import MAX_LEDGER_JOBS, render_html

    rep = _fleet_report()
    (row,) = rep["ledger"]["per_job"]
    for n in (MAX_LEDGER_JOBS, MAX_LEDGER_JOBS + 5):
        many = copy.deepcopy(rep)
        many["ledger"]["per_job"] = [{**row, "job_id": 1000 + i, "ettr_pct": 50.0 + i}
                                     for i in range(n)]
        html = render_html(many)
        listed = {i for i in range(n) if f"<td>{1000 + i}</td>" in html}
        assert listed == set(range(min(n, MAX_LEDGER_JOBS)))  # the lowest ETTR first
        cut = f"The {MAX_LEDGER_JOBS} jobs with the lowest ETTR of {n}"
        assert (cut in html) == (n > MAX_LEDGER_JOBS)
