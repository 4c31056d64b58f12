"""Typed outcomes in the goodput record (issue 26, section 3): an end carries how the step
ended (`StepEnd`) and each node's `LossKind` beside the cause's text (`loss_kinds`);
`validate` bounds it; `failure_time` and the ledger read the kinds, never the words; a record
an older bv wrote (text only) is read through the one legacy function,
`events.legacy_loss_kinds`. Pure: real files and the real epilog reader, no cluster."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.goodput import events as E
from bluevela.goodput import events_epilog
from bluevela.goodput.outcome import Loss, LossKind, StepEnd
from bluevela.launch import events_log
from bluevela.launch.step_result import failure_time, lost_text
from bluevela.report import goodput as G
from bluevela.report import goodput_bounds as GB

T = 1_800_000_000.0


def _lines(*events: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


# What bv wrote before the kinds (cd8e436's EventLog): an end with the words only.
OLD_FILE = _lines(
    {"e": "job", "t": T, "host": "node1", "job": 9, "restart": 0, "submit": T - 5,
     "start": T, "time_limit_s": 3600},
    {"e": "launch", "t": T + 1, "attempt": 1, "launch": 1, "n_nodes": 3,
     "nodes": ["node1", "node2", "node3"], "spares": 2},
    {"e": "progress", "t": T + 5, "launch": 1},
    {"e": "end", "launch": 1, "kind": "lost",
     "cause": "node2 lost (silent for 31 s (no agent ping)); node3 lost (its agent never "
              "connected in 60 s)", "nodes": ["node2", "node3"],
     "failed": T + 20, "detected": T + 51, "gone": T + 52},
    {"e": "launch", "t": T + 60, "attempt": 2, "launch": 2, "n_nodes": 3,
     "nodes": ["node1", "node4", "node5"], "spares": 0},
    {"e": "progress", "t": T + 65, "launch": 2},
    {"e": "end", "launch": 2, "kind": "hang",
     "cause": "hang: rank 4 on node4 stopped first (no progress for 30 s, last step 9); "
              "node5 lost (did not answer the abort)", "nodes": ["node5"],
     "failed": T + 70, "detected": T + 100, "gone": T + 101},
    {"e": "requeue", "t": T + 102},
)

NODES = frozenset({"node1", "node2", "node3", "node4", "node5"})


def test_an_older_record_with_words_only_is_read_through_the_legacy_kinds() -> None:
    rec = E.read_events_file(OLD_FILE)
    first, second = (la["end"] for la in rec["launches"])
    assert first["loss_kinds"] == {"node2": "silent", "node3": "never-connected"}
    assert second["loss_kinds"] == {"node4": "hung", "node5": "no-abort-answer"}
    led = G.build_ledger(9, [rec], alloc=GB.Allocation(5, NODES, T, T + 110))
    assert [(i.kind, i.cause) for i in led.interruptions] == [
        ("lost", "node failure: node2,node3"), ("hang", "hang on node4")]
    # Once validated (the epilog's report, then the archive), the kinds travel with it.
    again = E.validate(json.loads(json.dumps(rec)))
    assert again == rec


def test_the_supervisors_log_writes_the_kinds_and_the_ledger_ignores_the_words(
        tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    events.chmod(0o1777)
    env = {"SLURM_JOB_ID": "31", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events)}
    log = events_log.EventLog.open(env, "node1", query=False)
    t0 = time.monotonic()
    log.launch(1, 1, ["node1", "node2", "node3"], 0, t0)
    log.progress(t0 + 0.01)
    lost = {"node3": Loss.silent(30), "node2": Loss.closed()}
    log.step_ended(StepEnd.HANG, "hang: rank 1 on node2 stopped first; " + lost_text(lost),
                   lost, t0 + 0.02, t0 + 0.03, t0 + 0.04, hung="node1")
    log.close()
    (path,) = events.glob("bv-goodput.31.r0.*.jsonl")
    end = json.loads(path.read_bytes().splitlines()[-1])
    assert end["kind"] == "hang" and end["nodes"] == ["node2", "node3"]
    assert end["loss_kinds"] == {"node1": "hung", "node2": "closed", "node3": "silent"}
    rec = events_epilog.collect(31, 0, "node1", os.getuid(), env)
    assert rec is not None and rec["launches"][0]["end"]["loss_kinds"] == end["loss_kinds"]

    # The same record reworded: every figure and name of the ledger is the same (the words
    # above name rank 1 on node2; the kind says node1, and the ledger says node1).
    reworded = json.loads(json.dumps(rec))
    reworded["launches"][0]["end"]["cause"] = "something else entirely; node9 lost (silent)"
    a, b = G.build_ledger(31, [rec]), G.build_ledger(31, [E.validate(reworded)])
    assert a.phases == b.phases
    assert [(i.kind, i.cause, i.nodes) for i in a.interruptions] == \
        [(i.kind, i.cause, i.nodes) for i in b.interruptions] == \
        [("hang", "hang on node1", ["node2", "node3"])]


def test_failure_time_reads_the_kind() -> None:
    last_seen = {"n2": 5.0}
    assert failure_time({"n2": Loss(LossKind.SILENT, "reworded")}, last_seen, 0.0, 16.0,
                          None) == 5.0
    assert failure_time({"n2": Loss(LossKind.CLOSED, "silent for 10 s")}, last_seen, 0.0,
                          16.0, None) == 16.0
    assert failure_time({"n3": Loss(LossKind.NEVER_CONNECTED, "")}, {}, 2.0, 16.0,
                          None) == 2.0


def test_a_hung_node_outside_the_allocation_is_not_named() -> None:
    rec = E.read_events_file(OLD_FILE)
    end = rec["launches"][1]["end"]
    end["loss_kinds"] = {"gpu007": "hung", "node5": "no-abort-answer"}  # the owner's forgery
    alloc = GB.Allocation(5, NODES, T, T + 110)
    out, notes = GB.bound_record(E.validate(rec), alloc, T, T + 110)
    clamped = out["launches"][1]["end"]
    assert clamped["loss_kinds"] == {"node5": "no-abort-answer"}
    assert clamped["cause"] == "hang (the node it named is not one of the job's)"
    assert any("cause nodes" in n for n in notes)
    led = G.build_ledger(9, [E.validate(rec)], alloc=alloc)
    assert led.interruptions[1].cause == "hang"


@pytest.mark.parametrize("kinds", [
    {"node2": "vanished"},  # not a LossKind
    {"node2\x1b[2J": "closed"},  # not a node name
    ["node2", "closed"],  # not an object
    {f"n{i}": "closed" for i in range(E.MAX_NODES + 2)},  # more than the bound
], ids=["unknown-kind", "escape-in-name", "not-an-object", "too-many"])
def test_validate_bounds_the_kinds(kinds: Any) -> None:
    rec = E.read_events_file(OLD_FILE)
    rec["launches"][0]["end"]["loss_kinds"] = kinds
    with pytest.raises(E.EventsError, match="loss_kinds"):
        E.validate(rec)


def test_an_end_of_an_unknown_kind_is_refused() -> None:
    rec = E.read_events_file(OLD_FILE)
    rec["launches"][0]["end"]["kind"] = "exploded"
    with pytest.raises(E.EventsError, match="known kind"):
        E.validate(rec)
    assert {e.value for e in StepEnd} == {"ok", "failed", "lost", "hang", "signal",
                                          "terminated"}
