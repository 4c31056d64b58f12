"""Goodput events at the source (bluevela/goodput/events.py, runtime.checkpoint_saved):
real UDP sockets between a rank and a supervisor socket, real files read the way the epilog
(root) reads them."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from bluevela.goodput import events as E
from bluevela.goodput import events_epilog
from bluevela.goodput.outcome import Loss, LossKind, StepEnd
from bluevela.launch import events_log
from bluevela.launch.step_result import failure_time, lost_text
from bluevela.protocol.keys import beat_key, new_secret
from bluevela.protocol.messages import CkptMsg, format_ckpt, parse_ckpt
from bluevela.runtime import heartbeat


@pytest.fixture()
def beat_rank() -> int:
    """`supervisor_socket` (tests/conftest.py) runs this process as rank 3."""
    return 3


def _recv_ckpt(sock: socket.socket, key: bytes) -> CkptMsg:
    while True:
        data = sock.recv(2048)
        if data.startswith(b"bvck1"):
            msg = parse_ckpt(data, key)
            assert msg is not None, data
            return msg


def test_checkpointing_sends_one_signed_record_with_its_duration(
        supervisor_socket: tuple[socket.socket, bytes]) -> None:
    sock, key = supervisor_socket
    with heartbeat.checkpointing(40):
        time.sleep(0.3)
    msg = _recv_ckpt(sock, key)
    assert (msg.rank, msg.step, msg.pid) == (3, 40, os.getpid())
    assert 0.25 <= msg.start_age_s - msg.end_age_s <= 2.0
    heartbeat.checkpoint_saved(44)
    second = _recv_ckpt(sock, key)
    assert second.step == 44 and second.seq == msg.seq + 1
    assert second.start_age_s == second.end_age_s


def test_a_failed_save_records_nothing(supervisor_socket: tuple[socket.socket, bytes]) -> None:
    sock, key = supervisor_socket
    with pytest.raises(OSError), heartbeat.checkpointing(5):
        raise OSError("disk full")
    heartbeat.checkpoint_saved(6)
    assert _recv_ckpt(sock, key).step == 6


def test_forged_or_out_of_range_records_are_dropped() -> None:
    key, other = beat_key(b"a" * 32), beat_key(b"b" * 32)
    good = format_ckpt(CkptMsg(0, 7, 100, 1, 2.0, 1.0), key)
    assert parse_ckpt(good, key) is not None
    assert parse_ckpt(good, other) is None  # signed with another step's secret
    assert parse_ckpt(good.replace(b" 7 ", b" 8 "), key) is None  # altered
    ends_first = format_ckpt(CkptMsg(0, 7, 100, 1, 1.0, 2.0), key)
    assert parse_ckpt(ends_first, key) is None
    huge = format_ckpt(CkptMsg(0, 10**30, 100, 1, 1.0, 0.0), key)
    assert parse_ckpt(huge, key) is None
    assert parse_ckpt(b"bvck1 " + b"9" * 400, key) is None


def test_no_supervisor_no_error_and_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor that is gone (nothing listens on the port): each call is one failed
    non-blocking send, never an exception."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    monkeypatch.setenv("BV_HEARTBEAT", f"127.0.0.1:{port}")
    monkeypatch.setenv("BV_JOB_SECRET", new_secret())
    monkeypatch.setattr(heartbeat, "_SENDER", heartbeat._Sender())
    for step in range(200):
        heartbeat.progress(step)
        heartbeat.checkpoint_saved(step)
    assert heartbeat._SENDER.ck_seq == 200


def sticky_dir(path: Path) -> Path:
    """A directory like /tmp: mode 1777 (owned by the test's user: root, or us)."""
    path.mkdir(exist_ok=True)
    path.chmod(0o1777)
    return path


def _supervisor_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real EventLog run: a launch, a checkpoint datagram, a lost node, a requeue."""
    tmp_path = sticky_dir(tmp_path / "events")
    monkeypatch.setenv("BV_EVENTS_DIR", str(tmp_path))
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "BV_EVENTS_DIR": str(tmp_path)}
    log = events_log.EventLog.open(env, "node1", query=False)
    key = beat_key(b"k" * 32)
    t0 = time.monotonic()
    log.launch(2, 1, ["node1", "node2"], 0, t0)
    log.progress(t0 + 0.01)
    assert log.datagram(format_ckpt(CkptMsg(0, 4, 10, 1, 0.2, 0.1), key), key, 2,
                        time.monotonic())
    assert log.datagram(b"bvck1 forged", key, 2, time.monotonic())  # taken, not recorded
    assert not log.datagram(b"bvhb2 a beat", key, 2, time.monotonic())
    now = time.monotonic()
    lost = {"node2": Loss.closed()}
    log.step_ended(StepEnd.LOST, lost_text(lost), lost, now, now, now)
    log.requeue()
    log.close()
    (path,) = tmp_path.glob(f"bv-goodput.77.r1.u{os.getuid()}.*.jsonl")
    assert path.stat().st_mode & 0o777 == 0o600
    return path


def test_epilog_reads_the_supervisors_file(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = _supervisor_file(tmp_path, monkeypatch)
    rec = events_epilog.collect(77, 1, "node1", os.getuid(), remove=False)
    assert rec is not None and rec["host"] == "node1" and rec["restart"] == 1
    (la,) = rec["launches"]
    assert la["attempt"] == 2 and la["nodes"] == ["node1", "node2"]
    assert len(la["ckpts"]) == 1 and la["ckpts"][0][0] == 4
    assert la["end"]["kind"] == "lost" and la["end"]["nodes"] == ["node2"]
    assert rec["requeue"] is not None
    assert E.validate(json.loads(json.dumps(rec))) == rec  # survives the archive's JSON
    # Another node's epilog, or another attempt's, takes nothing of it.
    assert events_epilog.collect(77, 1, "node2", os.getuid(), remove=False) is None
    assert events_epilog.collect(77, 0, "node1", os.getuid(), remove=False) is None
    assert events_epilog.collect(77, 1, "node1", os.getuid(), remove=True) is not None
    assert not path.exists()  # read once, then removed


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root (the epilog runs as root)")
def test_epilog_refuses_a_file_of_another_user(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = _supervisor_file(tmp_path, monkeypatch)
    os.chown(path, 4242, 4242)
    assert events_epilog.collect(77, 1, "node1", 1000, remove=False) is None
    # Its name says uid 0: a file of uid 4242 under it is not 4242's record either.
    assert events_epilog.collect(77, 1, "node1", 4242, remove=False) is None
    path.rename(path.with_name(path.name.replace(".u0.", ".u4242.")))
    assert events_epilog.collect(77, 1, "node1", 4242, remove=False) is not None


def test_epilog_never_follows_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _supervisor_file(tmp_path, monkeypatch)
    secret = tmp_path / "secret"
    path.rename(secret)
    path.symlink_to(secret)
    assert events_epilog.collect(77, 1, "node1", os.getuid(), remove=True) is None
    assert path.is_symlink() and secret.exists()  # neither read nor removed


@pytest.mark.parametrize("bad", [
    b"not json\n{}\n",
    b'{"e":"job","t":1700000000,"host":"node1","job":77,"restart":1}\n{"e":"mystery"}\n',
    b'{"e":"job","t":1700000000,"host":"node1","job":77,"restart":1}\n'
    b'{"e":"launch","t":1e300,"attempt":1,"launch":1,"n_nodes":1,"nodes":["n"],"spares":0}\n',
    b'{"e":"job","t":1700000000,"host":"no de\\u001b[2J","job":77,"restart":1}\n',
    b'{"e":"job","t":1700000000,"host":"node1","job":77,"restart":1}\n' + b" " * (3 << 20),
], ids=["garbage", "unknown-event", "time-out-of-range", "escape-in-host", "oversized"])
def test_a_bad_file_is_left_out_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          bad: bytes) -> None:
    events = sticky_dir(tmp_path / "events")
    monkeypatch.setenv("BV_EVENTS_DIR", str(events))
    (events / f"bv-goodput.77.r0.u{os.getuid()}.0123456789abcdef.jsonl").write_bytes(bad)
    assert events_epilog.collect(77, 0, "node1", os.getuid()) is None


def test_a_last_line_cut_by_a_kill_is_skipped() -> None:
    text = (b'{"e":"job","t":1700000000,"host":"node1","job":77,"restart":0}\n'
            b'{"e":"launch","t":1700000001,"attempt":1,"launch":1,"n_nodes":1,'
            b'"nodes":["node1"],"spares":0}\n{"e":"progr')
    rec = E.read_events_file(text)
    assert len(rec["launches"]) == 1


def test_failure_time_rules() -> None:
    assert failure_time({"n2": Loss.closed()}, {"n2": 5.0}, 0.0, 9.0, None) == 9.0
    assert failure_time({"n2": Loss.silent(10)}, {"n2": 5.0}, 0.0, 16.0, None) == 5.0
    assert failure_time({"n2": Loss.never_connected(60)}, {}, 1.5, 16.0, None) == 1.5
    # the kind decides, not the words
    assert failure_time({"n2": Loss(LossKind.SILENT, "quiet")}, {"n2": 5.0}, 0.0, 16.0,
                          None) == 5.0
    assert failure_time({"n2": Loss(LossKind.CLOSED, "silent for 10 s")}, {"n2": 5.0}, 0.0,
                          16.0, None) == 16.0
    assert failure_time({}, {}, 0.0, 20.0, 12.5) == 12.5
    assert events_log.parse_limit("1-02:03:04") == 93784.0
    assert events_log.parse_limit("00:02:00") == 120.0
    assert events_log.parse_limit("UNLIMITED") is None


def test_a_checkpoint_record_starts_no_heartbeat(
        supervisor_socket: tuple[socket.socket, bytes]) -> None:
    """A script that records checkpoints but never calls progress() must not start beats
    (with --hang-timeout, beats without progress would read as a hang)."""
    sock, key = supervisor_socket
    heartbeat.checkpoint_saved(3)
    assert sock.recv(2048).startswith(b"bvck1")
    sock.settimeout(heartbeat.INTERVAL_S * 2.5)
    with pytest.raises(TimeoutError):
        sock.recv(2048)
    heartbeat.progress(4)  # now the heartbeat starts
    assert sock.recv(2048).startswith(b"bvhb2")
