"""The goodput ledgers' node failures feed the fleet MTBF that their own advice uses
(bluevela/report/fleet_goodput.py `ledger_failures`, fleet.py `compute`), once each: a failure a ledger and a
drain of the same node both saw is one failure. Hand-built facts; every number by hand."""

from __future__ import annotations

from typing import Any

import pytest

from bluevela.launch.events import validate
from bluevela.report.fleet import compute
from bluevela.report.fleet_facts import Event, FleetFacts, JobFacts, NodeClassInfo

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
    return JobFacts(job_id, T + start, T + end, 3, 0, 0, list(NODES), kw.get("lost_nodes", []),
                    [], [], 3, goodput=[rec])


def _drain(node: str, at: float, job_id: int) -> Event:
    return Event(T + at, node, "epilog", "gpu", True, job_id, "bv: gpu: XID 79")


def test_a_failure_only_the_ledger_saw_counts_and_one_seen_twice_counts_once() -> None:
    # job 9 lost node2 at T+47 and node2's epilog drained it at T+80 (the same failure);
    # job 11 lost node3 at T+7000 and nothing else saw it (a spare took over, the node came
    # back): before issue 28, only node2's drain counted.
    facts = FleetFacts(events=[_drain("node2", 80, 9)],
                       jobs=[_job(9, 10, "node2", 47, 80), _job(11, 6900, "node3", 7000, 8000)],
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
                       jobs=[_job(9, 10, "node2", 47, 80)],
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

    facts = FleetFacts(jobs=[_job(11, 6900, "node3", 7000, 8000)], nodes_seen=set(NODES))
    rep = compute(facts, since=T, now=NOW, classes=CLASSES)
    (cls,) = rep["mtbf"]["by_class"]
    # one failure (the ledger's) in 3 nodes x 10 h in service
    assert cls["incidents"] == 1 and cls["mtbf_h"] == pytest.approx(30.0)
    led = G.build_ledger(11, facts.jobs[0].goodput, gpus_per_node=8)
    adv = GA.advise(led, cls["mtbf_h"], cls["incidents"])
    assert adv["node_mtbf_s"] == pytest.approx(30 * 3600) and adv["failures_seen"] == 1
    assert adv["job_mtbf_s"] == pytest.approx(30 * 3600 / 3)
