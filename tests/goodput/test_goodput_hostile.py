"""Issue 23 §2: the goodput record against another user of the node, a big job and a full disk.

Real files owned by another uid (planted with `runuser -u nobody` before the job), the real
writer (`EventLog`, the supervisor's side) and reader (`collect`, the epilog's), signed
datagrams as the ranks send them, the real supervisor on its stand-ins with a replayed UDP
datagram, and the real epilog hook on a full 64 KiB tmpfs spool. Each test failed on 9058adc.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bluevela.goodput import events as E
from bluevela.goodput import events_dir, events_epilog
from bluevela.goodput.outcome import Loss, LossKind, StepEnd
from bluevela.launch import events_log
from bluevela.protocol.keys import beat_key
from bluevela.protocol.messages import CkptMsg, format_ckpt
from tests.conftest import REPO, small_tmpfs

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                               reason="another uid (runuser, chown) needs root")


def sticky_dir(path: Path, mode: int = 0o1777) -> Path:
    path.mkdir(exist_ok=True)
    path.chmod(mode)
    return path


def as_nobody(code: str, *args: str) -> None:
    """Run Python `code` as uid nobody (another user of the node), with Debian's python3
    (the test's interpreter may live where nobody cannot read)."""
    if not Path("/usr/bin/python3").exists():
        pytest.skip("needs /usr/bin/python3 to run as another user")
    subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", code, *args],
                   env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}, check=True,
                   timeout=60, cwd="/")


@pytest.fixture()
def shared_tmp() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="bv-goodput-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


SUPERVISOR = """
import json, sys, time
from bluevela.goodput import events as E
from bluevela.launch import events_log
from bluevela.goodput.outcome import StepEnd
from bluevela.protocol.keys import beat_key
from bluevela.protocol.messages import CkptMsg, format_ckpt
env, host = json.loads(sys.argv[1]), sys.argv[2]
log = events_log.EventLog.open(env, host, query=False)
key = beat_key(b"k" * 32)
t0 = time.monotonic()
log.launch(1, 1, [host], 0, t0)
log.progress(t0)
log.datagram(format_ckpt(CkptMsg(0, 4, 10, 1, 0.2, 0.1), key), key, 1, time.monotonic())
log.step_ended(StepEnd.OK, "exit 0", {}, None, None, time.monotonic())
log.close()
"""


def supervisor_run(env: dict[str, str], host: str = "node1", *, nobody: bool = False) -> None:
    """What the supervisor writes for a short job (a launch, one save, a clean end), in a
    process of its own: as this test's user, or as uid nobody."""
    if nobody:
        as_nobody(SUPERVISOR, json.dumps(env), host)
        return
    subprocess.run([sys.executable, "-c", SUPERVISOR, json.dumps(env), host], check=True,
                   timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


# -- §2.1 decoys, the directory, the listing -----------------------------------------------------

DECOYS = """
import os, sys
d, uid = sys.argv[1], sys.argv[2]
for i in range(12):
    for name in (f"bv-goodput.77.r0.{i:016x}.jsonl", f"bv-goodput.77.r0.u{uid}.{i:016x}.jsonl"):
        with open(os.path.join(d, name), "w") as fh:
            fh.write("decoy\\n")
"""


@root_only
def test_another_users_decoys_planted_before_the_job_hide_nothing(shared_tmp: Path) -> None:
    """uid nobody creates 24 files with every name the epilog could take for job 77's
    record (the old form and the new one with the job owner's uid), sorting before any real
    one, before the job starts: the epilog still finds the real record."""
    events = sticky_dir(shared_tmp / "events")
    as_nobody(DECOYS, str(events), str(os.getuid()))
    planted = sorted(events.iterdir())
    assert len(planted) == 24 and all(p.stat().st_uid == NOBODY for p in planted)
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events)}
    supervisor_run(env)
    rec = events_epilog.collect(77, 0, "node1", os.getuid(), env)
    assert rec is not None and rec["launches"][0]["end"]["kind"] == "ok"
    found = events_epilog.collect_files(77, 0, "node1", os.getuid(), env)
    assert found is not None and found.record["launches"][0]["end"]["kind"] == "ok"
    (name,) = found.names
    assert f".u{os.getuid()}." in name
    found.remove()
    assert sorted(events.iterdir()) == planted  # the decoys are another user's: left alone


