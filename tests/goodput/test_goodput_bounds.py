"""Issue 23 §2.2: a job's owner writes their own goodput events; the ledger and the fleet
report hold every record to what root's hooks saw of the job (the archive's prolog/epilog
times, Slurm's node count, the job's node names). A forged events file goes through the real
reader, the epilog report, the spool, the ingest and the archive. Failed on 9058adc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bluevela.goodput import events as E
from bluevela.report import goodput as G
from bluevela.report import goodput_bounds as GB

T = 1_800_000_000.0
FAR_PAST, FAR_FUTURE = 1.0e9 + 1, 9.9e9  # 2001 and 2283: inside the fields' ranges


def forged_file() -> bytes:
    """What the job's owner can write: 10^6 nodes, times from 2001 to 2283, a node failure
    on gpu007 (never the job's), a hang naming it too."""
    lines = [
        {"e": "job", "t": FAR_PAST, "host": "node1", "job": 9, "restart": 0,
         "submit": FAR_PAST - 1, "start": FAR_PAST, "time_limit_s": 86400},
        {"e": "launch", "t": FAR_PAST, "attempt": 1, "launch": 1, "n_nodes": 10**6,
         "nodes": ["node1", "node2", "gpu007"], "spares": 10**6},
        {"e": "progress", "t": FAR_PAST + 5, "launch": 1},
        {"e": "ckpt", "launch": 1, "step": 1, "t0": FAR_PAST + 10, "t1": FAR_FUTURE - 10},
        {"e": "end", "launch": 1, "kind": "lost", "cause": "gpu007 lost", "nodes": ["gpu007"],
         "failed": FAR_FUTURE, "detected": FAR_FUTURE, "gone": FAR_FUTURE},
        {"e": "launch", "t": FAR_FUTURE, "attempt": 2, "launch": 2, "n_nodes": 10**6,
         "nodes": ["node1"], "spares": 0},
        {"e": "progress", "t": FAR_FUTURE, "launch": 2},
        {"e": "end", "launch": 2, "kind": "hang", "nodes": [],
         "cause": "hang: rank 3 on gpu007 stopped first (no progress for 600 s)",
         "failed": FAR_FUTURE, "detected": FAR_FUTURE, "gone": FAR_FUTURE + 1},
    ]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def test_a_forged_record_is_held_to_the_allocation_in_the_ledger_and_the_fleet_report(
        tmp_path: Path) -> None:
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report
    from bluevela.report.fleet import fleet_report

    rec = E.read_events_file(forged_file())  # the epilog's reader takes it: every field in range
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    nodes = ["node1", "node2"]  # Slurm gave the job 2 nodes, from T+11 to T+81
    for node in nodes:
        write_report(spool, sample_report(9, node, "prolog", nodelist=nodes, time=T + 11))
        epi = sample_report(9, node, "epilog", nodelist=nodes, time=T + 81)
        if node == "node1":
            epi["goodput_events"] = rec
        write_report(spool, epi)
    ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=T + 4000)

    led = G.job_goodput(archive, 9, gpus_per_node=8)
    assert led.nodes == 2  # Slurm's count, not 10^6
    slack = GB.CLOCK_SLACK_S
    # What the job held: first prolog - slack .. last epilog + slack; the claimed queue wait
    # is at most MAX_QUEUE_S before it.
    assert led.start >= T + 11 - slack - GB.MAX_QUEUE_S and led.end <= T + 81 + slack
    assert led.wall_s - led.phases["queue_hold"] <= 70 + 2 * slack
    assert sum(led.gpu_hours().values()) <= (GB.MAX_QUEUE_S + 70 + 2 * slack) * 16 / 3600
    causes = [i.cause for i in led.interruptions]
    assert causes == ["node failure", "hang"]
    assert all(i.nodes == [] and "gpu007" not in i.cause for i in led.interruptions)
    assert any("clamped to the allocation" in n for n in led.notes)

    rep = fleet_report(archive, since=T, now=T + 4000)
    (row,) = rep["ledger"]["per_job"]
    assert row["nodes"] == 2 and row["wall_h"] <= (GB.MAX_QUEUE_S + 70 + 2 * slack) / 3600
    assert not any("gpu007" in c for c in rep["ledger"]["hours_lost_by_cause"])
    assert all("gpu007" not in str(i["nodes"]) for i in row["interruptions"])
    # Node hours of the job as the report counts them: at most its 2 nodes for what it held.
    g = rep["goodput"]
    assert g["node_hours"]["completed"] + g["node_hours"]["lost_ledger"] <= \
        2 * (70 + 2 * slack) / 3600 + 0.01
    assert sum(rep["ledger"]["hours_by_phase"].values()) <= \
        2 * (GB.MAX_QUEUE_S + 70 + 2 * slack) / 3600 + 0.01


