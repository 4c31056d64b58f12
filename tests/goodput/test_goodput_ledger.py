"""The goodput ledger's pure logic (bluevela/report/goodput.py) on hand-built event records;
every expected number below is worked out by hand in the comments."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bluevela.goodput.events import EventsError, validate
from bluevela.report import goodput as G
from bluevela.report import goodput_advice as GA

T = 1_800_000_000.0  # an origin for readable times: T + 10 is "10"


def _rec(restart: int, *, submit: float | None, start: float, launches: list[dict[str, Any]],
         requeue: float | None = None, limit: float | None = None) -> dict[str, Any]:
    return validate({"v": 1, "host": "node1", "job": 9, "restart": restart, "opened": T + start,
                     "slurm": {"submit": None if submit is None else T + submit,
                               "start": T + start, "time_limit_s": limit},
                     "requeue": None if requeue is None else T + requeue,
                     "launches": launches})


def _launch(n: int, attempt: int, start: float, progress: float | None,
            ckpts: list[tuple[int, float, float]], kind: str, gone: float,
            failed: float | None = None, detected: float | None = None,
            nodes: list[str] | None = None, cause: str = "") -> dict[str, Any]:
    return {"launch": n, "attempt": attempt, "start": T + start, "n_nodes": 2,
            "nodes": ["node1", "node2"], "spares": 1,
            "first_progress": None if progress is None else T + progress,
            "ckpts": [[s, T + a, T + b] for s, a, b in ckpts], "ckpt_more": [0, 0.0],
            "end": {"kind": kind, "cause": cause or kind, "nodes": nodes or [],
                    "failed": None if failed is None else T + failed,
                    "detected": None if detected is None else T + detected, "gone": T + gone}}


def _phases(led: G.Ledger) -> dict[str, float]:
    return {k: round(v, 6) for k, v in led.phases.items()}


def test_a_node_lost_and_relaunched_on_the_spare() -> None:
    rec = _rec(0, submit=0, start=10, launches=[
        _launch(1, 1, 12, 20, [(4, 30, 31), (8, 41, 42)], "lost", gone=48, failed=47,
                detected=47.2, nodes=["node2"], cause="node2 lost (its agent's connection closed)"),
        _launch(2, 2, 49, 56, [(12, 66, 67)], "ok", gone=80),
    ])
    led = G.build_ledger(9, [rec], gpus_per_node=8)
    # queue 0->10; start-up 10->12->20 and 49->56; work 20->30, 31->41, 56->66, 67->80;
    # saves 30-31, 41-42, 66-67; re-done 42->47; detection 47->47.2; teardown 47.2->48->49.
    assert _phases(led) == {"productive": 43.0, "redone": 5.0, "checkpoint": 3.0,
                            "detection": 0.2, "teardown_relaunch": 1.8, "startup": 17.0,
                            "queue_hold": 10.0, "unattributed": 0.0}
    assert led.wall_s == 80.0 and sum(led.phases.values()) == pytest.approx(80.0)
    assert led.ettr == pytest.approx(43 / 80)
    assert led.gpu_hours()["productive"] == pytest.approx(43 * 16 / 3600)
    (intr,) = led.interruptions
    assert intr.cause == "node failure: node2" and intr.at == T + 47
    assert intr.redone_s == pytest.approx(5.0)
    assert intr.lost_s == pytest.approx(5 + 0.2 + 1.8 + 7)  # re-done, detection, teardown, start-up
    assert led.checkpoints == 3 and led.checkpoint_mean_s == pytest.approx(1.0)
    assert led.checkpoint_interval_s == pytest.approx(10.0)  # 31->41 (66->? is another launch)


def test_a_node_lost_without_spare_is_requeued_and_waits() -> None:
    first = _rec(0, submit=0, start=5, requeue=32, launches=[
        _launch(1, 1, 6, 10, [(4, 20, 22)], "lost", gone=31, failed=30, detected=30.5,
                nodes=["node2"])])
    second = _rec(1, submit=31, start=55, launches=[
        _launch(1, 2, 57, 65, [(8, 75, 76)], "ok", gone=90)])
    led = G.build_ledger(9, [second, first])
    # queue 0->5 and hold 32->55; start-up 5->6->10 and 55->57->65; work 10->20, 65->75,
    # 76->90; saves 20-22, 75-76; re-done 22->30; detection 30->30.5; teardown 30.5->31->32.
    assert _phases(led) == {"productive": 34.0, "redone": 8.0, "checkpoint": 3.0,
                            "detection": 0.5, "teardown_relaunch": 1.5, "startup": 15.0,
                            "queue_hold": 28.0, "unattributed": 0.0}
    assert led.wall_s == 90.0
    (intr,) = led.interruptions
    assert intr.restart == 0 and intr.redone_s == pytest.approx(8.0)
    assert intr.lost_s == pytest.approx(8 + 0.5 + 1.5 + 23 + 10)


def test_time_limit_saved_on_the_signal_loses_nothing() -> None:
    rec = _rec(0, submit=0, start=0, requeue=52.5, limit=120, launches=[
        _launch(1, 1, 1, 5, [(8, 20, 21), (20, 50.4, 51)], "signal", gone=52, failed=50,
                detected=50, cause="checkpoint signal SIGUSR1 from Slurm")])
    led = G.build_ledger(9, [rec])
    # start-up 0->1->5; work 5->20, 21->50.4; saves 20-21, 50.4-51 (the one on the signal);
    # nothing re-done; teardown 51->52->52.5.
    assert _phases(led) == {"productive": 44.4, "redone": 0.0, "checkpoint": 1.6,
                            "detection": 0.0, "teardown_relaunch": 1.5, "startup": 5.0,
                            "queue_hold": 0.0, "unattributed": 0.0}
    (intr,) = led.interruptions
    assert intr.cause == "time limit" and intr.redone_s == 0.0


def test_an_attempt_without_events_is_unattributed() -> None:
    """The batch node died with the supervisor's file: the archive's attempt times remain."""
    first = _rec(0, submit=0, start=5, requeue=32, launches=[
        _launch(1, 1, 6, 10, [(4, 20, 22)], "lost", gone=31, failed=30, detected=30.5,
                nodes=["node2"])])
    third = _rec(2, submit=None, start=170, launches=[
        _launch(1, 3, 171, 180, [], "ok", gone=200)])
    attempts = [{"restart": 1, "first_prolog_unix_s": T + 100, "last_epilog_unix_s": T + 150}]
    led = G.build_ledger(9, [first, third], attempts)
    # hold 32->100 (requeue to attempt 2's first prolog); attempt 2 unattributed 100->170.
    assert led.phases["unattributed"] == pytest.approx(70.0)
    assert led.phases["queue_hold"] == pytest.approx(5 + 68)
    assert sum(led.phases.values()) == pytest.approx(led.wall_s) and led.wall_s == 200.0
    kinds = [i.kind for i in led.interruptions]
    assert kinds == ["lost", "no-record"]
    assert led.interruptions[1].attempt == 2


def test_a_hang_names_its_node_from_the_kind() -> None:
    rec = _rec(0, submit=0, start=0, requeue=40, launches=[
        _launch(1, 1, 1, 4, [(2, 10, 11)], "hang", gone=35, failed=15, detected=33,
                cause="hang: rank 1 on node2 stopped first (no progress for 18 s)")])
    led = G.build_ledger(9, [rec])
    (intr,) = led.interruptions
    # an older record (text only): the legacy reading gives node2 the kind "hung"
    assert intr.cause == "hang on node2" and intr.redone_s == pytest.approx(4.0)
    assert intr.detail.startswith("hang: rank 1 on node2 stopped first")  # the words, kept
    assert led.phases["detection"] == pytest.approx(18.0)


def test_a_forged_record_is_refused() -> None:
    good = _rec(0, submit=0, start=0, launches=[_launch(1, 1, 1, 2, [], "ok", gone=3)])
    bad = dict(good, launches=[dict(good["launches"][0], nodes=["node1\x1b[2J"])])
    with pytest.raises(EventsError):
        validate(bad)
    with pytest.raises(EventsError):
        validate(dict(good, launches=[dict(good["launches"][0],
                                           ckpts=[[1, T + 5, T + 4]])]))
    job = {"nodes": [{"node": "node1", "epilog": {"goodput_events": bad}},
                     {"node": "node2", "epilog": {"goodput_events": good}}]}
    recs, notes = G.records_of(job)
    assert recs == [] and len(notes) == 2  # one fails the checks, one names another host


def test_young_and_daly() -> None:
    # C = 60 s, M = 3600 s: Young sqrt(2*60*3600) = 657.27 s; Daly
    # 657.27 * (1 + sqrt(60/7200)/3 + 60/64800) - 60 = 657.27 * 1.031355 - 60 = 617.88 s.
    assert GA.young_interval(60, 3600) == pytest.approx(657.267, abs=1e-3)
    assert GA.daly_interval(60, 3600) == pytest.approx(617.876, abs=1e-2)
    assert GA.daly_interval(10_000, 3600) == 3600  # C >= 2M: checkpoint once per MTBF
    adv = GA.interval_advice(60, 1800, 3600 * 100, 3, 100, 300, 86400, 8)
    assert adv["job_mtbf_s"] == pytest.approx(3600) and adv["trust"] is False
    assert "too short to trust" in adv["verdict"]
    # waste at 1800 s: 60/1800 + 1860/7200 + 300/3600 = 0.03333 + 0.25833 + 0.08333 = 0.375
    assert adv["expected_waste_used"] == pytest.approx(0.375, abs=1e-4)
    assert adv["gpu_hours_saved"] > 0


def test_spare_advice() -> None:
    # 1,000 nodes for a day, node MTBF 5 years: 0.548 failures expected. With a 10-minute
    # start-up a spare saves 0.42 x 715 s = 302 s of 86,400 (0.35%) for 0.1% more nodes.
    adv = GA.spare_advice(1000, 5 * 365 * 86400, 86400, startup_s=600)
    assert adv["expected_failures"] == pytest.approx(1000 * 86400 / (5 * 365 * 86400))
    row0 = adv["table"][0]
    assert row0["expected_loss_s"] == pytest.approx(adv["expected_failures"] * 720)
    assert adv["best_spares"] >= 1
    lam = adv["expected_failures"]
    assert adv["table"][1]["expected_failures_covered"] == pytest.approx(1 - math.exp(-lam))
    # A node that never fails: spares only cost.
    assert GA.spare_advice(8, 1e15, 3600)["best_spares"] == 0


def test_the_fleet_report_uses_the_ledger_where_events_exist() -> None:
    """Two 2-node jobs of an 8-GPU class: one with the spare-relaunch record above (a ledger
    replaces its whole-job outcome), one without events (whole-job, as before)."""
    from bluevela.report.fleet import compute
    from bluevela.report.fleet_facts import FleetFacts, JobFacts, NodeClassInfo

    rec = _rec(0, submit=0, start=10, launches=[
        _launch(1, 1, 12, 20, [(4, 30, 31), (8, 41, 42)], "lost", gone=48, failed=47,
                detected=47.2, nodes=["node2"]),
        _launch(2, 2, 49, 56, [(12, 66, 67)], "ok", gone=80)])
    # node2's epilog never came (the hooks saw it go: the ledger's failure is the fleet's)
    with_events = JobFacts(9, T + 10, T + 80, 3, 0, 0, ["node1", "node2", "node3"], ["node2"],
                           [], [], 3, goodput=[rec])
    plain = JobFacts(10, T + 100, T + 460, 2, 0, 0, ["node1", "node3"], [], [], [], 2)
    classes = {"h": NodeClassInfo(frozenset({"node1", "node2", "node3"}), 8)}
    rep = compute(FleetFacts(jobs=[with_events, plain]), since=T, now=T + 3600,
                  classes=classes)
    led = rep["ledger"]
    assert led["jobs"] == 1 and led["basis"] == "gpu_hours"
    # 2 training nodes x 8 GPUs: productive 43 s -> 43 * 16 / 3600 GPU hours.
    assert led["hours_by_phase"]["productive"] == pytest.approx(round(43 * 16 / 3600, 4))
    # ETTR over every hour paid for: the 2 nodes' 80 s and the 1 idle spare's 70 s (its
    # allocation, 10 -> 80) at 8 GPUs each.
    assert led["ettr_pct"] == pytest.approx(100 * 43 * 16 / (80 * 16 + 70 * 8), abs=0.01)
    assert led["hours_by_phase"]["idle_spare"] == pytest.approx(round(70 * 8 / 3600, 4))
    assert led["by_size"] == [{"nodes": "2", "jobs": 1, "ettr_pct": pytest.approx(37.39)}]
    assert list(led["hours_lost_by_cause"]) == ["node failure: node2"]
    (row,) = led["per_job"]
    # the ledger's own node failure (node2) is the fleet's one failure: advice, not trusted
    assert row["advice"]["failures_seen"] == 1 and "too short to trust" in row["advice"]["verdict"]
    g = rep["goodput"]
    # Job 9 by its ledger: productive 43 s, allocated 80 - 10 (queue) = 70 s, on 3 nodes x 8
    # GPUs; job 10 whole: 360 s x 2 nodes x 8 GPUs, completed.
    assert g["jobs_with_ledger"] == 1
    assert g["gpu_hours"]["completed"] == pytest.approx(round((43 * 24 + 360 * 16) / 3600, 2))
    assert g["gpu_hours"]["lost_ledger"] == pytest.approx(round(27 * 24 / 3600, 2))


def test_through_the_spool_and_archive_the_cause_names_the_drain(tmp_path: Path) -> None:
    """The epilog's report carries the record through the real spool, ingest and archive;
    the ledger names the lost node's drain reason from its next report and links its
    history."""
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report

    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    rec = _rec(0, submit=0, start=10, launches=[
        _launch(1, 1, 12, 20, [(4, 30, 31), (8, 41, 42)], "lost", gone=48, failed=47,
                detected=47.2, nodes=["node2"]),
        _launch(2, 2, 49, 56, [(12, 66, 67)], "ok", gone=80)])
    nodes = ["node1", "node2", "node3"]
    for node in nodes:
        write_report(spool, sample_report(9, node, "prolog", nodelist=nodes, time=T + 11))
        if node != "node2":  # the lost node's epilog never comes
            epi = sample_report(9, node, "epilog", nodelist=nodes, time=T + 81)
            if node == "node1":
                epi["goodput_events"] = rec
            write_report(spool, epi)
    later = sample_report(10, "node2", "prolog", nodelist=["node2"], time=T + 400,
                          status_code=2)
    later.update(drained=True, drain_reason="bv: gpu: XID 79 (fallen off the bus) on GPU 3")
    write_report(spool, later)
    ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=T + 4000)
    led = G.job_goodput(archive, 9, gpus_per_node=8)
    assert _phases(led)["productive"] == 43.0 and led.wall_s == 80.0
    (intr,) = led.interruptions
    assert intr.cause == "node failure: node2 (bv: gpu: XID 79 (fallen off the bus) on GPU 3)"
    (ev,) = intr.evidence
    assert ev["node"] == "node2" and ev["history"] == "bv archive node node2"
    assert any(r["drained"] and r["job_id"] == 10 for r in ev["reports"])


def test_advice_for_a_job_from_its_ledger() -> None:
    rec = _rec(0, submit=0, start=10, launches=[
        _launch(1, 1, 12, 20, [(4, 30, 31), (8, 41, 42)], "lost", gone=48, failed=47,
                detected=47.2, nodes=["node2"]),
        _launch(2, 2, 49, 56, [(12, 66, 67)], "ok", gone=80)])
    led = G.build_ledger(9, [rec], gpus_per_node=8)
    adv = GA.advise(led, node_mtbf_h=10.0, failures_seen=6)
    # C = 1 s (mean save), used interval 10 s, node MTBF 36,000 s over 2 nodes: job MTBF
    # 18,000 s; Young sqrt(2 * 1 * 18000) = 189.7 s. R = 14 - 5 = 9 s per interruption.
    assert adv["job_mtbf_s"] == pytest.approx(18000) and adv["trust"] is True
    assert adv["young_interval_s"] == pytest.approx(189.737, abs=1e-3)
    assert adv["restart_s"] == pytest.approx(9.0)
    # waste at 10 s: 1/10 + 11/36000 + 9/18000 = 0.100806
    assert adv["expected_waste_used"] == pytest.approx(0.100806, abs=1e-6)
    assert adv["gpu_hours_saved"] > 0 and "too short" not in adv["verdict"]
    assert adv["spares"]["best_spares"] == 0  # two nodes, 10 h MTBF: a spare doubles nothing
    assert "checkpoint cost 1.0 s" in G.inputs_text(adv)