@root_only
def test_the_events_directory_must_be_one_no_other_user_can_fill_or_replace(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    # Group/other-writable without the sticky bit: anyone may rename the record away.
    open_dir = sticky_dir(tmp_path / "open", 0o777)
    # Owned by another user: they replace whatever lies in it.
    theirs = sticky_dir(tmp_path / "theirs")
    os.chown(theirs, NOBODY, NOBODY)
    link = tmp_path / "link"
    link.symlink_to(sticky_dir(tmp_path / "real"))
    for bad in (open_dir, theirs, link):
        e = {**env, "BV_EVENTS_DIR": str(bad)}
        supervisor_run(e)
        assert list(Path(bad).iterdir()) == [], bad  # the supervisor writes nothing there
        assert events_epilog.collect(77, 0, "node1", os.getuid(), e) is None
        assert events_dir.check_events_dir(str(bad))[1] is not None
    assert "writable by group or others without the sticky bit" in caplog.text
    assert "owned by uid 65534, not root" in caplog.text
    assert events_dir.check_events_dir(str(tmp_path / "real")) == ("shared", None)


@root_only
def test_per_user_directories_made_by_the_prolog(shared_tmp: Path) -> None:
    """A root-owned 0755 directory: the prolog (root) makes <dir>/<uid> for the job's user,
    the supervisor (that user, for real) writes there, the epilog reads it; no other user
    can put a file in it."""
    events = sticky_dir(shared_tmp / "events", 0o755)
    assert events_dir.check_events_dir(str(events)) == ("per-user", None)
    env = {"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events),
           "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY)}
    events_dir.prepare_for_prolog(env)
    mine = events / str(NOBODY)
    st = mine.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (NOBODY, NOBODY, 0o700)
    supervisor_run({k: env[k] for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT",
                                        "BV_EVENTS_DIR")}, nobody=True)
    (written,) = mine.iterdir()
    assert written.name.startswith(f"bv-goodput.78.r0.u{NOBODY}.")
    found = events_epilog.collect_for_epilog(78, 0, "node1", env)
    assert found is not None and found.record["launches"][0]["end"]["kind"] == "ok"
    # A user directory someone made group-writable is refused.
    mine.chmod(0o770)
    assert events_epilog.collect_for_epilog(78, 0, "node1", env) is None


def test_the_directory_listing_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    events = sticky_dir(tmp_path / "events")
    for i in range(60):
        (events / f"flood{i}").touch()
    monkeypatch.setattr(events_epilog, "MAX_SCAN", 50)
    assert events_epilog.collect(77, 0, "node1", os.getuid(), {"BV_EVENTS_DIR": str(events)}) is None
    assert "more than 50 entries" in caplog.text


def test_bv_site_validate_warns_on_an_events_directory_others_can_replace(
        tmp_path: Path) -> None:
    site = REPO / "site.yaml"

    def validate(path: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "BV_HOOK_ENV": "none", "BV_EVENTS_DIR": str(path)}
        return subprocess.run([sys.executable, "-m", "bluevela", "site", "validate",
                               str(site)], env=env, capture_output=True, text=True,
                              timeout=60, check=False)

    bad = validate(sticky_dir(tmp_path / "open", 0o777))
    assert bad.returncode == 0 and "Traceback" not in bad.stderr
    (line,) = [x for x in bad.stderr.splitlines() if "goodput events directory" in x]
    assert line.startswith("WARNING: ") and "without the sticky bit" in line
    good = validate(sticky_dir(tmp_path / "tmp-like"))
    assert "goodput events" not in good.stderr
    hook_env = tmp_path / "hook.env"  # the hooks' own setting is the one checked
    hook_env.write_text(f"BV_EVENTS_DIR={tmp_path / 'open'}\n")
    env = {**os.environ, "BV_HOOK_ENV": str(hook_env), "BV_EVENTS_DIR": str(tmp_path / "tmp-like")}
    via = subprocess.run([sys.executable, "-m", "bluevela", "site", "validate", str(site)],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert "without the sticky bit" in via.stderr


# -- §2.3 lost at size ------------------------------------------------------------------------------

def _big_job(events: Path, saves: int, all_ranks_saves: int, others: int = 8
             ) -> tuple[Path, int]:
    """A 1,024-node x 8-GPU job through the real writer: `saves` checkpoints spread over a
    week; the first `all_ranks_saves` reported by all 8,192 ranks (signed datagrams as
    `checkpointing()` sends them), the rest by `others` ranks (the file holds one line per
    save whatever the count: the test stays fast). Returns the file and its size."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events)}
    nodes = [f"gpu{i:04d}" for i in range(1, 1025)]
    log = events_log.EventLog.open(env, nodes[0], query=False)
    key = beat_key(b"s" * 32)
    now = time.monotonic()
    week = 7 * 86400.0
    log.launch(1, 1, nodes, 0, now - week)
    log.progress(now - week + 60)
    for k in range(saves):
        age = week - 120 - k * (week - 600) / max(saves, 1)
        for rank in range(8192 if k < all_ranks_saves else others):
            msg = CkptMsg(rank, 1000 * (k + 1), 1000 + rank, k + 1, age, age - 20 - rank % 7)
            log.datagram(format_ckpt(msg, key), key, 8192, now)
    log.step_ended(StepEnd.LOST, "gpu0007 lost (silent for 60 s)", {"gpu0007": Loss.silent(60)},
                   now - 30, now - 1, now)
    log.requeue()
    log.close()
    (path,) = events.glob("bv-goodput.4242.r0.*.jsonl")
    return path, path.stat().st_size


def test_a_1024x8_job_with_a_week_of_saves_keeps_its_end_and_every_save(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = sticky_dir(tmp_path / "events")
    saves = 2016  # a save every 5 minutes for a week
    path, size = _big_job(events, saves, all_ranks_saves=8)
    with capsys.disabled():
        print(f"\n1,024 x 8 ranks, {saves} saves: {size} bytes "
              f"({(size - 12_000) / saves:.0f} bytes per save)")
    assert size <= E.MAX_FILE_BYTES // 2
    rec = events_epilog.collect(4242, 0, "gpu0001", os.getuid(), {"BV_EVENTS_DIR": str(events)})
    assert rec is not None
    (la,) = rec["launches"]
    assert la["n_nodes"] == 1024 and len(la["nodes"]) == 1024
    assert len(la["ckpts"]) == saves and la["ckpt_more"] == [0, 0.0]
    # The 8,192 ranks' datagrams of a save are one save, their widest span.
    first = la["ckpts"][0]
    # (ranks ended up to 6 s apart; the loop's own run time adds to the span)
    assert first[0] == 1000 and 26 - 0.01 <= first[2] - first[1] <= 26 + 10
    assert la["end"] is not None and la["end"]["kind"] == "lost"
    assert la["end"]["nodes"] == ["gpu0007"] and rec["requeue"] is not None


def test_a_full_file_still_closes_the_attempt(tmp_path: Path) -> None:
    """More saves than the file holds (a save every 15 s for a week): the later saves are
    summed out of the file, the launch's end and the requeue are never left out, and the
    reader takes the file the writer wrote."""
    events = sticky_dir(tmp_path / "events")
    path, size = _big_job(events, 40_000, all_ranks_saves=0, others=1)
    assert size <= E.MAX_FILE_BYTES
    rec = E.read_events_file(path.read_bytes())
    (la,) = rec["launches"]
    assert la["end"] is not None and la["end"]["kind"] == "lost" and rec["requeue"] is not None
    kept = len(la["ckpts"]) + la["ckpt_more"][0]
    assert E.MAX_CKPTS <= kept < 40_000 and len(la["ckpts"]) == E.MAX_CKPTS


def test_the_end_line_always_fits_the_room_kept_for_it() -> None:
    worst = {"e": "end", "launch": 10**6, "kind": "terminated", "cause": "\U0001f600" * E.MAX_CAUSE,
             "nodes": ["n" * 64 + "..."] * E.MAX_NODES, "failed": 9999999999.123456,
             "detected": 9999999999.123456, "gone": 9999999999.123456,
             # every node with the longest loss kind, and the hung rank's node
             "loss_kinds": {f"{i:067d}": max((k.value for k in LossKind), key=len)
                            for i in range(E.MAX_NODES + 1)}}
    assert len(json.dumps(worst, separators=(",", ":"))) + 1 <= E.END_LINE_MAX
    req = {"e": "requeue", "t": 9999999999.123456}
    assert len(json.dumps(req, separators=(",", ":"))) + 1 <= E.REQUEUE_LINE_MAX


# -- §2.4 replayed checkpoint datagrams ----------------------------------------------------------

def test_a_replayed_checkpoint_datagram_moves_nothing(tmp_path: Path) -> None:
    events = sticky_dir(tmp_path / "events")
    env = {"SLURM_JOB_ID": "79", "SLURM_RESTART_COUNT": "0", "BV_EVENTS_DIR": str(events)}
    log = events_log.EventLog.open(env, "node1", query=False)
    key = beat_key(b"r" * 32)
    log.launch(1, 1, ["node1"], 0, time.monotonic())
    save = format_ckpt(CkptMsg(0, 8, 321, 5, 0.3, 0.1), key)
    log.datagram(save, key, 1, time.monotonic())
    time.sleep(0.5)
    log.datagram(save, key, 1, time.monotonic())  # the same bytes again
    older = format_ckpt(CkptMsg(0, 8, 321, 4, 0.0, 0.0), key)  # an earlier seq
    log.datagram(older, key, 1, time.monotonic())
    log.step_ended(StepEnd.OK, "exit 0", {}, None, None, time.monotonic())
    log.close()
    rec = events_epilog.collect(79, 0, "node1", os.getuid(), env)
    assert rec is not None
    ((step, t0, t1),) = rec["launches"][0]["ckpts"]
    assert step == 8 and t1 - t0 == pytest.approx(0.2, abs=0.05)


@pytest.fixture
def jobs() -> Iterator[list[object]]:
    started: list[object] = []
    yield started
    for job in started:
        job.kill()  # type: ignore[attr-defined]


def test_a_replayed_datagram_against_the_real_supervisor(tmp_path: Path,
                                                         jobs: list[object]) -> None:
    """A save's datagram, signed as a rank signs it, sent to the real supervisor's UDP
    socket, then the same bytes again 1.5 s later: the save's end in the events file is the
    first one."""
    from tests.supervisor_standins import Job, _script

    events = sticky_dir(tmp_path / "events")
    job = Job(tmp_path)
    _script(job.bin / "squeue", "import sys\nsys.exit(1)\n")
    job.env["BV_EVENTS_DIR"] = str(events)
    jobs.append(job)
    job.start().wait_ready()
    secret = (tmp_path / "secret").read_text().splitlines()[-1]
    key = beat_key(bytes.fromhex(secret))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        save = format_ckpt(CkptMsg(0, 12, 4321, 1, 0.4, 0.2), key)
        sent = time.time()
        udp.sendto(save, job.addrs()[1])
        time.sleep(1.5)
        udp.sendto(save, job.addrs()[1])
        time.sleep(0.5)
    finally:
        udp.close()
    job.finish()
    assert job.wait(60) == 0, job.stderr()
    # the supervisor's own file (the stand-ins' node n1 is not the supervisor's host, so n1's
    # agent also keeps a .copy of it in the same directory here)
    (path,) = [p for p in events.glob("bv-goodput.77.r0.*.jsonl")
               if not p.name.endswith(".copy.jsonl")]
    rec = E.read_events_file(path.read_bytes())
    ((step, t0, t1),) = rec["launches"][0]["ckpts"]
    assert step == 12
    assert abs(t1 - (sent - 0.2)) < 0.5, (t1 - sent)  # a replay would put it ~1.3 s later


# -- §2.5 a full spool disk ---------------------------------------------------------------------

@pytest.fixture()
def tiny_spool(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "spool") as mnt:
        yield mnt


def test_a_full_spool_keeps_the_events_for_the_next_try(tmp_path: Path,
                                                        tiny_spool: Path) -> None:
    from tests.hooks.test_hooks_run import make_node, run_hook

    events = sticky_dir(tmp_path / "events")
    hook_env, _ = make_node(tmp_path, BV_SPOOL_DIR=str(tiny_spool), BV_EVENTS_DIR=str(events))
    supervisor_run({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0",
                    "BV_EVENTS_DIR": str(events)}, host="gpu001")
    (record,) = events.iterdir()
    filler = tiny_spool / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # the spool's disk, really full
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"x" * 1024)
    finally:
        os.close(fd)
    slurm = {"SLURMD_NODENAME": "gpu001", "SLURM_JOB_ID": "4242", "SLURM_JOB_UID": str(os.getuid()),
             "SLURM_JOB_USER": "root", "SLURM_NODELIST": "gpu001", "SLURM_JOB_NUM_NODES": "1"}
    first = run_hook("epilog", hook_env, slurm)
    assert first.returncode == 0, first.stderr
    assert "could not spool the epilog report" in first.stderr
    assert not list(tiny_spool.glob("4242.*.json"))
    assert record.exists()  # not spooled: the events stay
    filler.unlink()
    second = run_hook("epilog", hook_env, slurm)
    assert second.returncode == 0, second.stderr
    report = json.loads((tiny_spool / "4242.gpu001.epilog.json").read_text())
    assert report["goodput_events"]["launches"][0]["end"]["kind"] == "ok"
    assert not record.exists()  # spooled: now removed
