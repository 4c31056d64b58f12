"""The goodput ledgers' node failures feed the fleet MTBF that their own advice uses
(bluevela/report/fleet_goodput.py `ledger_failures`, fleet.py `compute`), once each: a failure a ledger and a
drain of the same node both saw is one failure. A ledger is the job owner's account: a node it
names counts only when the hooks saw it go (its prolog of that attempt came, its epilog never
did; issue 33 section 4). Hand-built facts; every number by hand."""

from __future__ import annotations

from typing import Any

import pytest

from bluevela.goodput.events import validate
from bluevela.report.fleet import compute
from bluevela.report.fleet_facts import Attempt, Event, FleetFacts, JobFacts, NodeClassInfo

T = 1_800_000_000.0
NOW = T + 36000.0  # a 10 h window
NODES = ["node1", "node2", "node3"]
CLASSES = {"h": NodeClassInfo(frozenset(NODES), 8)}


def _job(job_id: int, start: float, lost: str, at: float, end: float,
         **kw: Any) -> JobFacts:
    """A 3-node job whose supervisor lost `lost` at T+at and went on with the other two."""
    rest = [n for n in NODES if n != lost]
    rec = validate({
        "v": 1, "host": "node1", "job": job_id, "restart": 0, "opened": T + start,
        "slurm": {"submit": T + start, "start": T + start, "time_limit_s": None},
        "requeue": None, "launches": [
            {"launch": 1, "attempt": 1, "start": T + start + 2, "n_nodes": 3, "nodes": NODES,
             "spares": 0, "first_progress": T + start + 5, "ckpts": [[4, T + at - 20,
                                                                     T + at - 19]],
             "ckpt_more": [0, 0.0],
             "end": {"kind": "lost", "cause": f"{lost} lost", "nodes": [lost],
                     "failed": T + at, "detected": T + at + 1, "gone": T + at + 2}},
            {"launch": 2, "attempt": 2, "start": T + at + 3, "n_nodes": 2, "nodes": rest,
             "spares": 0, "first_progress": T + at + 6, "ckpts": [], "ckpt_more": [0, 0.0],
             "end": {"kind": "ok", "cause": "ok", "nodes": [], "failed": None,
                     "detected": None, "gone": T + end}}]})
    j = JobFacts(job_id, T + start, T + end, 3, 0, 0, list(NODES), kw.get("lost_nodes", []),
                 [], [], 3, goodput=[rec])
    if kw.get("requeued"):
        # Slurm requeued the job after that attempt; the hooks saw `lost` go in attempt 0 (its
        # prolog came, its epilog never did), and every node come back for attempt 1.
        j.restarts = 1
        j.attempts = {0: Attempt(T + start, T + end, set(NODES), set(rest)),
                      1: Attempt(T + end + 10, T + end + 20, set(NODES), set(NODES))}
    return j


def _drain(node: str, at: float, job_id: int) -> Event:
    return Event(T + at, node, "epilog", "gpu", True, job_id, "bv: gpu: XID 79")


def test_a_failure_only_the_ledger_saw_counts_and_one_seen_twice_counts_once() -> None:
    # job 9 lost node2 at T+47 and node2's epilog drained it at T+80 (the same failure);
    # job 11 lost node3 at T+7000, its epilog of that attempt never came, and the job was
    # requeued (node3 ran the next attempt, so it is not among the job's lost nodes): before
    # issue 28, only node2's drain counted.
    facts = FleetFacts(events=[_drain("node2", 80, 9)],
                       jobs=[_job(9, 10, "node2", 47, 80),
                             _job(11, 6900, "node3", 7000, 8000, requeued=True)],
                       passing_prologs={"node3": [T + 6900.0]}, nodes_seen=set(NODES))
    rep = compute(facts, since=T, now=NOW, classes=CLASSES)
    fleet, (cls,) = rep["fleet"], rep["mtbf"]["by_class"]
    assert fleet["incidents"] == 2 and cls["incidents"] == 2
    assert {r["node"]: r["incidents"] for r in rep["nodes"]} == {"node2": 1, "node3": 1}
    # in service: node1 10 h, node2 80 s (drained from T+80 on), node3 10 h (a ledger's
    # failure does not say the node was out): 72080 s over 2 failures
    assert cls["mtbf_h"] == pytest.approx(round(72080 / 3600 / 2, 3))
    assert {(r["cause"], r["source"]) for r in rep["interruptions"]["by_cause"]} == {
        ("gpu", "epilog"), ("node failure", "ledger")}
    # the advice of each ledger uses that MTBF and failure count
    for row in rep["ledger"]["per_job"]:
        assert row["advice"]["failures_seen"] == 2
        assert row["advice"]["node_mtbf_s"] == pytest.approx(cls["mtbf_h"] * 3600)


@pytest.mark.parametrize(("drain_at", "passing", "failures"), [
    (47 + 3500, [], 1),  # within the hour: the same failure
    (47 + 5 * 3600, [], 1),  # 5 h later, but the node ran no job in between: same incident
    (47 + 5 * 3600, [T + 3 * 3600], 2),  # a passing prolog in between: a second failure
])
def test_once_each_by_time_and_incident(drain_at: float, passing: list[float],
                                        failures: int) -> None:
    facts = FleetFacts(events=[_drain("node2", drain_at, 12)],
                       jobs=[_job(9, 10, "node2", 47, 80, requeued=True)],
                       passing_prologs={"node2": passing}, nodes_seen=set(NODES))
    rep = compute(facts, since=T, now=NOW, classes=CLASSES)
    assert rep["mtbf"]["by_class"][0]["incidents"] == failures
    assert rep["interruptions"]["total"] == failures


