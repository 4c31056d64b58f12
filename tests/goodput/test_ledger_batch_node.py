"""Issue 28 §1: the batch node's death does not take the job's goodput record with it.

The REAL supervisor and node agents (tests/supervisor_standins.py: stand-in srun/torchrun,
real sockets) stream every goodput event line, signed over the step's channel, to a second
node's agent, which keeps a copy in its own node's events directory; the supervisor is then
SIGKILLed and its own file removed (its node and its disk are gone). The keeper node's epilog
read (`events_epilog.collect_files`, as root) finds the copy; the archive (real spool, real ingest)
and the ledger name the batch node as the lost node, with the drain reason its later report
gives. Before issue 28 the attempt was "no supervisor record", all of it unattributed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from bluevela.goodput import events as E
from bluevela.goodput import events_epilog
from bluevela.launch import events_copy
from bluevela.protocol.channel import MAX_LINE, Channel
from bluevela.protocol.keys import beat_key, derive
from bluevela.protocol.messages import CkptMsg, format_ckpt
from tests.supervisor_standins import Job


def _events_dir(tmp: Path) -> Path:
    ev = tmp / "events"
    ev.mkdir()
    ev.chmod(0o1777)  # a shared layout, like /tmp (events_dir.dir_layout)
    return ev


def _files(ev: Path, copy: bool) -> list[Path]:
    return sorted(p for p in ev.glob("bv-goodput.77.r0.*.jsonl")
                  if p.name.endswith(".copy.jsonl") == copy)


def _wait(what: str, cond: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s"
        time.sleep(0.05)
    return value


def _checkpoint(job: Job, step: int, seq: int) -> None:
    """A rank's signed checkpoint datagram (runtime.checkpoint_saved) to the supervisor."""
    secret = bytes.fromhex((job.dir / "secret").read_text().split()[-1])
    msg = CkptMsg(0, step, os.getpid(), seq, 0.3, 0.1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(format_ckpt(msg, beat_key(secret)), job.addrs()[1])


def test_the_copy_outlives_the_batch_node_and_the_ledger_names_it(
        tmp_path: Path, jobs: list[Job]) -> None:
    from bluevela.archive.ingest import ingest
    from bluevela.archive.sample import sample_report
    from bluevela.archive.spool import write_report
    from bluevela.report import goodput as G
    from bluevela.report.fleet import fleet_report

    ev = _events_dir(tmp_path)
    job = Job(tmp_path, ("n1", "n2"), extra_env={"BV_EVENTS_DIR": str(ev)})
    jobs.append(job)
    job.start().wait_ready()
    batch = socket.gethostname()  # the supervisor's node (the stand-ins run it here)
    assert batch not in ("n1", "n2")
    time.sleep(1.0)  # the ranks' first progress is in, then a save
    _checkpoint(job, 40, 1)
    _checkpoint(job, 44, 2)  # a save's line is written when the next one starts
    # the copy on n1 (the step's first node that is not the batch node) gets every line: the
    # job line, the launch, the first progress and the checkpoint
    copy = _wait("copy with the checkpoint", lambda: [
        p for p in _files(ev, True) if b'"ckpt"' in p.read_bytes()])
    assert len(copy) == 1 and copy[0].stat().st_mode & 0o777 == 0o600
    (own,) = _files(ev, False)
    lines = [json.loads(x) for x in copy[0].read_bytes().splitlines()]
    assert lines == [json.loads(x) for x in own.read_bytes().splitlines()]  # a true copy
    # The batch node dies: the supervisor is killed, its node-local file gone with the node.
    assert job.proc is not None
    died = time.time()
    job.proc.kill()
    job.proc.wait()
    own.unlink()
    _wait("the keeper's note that the supervisor went",
          lambda: b'"gone"' in copy[0].read_bytes())

    # n1's epilog (root) reads the copy: another node's supervisor's events, kept here
    got = events_epilog.collect_files(77, 0, "n1", os.getuid(), {"BV_EVENTS_DIR": str(ev)})
    assert got is not None
    rec = got.record
    assert rec["host"] == batch and rec["copy_on"] == "n1"
    assert died - 1 <= rec["gone"] <= died + 10
    (la,) = rec["launches"]
    assert la["end"] is None and la["ckpts"] and la["ckpts"][0][0] == 40

    # The archive: the batch node's prolog came and its epilog never did; n1's epilog holds
    # the copy; later the batch node came back and its prolog drained it with a reason.
    spool, archive = tmp_path / "spool", tmp_path / "archive"
    spool.mkdir()
    archive.mkdir()
    nodes = [batch, "n1", "n2"]
    start, end = rec["opened"] - 1, rec["gone"] + 30
    for node in nodes:
        write_report(spool, sample_report(77, node, "prolog", nodelist=nodes, time=start))
        if node != batch:
            epi = sample_report(77, node, "epilog", nodelist=nodes, time=end)
            if node == "n1":
                epi["goodput_events"] = rec
            write_report(spool, epi)
    back = sample_report(78, batch, "prolog", nodelist=[batch], time=end + 60, status_code=2)
    back.update(drained=True, drain_reason="bv: gpu: XID 79 fallen off the bus")
    write_report(spool, back)
    ingest(spool, archive, timeout_s=0.0, prolog_only_timeout_s=0.0, now=end + 4000)

    led = G.job_goodput(archive, 77, gpus_per_node=8)
    (intr,) = led.interruptions
    assert intr.kind == "lost" and intr.nodes == [batch], intr
    assert intr.cause.startswith(f"node failure: {batch} (the batch node: the supervisor "
                                 "died with it) (bv: gpu: XID 79"), intr.cause
    assert intr.at == pytest.approx(rec["gone"])
    assert "copy on n1" in intr.detail
    assert led.phases["checkpoint"] > 0 and led.phases["unattributed"] == pytest.approx(0.0)
    # re-done from the checkpoint's end to the death; Slurm acted at the last epilog
    assert led.phases["redone"] == pytest.approx(rec["gone"] - la["ckpts"][0][2], abs=1e-6)
    assert led.phases["detection"] == pytest.approx(end - rec["gone"], abs=1e-6)
    assert not any("no supervisor record" in i.cause for i in led.interruptions)
    text = "\n".join(G.summary_lines(led))
    assert f"node failure: {batch} (the batch node" in text

    # the fleet report: the same ledger, and the batch node's loss counted once
    rep = fleet_report(archive, since=start - 60, now=end + 4000)
    (row,) = rep["ledger"]["per_job"]
    assert row["interruptions"][0]["nodes"] == [batch]
    assert [n["incidents"] for n in rep["nodes"] if n["node"] == batch] == [1]


def test_the_copy_takes_each_line_once_in_order_and_within_bounds(tmp_path: Path) -> None:
    """The keeper's writer (as it runs in the agent) on the messages the sender makes: a
    repeated or out-of-order line changes nothing; a line over the bounds is left out; a long
    line travels in parts that each fit the channel's line."""
    ev = _events_dir(tmp_path)
    env = {"BV_EVENTS_DIR": str(ev)}
    head = json.dumps({"e": "job", "t": 1.8e9, "host": "b1", "job": 77, "restart": 0}).encode()
    cause = "\u2603" * E.MAX_CAUSE  # JSON-escaped: 3,600 characters on the line
    end = json.dumps({"e": "end", "launch": 1, "kind": "lost", "cause": cause,
                      "nodes": ["n2"], "failed": 1.8e9 + 5, "detected": 1.8e9 + 6,
                      "gone": 1.8e9 + 7}).encode()
    launch = json.dumps({"e": "launch", "t": 1.8e9 + 1, "attempt": 1, "launch": 1,
                         "n_nodes": 2, "nodes": ["b1", "n2"], "spares": 0}).encode()
    lines = [head + b"\n", launch + b"\n", end + b"\n"]
    msgs = [m for n, x in enumerate(lines) for m in events_copy.copy_messages(n, x)]
    chan = Channel(socket.socket(), derive(b"k" * 32, b"line"), b"n" * 16, b"s")
    assert max(len(chan.encode(m)) for m in msgs) <= MAX_LINE
    assert len(events_copy.copy_messages(2, lines[2])) == -(-len(end) // events_copy.COPY_CHUNK) > 1  # in parts
    worst = events_copy.copy_messages(9, b'"\\' * E.END_LINE_MAX)  # every character escaped again
    assert max(len(chan.encode(m)) for m in worst) <= MAX_LINE
    w = events_copy.CopyWriter(env, "n2")
    for m in [msgs[0], msgs[0], msgs[2], msgs[1], *msgs[1:], *msgs]:  # dups, a gap, replays
        w.feed(m)
    w.feed({"t": "ev", "n": 3, "i": 0, "k": 10**6, "d": "{}"})  # more parts than a line has
    w.feed({"t": "ev", "n": "3", "i": 0, "k": 1, "d": "{}"})  # not a number
    (copy,) = ev.glob("*.copy.jsonl")
    assert copy.read_bytes() == b"".join(lines)
    rec = E.read_events_file(copy.read_bytes())
    assert rec["launches"][0]["end"]["cause"] == cause
    # a later step's keeper on the same node: once caught up, the older copy goes
    w2 = events_copy.CopyWriter(env, "n2")
    for m in msgs:
        w2.feed(m)
    assert len(list(ev.glob("*.copy.jsonl"))) == 2
    w2.feed({"t": "ev_synced", "n": 3})
    assert [p.name for p in ev.glob("*.copy.jsonl")] == [w2.name]
    # a full copy file takes no more (the supervisor's own bounds)
    w2.bytes = E.MAX_FILE_BYTES - 10
    w2.feed(events_copy.copy_messages(3, b'{"e":"requeue","t":1800000009}\n')[0])
    assert (ev / w2.name).read_bytes() == b"".join(lines)


def test_merging_the_copies_counts_every_event_once() -> None:
    t = 1.8e9
    base = {"v": 1, "host": "b1", "job": 77, "restart": 0, "opened": t,
            "slurm": {"submit": t - 10, "start": t, "time_limit_s": None}, "requeue": None}

    def launch(end: bool, ckpts: list[list[float]]) -> dict[str, Any]:
        return {"launch": 1, "attempt": 1, "start": t + 1, "n_nodes": 2, "nodes": ["b1", "n2"],
                "spares": 0, "first_progress": t + 3, "ckpts": ckpts, "ckpt_more": [0, 0.0],
                "end": {"kind": "ok", "cause": "ok", "nodes": [], "failed": None,
                        "detected": None, "gone": t + 50} if end else None}

    own = E.validate({**base, "launches": [launch(True, [[4, t + 10, t + 11],
                                                          [8, t + 20, t + 21]])]})
    cut = E.validate({**base, "launches": [launch(False, [[4, t + 10, t + 11]])],
                      "copy_on": "n2", "gone": t + 30})
    both = E.merge_records(own, cut)
    assert E.merge_records(both, cut) == both and E.merge_records(both, both) == both
    assert E.merge_records(cut, own)["launches"] == both["launches"]
    (la,) = both["launches"]
    assert la["end"] is not None and [c[0] for c in la["ckpts"]] == [4, 8]


def test_a_shared_events_directory_leaves_each_keepers_copy_to_its_own_epilog(
        tmp_path: Path) -> None:
    """One events directory seen by every node (one /tmp, as on the dev cluster, or a network
    file system): beside the supervisor's own file on b1 lie the copies n2's agent kept (the
    first step's keeper) and n3's (the relaunch's, after n2 was lost and came back). Each
    node's epilog reads and removes only what its own node wrote: b1 its own file, n2 and n3
    their own copies, in whatever order they run. The CI runs that failed
    test_grow_requeue_cluster: b1's epilog (once) and the revived n2's (once) read n3's copy
    first and removed it, and n3's report had no record."""
    ev = _events_dir(tmp_path)
    env = {"BV_EVENTS_DIR": str(ev)}
    uid = os.getuid()
    lines = [json.dumps({"e": "job", "t": 1.8e9, "host": "b1", "job": 77,
                         "restart": 0}).encode() + b"\n",
             json.dumps({"e": "launch", "t": 1.8e9 + 1, "attempt": 1, "launch": 1,
                         "n_nodes": 2, "nodes": ["b1", "n2"], "spares": 0}).encode() + b"\n"]
    own = ev / f"bv-goodput.77.r0.u{uid}.{'a' * 16}.jsonl"
    own.write_bytes(b"".join(lines))
    own.chmod(0o600)
    copies = {}
    for keeper in ("n2", "n3"):
        w = events_copy.CopyWriter(env, keeper)
        for n, line in enumerate(lines):
            for m in events_copy.copy_messages(n, line):
                w.feed(m)
        copies[keeper] = ev / w.name
    assert len(_files(ev, copy=True)) == 2
    rec_n2 = events_epilog.collect(77, 0, "n2", uid, env, remove=True)
    assert rec_n2 is not None and rec_n2["copy_on"] == "n2"
    assert not copies["n2"].exists() and copies["n3"].exists() and own.exists()
    rec_b1 = events_epilog.collect(77, 0, "b1", uid, env, remove=True)
    assert rec_b1 is not None and rec_b1["host"] == "b1" and "copy_on" not in rec_b1
    assert not own.exists() and copies["n3"].exists()
    rec_n3 = events_epilog.collect(77, 0, "n3", uid, env, remove=True)
    assert rec_n3 is not None and rec_n3["host"] == "b1" and rec_n3["copy_on"] == "n3"
    assert rec_n3["launches"] == rec_b1["launches"] == rec_n2["launches"]
    assert _files(ev, copy=True) == []
