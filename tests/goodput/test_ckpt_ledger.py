"""The checkpoint store in bv's goodput ledger (docs/checkpoints.md, "In the goodput ledger"):
the stall (the training loop blocked) and the background phase (off the training path) as
separate figures, and the tier each resume read from, from what the job really records: the
store's signed datagrams -> the supervisor's events file (`EventLog`) -> the epilog's record
(`read_events_file`) -> the archive's JSON -> `build_ledger` -> `bv archive show --goodput`.
One test per rule, then the whole chain with real stores, a real UDP socket and a real file."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.goodput import events as E
from bluevela.goodput.outcome import StepEnd
from bluevela.launch import events_log
from bluevela.protocol.keys import beat_key, mac
from bluevela.protocol.messages import (
    CKPT_MAX_AGE_MS,
    CkptBgMsg,
    CkptMsg,
    ResumeMsg,
    format_ckpt,
    format_ckpt_bg,
    format_resume,
    parse_ckpt,
    parse_ckpt_bg,
    parse_resume,
)
from bluevela.report import goodput as G
from bluevela.report.goodput_bounds import CLOCK_SLACK_S, Allocation, bound_record
from tests.ckpt_helpers import make_store, run_ranks

T = 1_800_000_000.0
KEY = beat_key(b"k" * 32)


# -- the datagrams ---------------------------------------------------------------------------

def test_background_and_resume_datagrams_round_trip_and_refuse_forgeries() -> None:
    bg = CkptBgMsg(3, 40, 100, 7, 2.5, 0.5, 5)
    data = format_ckpt_bg(bg, KEY)
    assert parse_ckpt_bg(data, KEY) == bg
    assert parse_ckpt_bg(data, beat_key(b"o" * 32)) is None  # another step's key
    assert parse_ckpt_bg(data.replace(b" 40 ", b" 41 "), KEY) is None  # altered
    assert parse_ckpt_bg(format_ckpt_bg(CkptBgMsg(3, 40, 100, 7, 2.5, 0.5, 8), KEY), KEY) \
        is None  # no such tier bit
    assert parse_ckpt_bg(format_ckpt_bg(CkptBgMsg(3, 40, 100, 7, 0.5, 2.5, 1), KEY), KEY) \
        is None  # ends before it starts
    rs = ResumeMsg(0, 6, 100, 8, 1.25, 0.25, 1, 1, 0, 2)
    data = format_resume(rs, KEY)
    assert parse_resume(data, KEY) == rs
    assert parse_resume(data[:-1] + b"0", KEY) is None
    # Each kind is only itself: a stall parser takes neither, and the reverse.
    assert parse_ckpt(data, KEY) is None and parse_ckpt_bg(data, KEY) is None
    assert parse_resume(format_ckpt(CkptMsg(0, 6, 100, 9, 1.0, 0.0), KEY), KEY) is None


_TIMED = [  # (format, parse, a message with the ages given)
    (format_ckpt, parse_ckpt, lambda a, b: CkptMsg(2, 9, 100, 4, a, b)),
    (format_ckpt_bg, parse_ckpt_bg, lambda a, b: CkptBgMsg(2, 9, 100, 4, a, b, 3)),
    (format_resume, parse_resume, lambda a, b: ResumeMsg(0, 9, 100, 4, a, b, 1, 0, 1, 0)),
]


@pytest.mark.parametrize(("fmt", "parse", "make"), _TIMED)
def test_timed_datagrams_bad_ages(fmt: Any, parse: Any, make: Any) -> None:
    """The three timed kinds read their ages alike: whole ms, a negative age sent as 0, a
    start or end past CKPT_MAX_AGE_MS or an end before the start refused, a non-number
    refused even when signed."""
    assert parse(fmt(make(1.2349, 0.0009), KEY), KEY) == make(1.234, 0.0)  # ms, truncated
    assert parse(fmt(make(-5.0, -1.0), KEY), KEY) == make(0.0, 0.0)  # negative: 0
    assert parse(fmt(make(1.0, -1.0), KEY), KEY) == make(1.0, 0.0)
    over = CKPT_MAX_AGE_MS / 1000.0 + 1
    assert parse(fmt(make(over, 1.0), KEY), KEY) is None
    assert parse(fmt(make(over, over), KEY), KEY) is None
    assert parse(fmt(make(1.0, 2.0), KEY), KEY) is None  # ended before it started
    words = fmt(make(3.0, 1.0), KEY).rpartition(b" ")[0].split()
    for i, bad in ((5, b"x"), (5, b"-1"), (6, b"1.5"), (6, b"9" * 30)):
        body = b" ".join([*words[:i], bad, *words[i + 1:]])
        assert parse(body + b" " + mac(KEY, body), KEY) is None, (i, bad)


# -- the supervisor's events file ------------------------------------------------------------

def _log(tmp_path: Path) -> events_log.EventLog:
    d = tmp_path / "events"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(d)}
    return events_log.EventLog.open(env, "node1", query=False)


def _lines(tmp_path: Path) -> list[dict[str, Any]]:
    (path,) = (tmp_path / "events").glob("bv-goodput.77.r0.*.jsonl")
    return [json.loads(x) for x in path.read_bytes().splitlines()]


def test_event_log_folds_background_phases_per_step_and_keeps_the_first_resume(
        tmp_path: Path) -> None:
    log = _log(tmp_path)
    t0 = time.monotonic()
    log.launch(1, 1, ["node1", "node2"], 1, t0 - 30)
    now = time.monotonic()

    def send(data: bytes) -> None:
        assert log.datagram(data, KEY, 2, now)

    send(format_resume(ResumeMsg(0, 6, 10, 1, 9.0, 8.5, 1, 1, 0, 0), KEY))
    send(format_resume(ResumeMsg(0, 4, 10, 2, 7.0, 6.0, 0, 0, 2, 3), KEY))  # not the first
    # Step 8's background on both ranks (rank 1 also drained), then step 10's on rank 0.
    send(format_ckpt_bg(CkptBgMsg(0, 8, 10, 3, 5.0, 4.0, 3), KEY))
    send(format_ckpt_bg(CkptBgMsg(1, 8, 11, 1, 5.2, 3.5, 7), KEY))
    send(format_ckpt_bg(CkptBgMsg(1, 8, 11, 1, 5.2, 3.5, 7), KEY))  # a replay: no change
    send(format_ckpt_bg(CkptBgMsg(0, 10, 10, 4, 2.0, 1.0, 1), KEY))
    send(format_ckpt(CkptMsg(0, 10, 10, 5, 2.3, 2.0), KEY))  # the stall: as before
    log.step_ended(StepEnd.OK, "ok", {}, None, None, now)
    log.close()
    lines = _lines(tmp_path)
    resumes = [x for x in lines if x["e"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 6
    assert (resumes[0]["local"], resumes[0]["partner"], resumes[0]["shared"]) == (1, 1, 0)
    bgs = {x["step"]: x for x in lines if x["e"] == "ckpt_bg"}
    assert (bgs[8]["ranks"], bgs[8]["local"], bgs[8]["partner"], bgs[8]["shared"]) == \
        (2, 2, 2, 1)
    assert bgs[8]["t1"] - bgs[8]["t0"] == pytest.approx(5.2 - 3.5, abs=0.01)  # widest span
    assert (bgs[10]["ranks"], bgs[10]["local"], bgs[10]["partner"]) == (1, 1, 0)
    assert [x["step"] for x in lines if x["e"] == "ckpt"] == [10]
    # The epilog's read keeps all of it.
    (path,) = (tmp_path / "events").glob("bv-goodput.77.r0.*.jsonl")
    (la,) = E.read_events_file(path.read_bytes())["launches"]
    assert [b[0] for b in la["bgs"]] == [8, 10] and la["bgs"][0][3:] == [2, 2, 2, 1]
    assert la["resume"]["step"] == 6 and la["resume"]["skipped"] == 0


# -- the record ------------------------------------------------------------------------------

def _record(launches: list[dict[str, Any]]) -> dict[str, Any]:
    return {"v": 1, "host": "node1", "job": 9, "restart": 0, "opened": T + 1,
            "slurm": {"submit": T, "start": T + 1, "time_limit_s": None}, "requeue": None,
            "launches": launches}


def _launch(n: int, start: float, end: float, *, bgs: list[list[Any]] | None = None,
            resume: dict[str, Any] | None = None,
            ckpts: list[list[Any]] | None = None) -> dict[str, Any]:
    la: dict[str, Any] = {
        "launch": n, "attempt": n, "start": T + start, "n_nodes": 2, "nodes": ["node1", "node2"],
        "spares": 1, "first_progress": T + start + 2,
        "ckpts": [[s, T + a, T + b] for s, a, b in ckpts or []], "ckpt_more": [0, 0.0],
        "end": {"kind": "ok" if n > 1 else "lost", "cause": "c", "nodes": [] if n > 1
                else ["node2"], "failed": None if n > 1 else T + end,
                "detected": None if n > 1 else T + end, "gone": T + end}}
    if bgs is not None:
        la["bgs"] = [[s, T + a, T + b, *c] for s, a, b, *c in bgs]
    if resume is not None:
        la["resume"] = {**resume, "t0": T + resume["t0"], "t1": T + resume["t1"]}
    return la


def test_a_record_without_store_events_reads_as_before() -> None:
    rec = E.validate(_record([_launch(1, 2, 20)]))
    assert "bgs" not in rec["launches"][0] and "resume" not in rec["launches"][0]
    led = G.build_ledger(9, [rec])
    assert led.background is None and led.resumes == []
    assert not any("background" in x or "resume" in x for x in G.summary_lines(led))


@pytest.mark.parametrize("bad, why", [
    ([[4, 5.0, 4.0, 2, 2, 2, 0]], "ends before it starts"),
    ([[4, 4.0, 5.0, 2, 3, 2, 0]], "local is not an integer in [0, 2]"),  # more than ranks
    ([[4, 4.0, 5.0, 0, 0, 0, 0]], "ranks is not an integer"),
    ([[4, 4.0, 5.0, 2, 2, 2]], "is not [step, start, end"),
])
def test_a_forged_background_phase_is_refused(bad: list[list[Any]], why: str) -> None:
    with pytest.raises(E.EventsError, match=__import__("re").escape(why)):
        E.validate(_record([_launch(1, 2, 20, bgs=bad)]))


def test_a_forged_resume_is_refused() -> None:
    good = {"step": 6, "t0": 3.0, "t1": 3.5, "local": 1, "partner": 1, "shared": 0,
            "skipped": 0}
    E.validate(_record([_launch(1, 2, 20, resume=good)]))
    for change in ({"t1": 2.0}, {"partner": -1}, {"skipped": "2"}, {"step": None}):
        with pytest.raises(E.EventsError):
            E.validate(_record([_launch(1, 2, 20, resume={**good, **change})]))


def test_merge_unites_background_phases_and_keeps_a_resume() -> None:
    a = E.validate(_record([_launch(1, 2, 20, bgs=[[4, 4.0, 5.0, 1, 1, 1, 0]])]))
    b = E.validate(_record([_launch(1, 2, 20, bgs=[[4, 3.5, 6.0, 2, 2, 1, 2],
                                                   [6, 7.0, 8.0, 2, 2, 2, 0]],
                                    resume={"step": 2, "t0": 2.5, "t1": 3.0, "local": 2,
                                            "partner": 0, "shared": 0, "skipped": 0})]))
    m = E.merge_records(a, b)
    (la,) = m["launches"]
    assert la["bgs"] == [[4, T + 3.5, T + 6.0, 2, 2, 1, 2], [6, T + 7.0, T + 8.0, 2, 2, 2, 0]]
    assert la["resume"]["step"] == 2
    assert E.merge_records(m, m) == m


def test_bounds_clamp_the_background_and_the_resume_to_the_allocation() -> None:
    rec = E.validate(_record([_launch(1, 2, 20, bgs=[[4, 4.0, 5000.0, 2, 2, 2, 0]],
                                      resume={"step": 2, "t0": 2.5, "t1": 9000.0, "local": 2,
                                              "partner": 0, "shared": 0, "skipped": 0})]))
    out, notes = bound_record(rec, Allocation(3, frozenset(), T + 1, T + 30), T + 1, T + 30)
    (la,) = out["launches"]
    hi = T + 30 + CLOCK_SLACK_S
    assert la["bgs"][0][2] == hi and la["resume"]["t1"] == hi
    assert notes and "times" in notes[0]


# -- the ledger ------------------------------------------------------------------------------

def test_the_ledger_keeps_stall_and_background_apart_and_names_each_resumes_tiers() -> None:
    # Launch 1: saves at 10-10.5 and 14-14.25 (the stall), their background phases 10.5-13
    # and 14.25-16 (off the path: the loop was training); node2 lost at 18.
    # Launch 2: resumed step 4 in 0.75 s, one rank from its node, one from the partner, a
    # corrupt copy skipped on the way; a save at 24-24.5, background 24.5-27, drained.
    first = _launch(1, 2, 18, ckpts=[[2, 10, 10.5], [4, 14, 14.25]],
                    bgs=[[2, 10.5, 13, 2, 2, 2, 0], [4, 14.25, 16, 2, 2, 1, 0]])
    second = _launch(2, 19, 30, ckpts=[[6, 24, 24.5]], bgs=[[6, 24.5, 27, 2, 2, 2, 2]],
                     resume={"step": 4, "t0": 20.0, "t1": 20.75, "local": 1, "partner": 1,
                             "shared": 0, "skipped": 1})
    led = G.build_ledger(9, [E.validate(_record([first, second]))], gpus_per_node=8)
    assert led.phases["checkpoint"] == pytest.approx(0.5 + 0.25 + 0.5)  # the stall only
    assert sum(led.phases.values()) == pytest.approx(led.wall_s)  # background in no phase
    assert led.checkpoint_mean_s == pytest.approx(1.25 / 3)  # the advice's cost: the stall
    bg = led.background
    assert bg is not None and bg.saves == 3
    assert bg.seconds == pytest.approx(2.5 + 1.75 + 2.5)
    # step 4's partner copy: one rank of two; shared: step 6 only
    assert bg.complete == {"local": 3, "partner": 2, "shared": 1}
    (r,) = led.resumes
    assert (r.attempt, r.step, r.tiers, r.skipped) == \
        (2, 4, {"local": 1, "partner": 1, "shared": 0}, 1)
    assert r.seconds == pytest.approx(0.75)
    text = "\n".join(G.summary_lines(led))
    assert "checkpoint stall (training blocked): 1.2 s in all, mean 417 ms" in text, text
    assert ("checkpoint background (off the training path): 3 save(s), 6.8 s in all, "
            "mean 2.2 s; complete in node-local 3, partner 2, shared 1") in text, text
    assert ("resume in attempt 2 (restart 0): step 4 in 750 ms from node-local x1, partner x1;"
            " 1 copy skipped") in text, text
    d = json.loads(json.dumps(led.to_dict()))
    assert d["checkpoint_stall_s"] == pytest.approx(1.25)
    assert d["checkpoint_background"]["seconds"] == pytest.approx(6.75)
    assert d["checkpoint_background"]["mean_s"] == pytest.approx(2.25)
    assert d["resumes"][0]["tiers"] == {"local": 1, "partner": 1, "shared": 0}


# -- the whole chain, real stores ------------------------------------------------------------

def _drain_socket(sock: socket.socket) -> list[bytes]:
    out = []
    sock.settimeout(0.5)
    while True:
        try:
            out.append(sock.recv(2048))
        except TimeoutError:
            return out


def test_real_stores_records_reach_the_ledger(
        tmp_path: Path, supervisor_socket: tuple[socket.socket, bytes]) -> None:
    """Two ranks save steps 1-3 through the store (drain every 3rd), then the second node is
    lost with its disk and a spare resumes its shard from the partner: every datagram the
    stores send goes through a real EventLog and file into the ledger."""
    sock, key = supervisor_socket
    log = _log(tmp_path)
    log.launch(1, 1, ["n1", "n2"], 1, time.monotonic())

    def feed() -> None:
        for data in _drain_socket(sock):
            assert log.datagram(data, key, 2, time.monotonic()), data[:5]

    def save(rank: int, coll: Any) -> Any:
        s = make_store(tmp_path, rank, coll, drain_every=3)
        stats = [s.save(step, {"w": bytes([rank, step]) * 1000}) for step in (1, 2, 3)]
        s.finalize()
        return stats

    stats = run_ranks(2, save)
    feed()
    log.step_ended(StepEnd.OK, "ok", {}, None, None, time.monotonic())
    shutil.rmtree(tmp_path / "local" / "n2")
    log.launch(1, 2, ["n1", "n3"], 0, time.monotonic())

    def resume(rank: int, coll: Any) -> Any:
        s = make_store(tmp_path, rank, coll, node="n3" if rank == 1 else None)
        try:
            return s.load_latest()
        finally:
            s.close()

    restored = run_ranks(2, resume)
    assert [r.step for r in restored] == [3, 3]
    feed()
    log.step_ended(StepEnd.OK, "ok", {}, None, None, time.monotonic())
    log.close()
    (path,) = (tmp_path / "events").glob("bv-goodput.77.r0.*.jsonl")
    rec = E.validate(json.loads(json.dumps(E.read_events_file(path.read_bytes()))))
    first, second = rec["launches"]
    assert [c[0] for c in first["ckpts"]] == [1, 2, 3]
    # The stall each step recorded spans at least what the save itself measured.
    for c in first["ckpts"]:
        assert c[2] - c[1] >= min(st[c[0] - 1].stall_s for st in stats) - 0.002
    assert [b[0] for b in first["bgs"]] == [1, 2, 3]
    assert all(b[3:6] == [2, 2, 2] for b in first["bgs"]), first["bgs"]  # local, partner
    assert [b[6] for b in first["bgs"]] == [0, 0, 2]  # step 3 drained (every 3rd)
    r = second["resume"]
    assert (r["step"], r["local"], r["partner"], r["shared"], r["skipped"]) == (3, 1, 1, 0, 0)
    led = G.build_ledger(77, [rec])
    assert led.background is not None and led.background.saves == 3
    assert led.resumes[0].tiers == {"local": 1, "partner": 1, "shared": 0}