def test_the_jobs_own_lost_node_is_the_same_failure() -> None:
    # node2's epilog never came for job 9: the archive's "node lost" event (at the job's end,
    # 10 h later) and the ledger's failure at T+47 are one failure
    facts = FleetFacts(jobs=[_job(9, 10, "node2", 47, 9 * 3600, lost_nodes=["node2"])],
                       passing_prologs={"node2": [T + 10.0]}, nodes_seen=set(NODES))
    rep = compute(facts, since=T, now=NOW, classes=CLASSES)
    assert rep["mtbf"]["by_class"][0]["incidents"] == 1
    assert [(r["cause"], r["source"]) for r in rep["interruptions"]["by_cause"]] == [
        ("node lost", "job")]


def test_the_job_advice_reads_the_same_mtbf() -> None:
    """`goodput.advise` with the fleet row's MTBF and count gives the verdict's inputs."""
    from bluevela.report import goodput as G
    from bluevela.report import goodput_advice as GA

    facts = FleetFacts(jobs=[_job(11, 6900, "node3", 7000, 8000, requeued=True)],
                       nodes_seen=set(NODES))
    rep = compute(facts, since=T, now=NOW, classes=CLASSES)
    (cls,) = rep["mtbf"]["by_class"]
    # one failure (the ledger's) in 3 nodes x 10 h in service
    assert cls["incidents"] == 1 and cls["mtbf_h"] == pytest.approx(30.0)
    led = G.build_ledger(11, facts.jobs[0].goodput, gpus_per_node=8)
    adv = GA.advise(led, cls["mtbf_h"], cls["incidents"])
    assert adv["node_mtbf_s"] == pytest.approx(30 * 3600) and adv["failures_seen"] == 1
    assert adv["job_mtbf_s"] == pytest.approx(30 * 3600 / 3)


def test_a_healthy_node_named_in_a_forged_lost_end_gets_no_incident() -> None:
    """Issue 33 section 4: the owner's events name node3 lost, but node3's prolog and epilog
    both came (the hooks found it healthy after the job) and nothing of the hooks says
    otherwise: no incident, the class MTBF and the advice built on it stay as they were.
    Before, the ledger's word alone made an incident of it."""
    honest = FleetFacts(jobs=[_job(11, 6900, "node3", 7000, 8000)], nodes_seen=set(NODES))
    rep = compute(honest, since=T, now=NOW, classes=CLASSES)
    (cls,) = rep["mtbf"]["by_class"]
    assert rep["fleet"]["incidents"] == 0 and cls["incidents"] == 0 and cls["mtbf_h"] is None
    assert rep["nodes"] == [] and rep["interruptions"]["total"] == 0
    (row,) = rep["ledger"]["per_job"]  # the job's own account still shows its interruption
    assert row["interruptions"][0]["nodes"] == ["node3"]
    assert row["advice"]["failures_seen"] == 0
    # the same record for a requeued job that lost node3 in attempt 0 (the hooks' evidence):
    # one incident
    rep = compute(FleetFacts(jobs=[_job(11, 6900, "node3", 7000, 8000, requeued=True)],
                             nodes_seen=set(NODES)), since=T, now=NOW, classes=CLASSES)
    assert rep["mtbf"]["by_class"][0]["incidents"] == 1


def test_a_job_slurm_saw_fail_counts_no_goodput_from_its_ledger() -> None:
    """Issue 33 section 4: a job Slurm saw fail (exit 1) with events that say every launch
    went well: its hours count as `failed`, none as goodput; the contradicted ledger is left
    out of the ledger figures, named in `refused`. Before, its ledger's productive time
    (97% of its hours) counted as `completed`."""
    good = _job(11, 6900, "node3", 7000, 8000)
    rec = good.goodput[0]
    forged = {**rec, "launches": [{**rec["launches"][1], "start": T + 6902,
                                   "first_progress": T + 6905,
                                   "nodes": NODES, "n_nodes": 3}]}
    failed = JobFacts(12, T + 6900, T + 8000, 3, 1, 0, list(NODES), [], [], [], 3,
                      goodput=[validate(forged)])
    rep = compute(FleetFacts(jobs=[failed], nodes_seen=set(NODES)), since=T, now=NOW,
                  classes=CLASSES)
    g = rep["goodput"]
    assert g["jobs_by_outcome"]["failed"] == 1 and g["jobs_with_ledger"] == 0
    assert g["goodput_pct"] == 0.0 and g["gpu_hours"]["completed"] == 0.0
    assert g["gpu_hours"]["failed"] == pytest.approx(round(1100 * 24 / 3600, 2))
    assert rep["ledger"]["jobs"] == 0 and rep["ledger"]["per_job"] == []
    (ref,) = rep["ledger"]["refused"]
    assert ref["job_id"] == 12 and "clean exit" in ref["why"]
    # A failed job whose events agree (its last launch failed) keeps its ledger figures, but
    # its hours are still Slurm's outcome: failed, not split into goodput.
    honest = {**forged, "launches": [{**forged["launches"][0], "end": {
        **forged["launches"][0]["end"], "kind": "failed", "failed": T + 7990,
        "detected": T + 7991}}]}
    failed.goodput = [validate(honest)]
    rep = compute(FleetFacts(jobs=[failed], nodes_seen=set(NODES)), since=T, now=NOW,
                  classes=CLASSES)
    assert rep["ledger"]["jobs"] == 1 and rep["ledger"]["refused"] == []
    assert rep["goodput"]["goodput_pct"] == 0.0 and rep["goodput"]["jobs_with_ledger"] == 0