def test_bound_record_by_hand() -> None:
    """The clamp on hand numbers: the archive saw the attempt from T+100 to T+200."""
    rec = E.read_events_file(forged_file())
    alloc = GB.Allocation(2, frozenset({"node1", "node2"}), T + 100, T + 200)
    out, notes = GB.bound_record(rec, alloc, T + 100, T + 200)
    lo, hi = T + 100 - GB.CLOCK_SLACK_S, T + 200 + GB.CLOCK_SLACK_S
    assert out["slurm"]["submit"] == lo - GB.MAX_QUEUE_S and out["opened"] == lo
    one, two = out["launches"]
    # Slurm's 2 nodes are both training: no room left for a spare
    assert (one["n_nodes"], one["spares"], one["nodes"]) == (2, 0, ["node1", "node2"])
    assert one["ckpts"] == [[1, lo, hi]] and one["end"]["gone"] == hi
    assert one["end"]["nodes"] == [] and two["n_nodes"] == 2
    assert {n.split("(")[1].split(" outside")[0] for n in notes} == \
        {"cause nodes", "node count", "node names", "spare count", "submit time", "times"}
    # A record the archive has no time for is not used.
    with pytest.raises(ValueError, match="no prolog/epilog time"):
        GB.bound_record(rec, GB.Allocation(2, frozenset(), None, None), None, None)


def test_the_queue_wait_starts_at_slurms_submit_time_not_the_records(tmp_path: Path) -> None:
    """Issue 33 section 4: a 1-hour job whose events claim it was submitted 7 days before it
    started (clamped to MAX_QUEUE_S: 168 h of queue in its ledger). The epilog that carried
    the events also read Slurm's record (`slurm_job`, bluevela/slurm/job_record.py): Slurm
    says 10 s, and both the job's ledger and the fleet report take Slurm's."""
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report
    from bluevela.report.fleet import fleet_report

    start, end = T + 100, T + 3700
    lines = [{"e": "job", "t": start, "host": "node1", "job": 9, "restart": 0,
              "submit": start - 7 * 86400 - 5, "start": start, "time_limit_s": 7200},
             {"e": "launch", "t": start + 2, "attempt": 1, "launch": 1, "n_nodes": 2,
              "nodes": ["node1", "node2"], "spares": 0},
             {"e": "progress", "t": start + 10, "launch": 1},
             {"e": "end", "launch": 1, "kind": "ok", "cause": "exit 0", "nodes": [],
              "failed": None, "detected": None, "gone": end - 5}]
    rec = E.read_events_file(b"".join(json.dumps(x).encode() + b"\n" for x in lines))

    def archive_with(slurm_job: dict[str, object] | None, name: str) -> Path:
        spool, archive = tmp_path / f"spool-{name}", tmp_path / f"archive-{name}"
        spool.mkdir()
        archive.mkdir()
        for node in ("node1", "node2"):
            write_report(spool, sample_report(9, node, "prolog", nodelist=["node1", "node2"],
                                              time=start))
            epi = sample_report(9, node, "epilog", nodelist=["node1", "node2"], time=end)
            if node == "node1":
                epi["goodput_events"] = rec
                if slurm_job is not None:
                    epi["slurm_job"] = slurm_job
            write_report(spool, epi)
        ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=end + 100)
        return archive

    # Without Slurm's word (an older report): the record's, clamped, as before.
    owners = G.job_goodput(archive_with(None, "old"), 9, gpus_per_node=8)
    assert owners.phases["queue_hold"] >= GB.MAX_QUEUE_S - GB.CLOCK_SLACK_S
    # With it: Slurm's 10 s.
    slurms = {"state": "COMPLETING", "restarts": 0, "requeued": False, "submit": start - 10,
              "start": start, "end": end}
    archive = archive_with(slurms, "new")
    led = G.job_goodput(archive, 9, gpus_per_node=8)
    assert led.start == start - 10 and led.phases["queue_hold"] == pytest.approx(10.0)
    rep = fleet_report(archive, since=T, now=end + 100)
    (row,) = rep["ledger"]["per_job"]
    assert row["phases_h"]["queue_hold"] == pytest.approx(round(10 / 3600, 4))
    assert row["wall_h"] < 1.01
    # What is not a unix time in `slurm_job` is not Slurm's word: the record's, clamped.
    for bad in ("soon", True, float("nan"), 5.0, None):
        assert GB.slurm_submit({"slurm_job": {"submit": bad}}) is None
    assert GB.slurm_submit({"slurm_job": "x"}) is None and GB.slurm_submit({}) is None
