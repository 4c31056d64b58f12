"""The node-local checkpoint store on the REAL dev cluster (docs/checkpoints.md): a plain DDP
script (examples/train_store.py) on 2 nodes + 1 spare saves through `runtime.checkpoint_store`
(node-local tier under <tmp>/local/<hostname>, a copy on the partner node over the store's
authenticated TCP transfer, shared storage only at the end). A node of the step is crashed
(every process in its namespace killed) and its node-local directory deleted (the disk goes
with the node); bv's supervisor relaunches the step on the spare in the same allocation, and
there every rank resumes from the newest step, the spare's from the surviving node's copy:
nothing of the shared directory is read (each rank counts its reads of it), and before the
job's end nothing was ever drained there.

How the spare learns where the lost node's copy is: the ranks of the relaunched step gather
their nodes' inventories (and shard servers' addresses) over the job's own process group in
`load_latest`; nothing is handed through the supervisor.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import hostlist
import pytest

from tests.conftest import DEVCLUSTER, REPO, DevCluster
from tests.goodput_checks import goodput_events, ledger

BANNER = re.compile(r"^==== bv attempt (\d+) job (\d+) nodes (\S+) previous: (.*) ====$", re.M)
RESUMED = re.compile(r"^rank=(\d+) attempt=(\d+) host=(\S+) resumed=(-?\d+) source=(\S+) "
                     r"shared_reads=(\d+)$", re.M)


def _output(cwd: Path) -> str:
    files = sorted(cwd.glob("bv-*.out"))
    return files[0].read_text(errors="replace") if files else ""


def _wait(what: str, pattern: str, cwd: Path, proc: subprocess.Popen[str],
          timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, _output(cwd), re.M)
        if m:
            return m
        if proc.poll() is not None:
            raise AssertionError(f"bv submit ended ({proc.returncode}) before {what}:\n"
                                 f"{_output(cwd)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s:\n{_output(cwd)}")
        time.sleep(0.2)


@pytest.mark.timeout(480)
def test_spare_resumes_from_the_partners_copy_without_shared_storage(
        devcluster: DevCluster, tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    with goodput_events(devcluster) as events:
        job = _spare_resumes_from_the_partner(devcluster, tmp_path, events)
        # The goodput ledger from what the job recorded (the stores' datagrams, the
        # supervisor's events, the epilog's report): the stall and the background phase
        # apart, and the tiers the relaunched step resumed from. The crashed node's epilog
        # comes only if it was revived before the job ended: the job is archived without it
        # after a bounded wait (else the spool holds it for --timeout-min).
        devcluster.bv("archive", "ingest", "--job", job, "--wait", "60", "--timeout-min", "0",
                      timeout=150)
        led = ledger(devcluster, job)
    bg = led["checkpoint_background"]
    assert led["checkpoints"] >= 4 and led["checkpoint_stall_s"] > 0, led
    assert bg is not None and bg["saves"] >= 4 and bg["seconds"] > 0, led
    assert led["checkpoint_stall_s"] == led["phases_s"]["checkpoint"]
    assert bg["complete"]["local"] >= 4 and bg["complete"]["partner"] >= 4, bg
    assert bg["complete"]["shared"] >= 1, bg  # the drain at the end
    resumes = [r for r in led["resumes"] if r["attempt"] == 2]
    assert len(resumes) == 1, led["resumes"]
    assert resumes[0]["step"] >= 6 and resumes[0]["skipped"] == 0, resumes
    assert resumes[0]["tiers"] == {"local": 1, "partner": 1, "shared": 0}, resumes
    text = devcluster.bv("archive", "show", job, "--goodput").stdout
    assert "checkpoint background (off the training path):" in text, text
    assert re.search(r"resume in attempt 2 \(restart 0\): step \d+ in .* from node-local x1, "
                     r"partner x1; 0 copies skipped", text), text


def _spare_resumes_from_the_partner(devcluster: DevCluster, tmp_path: Path,
                                    events: Path) -> str:
    """The job of the test above; returns its id."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2", "--spare-nodes", "1",
         "--procs-per-node", "1", str(REPO / "examples" / "train_store.py"),
         "--shared", str(shared), "--local-base", str(local), "--steps", "30",
         "--ckpt-every", "2", "--step-s", "0.4"],
        cwd=tmp_path, env=devcluster.environ(BV_EVENTS_DIR=str(events)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed: str | None = None
    try:
        _wait("the 4th checkpoint", r"^checkpoint step=6 ", tmp_path, proc, 200)
        first = BANNER.search(_output(tmp_path))
        assert first is not None
        crashed = hostlist.expand_hostlist(first.group(3))[1]
        # Nothing has been drained to shared storage: only the node-local tier and the partner
        # copies hold the steps saved so far.
        assert not list(shared.glob("train/step-*")), list(shared.rglob("*"))
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        shutil.rmtree(local / crashed)  # the node's disk is gone with it
        _wait("attempt 2", r"^==== bv attempt 2 job", tmp_path, proc, 150)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out + _output(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        if crashed is not None:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
    text = _output(tmp_path)
    banners = BANNER.findall(text)
    assert [b[0] for b in banners] == ["1", "2"], text
    second = hostlist.expand_hostlist(banners[1][2])
    assert crashed not in second and f"{crashed} lost" in banners[1][3], banners[1]
    part2 = text[text.index("==== bv attempt 2 job"):]
    rows = [m for m in RESUMED.findall(part2) if m[1] == "2"]
    assert len(rows) == 2, part2
    steps = {int(r[3]) for r in rows}
    assert len(steps) == 1 and next(iter(steps)) >= 6, rows
    # Shared storage was neither listed nor read by any rank of the relaunched step.
    assert [r[5] for r in rows] == ["0", "0"], rows
    spare = next(n for n in second if n not in hostlist.expand_hostlist(banners[0][2]))
    by_host = {r[2]: r[4] for r in rows}
    # The rank on the spare had nothing of its own: it fetched its shard from the surviving
    # node (the partner's held copy, or that node's own file when ranks swapped nodes).
    assert by_host[spare].startswith("partner_("), by_host
    summary = re.search(r"^bv ckpt: resumed step (\d+) .*$", part2, re.M)
    assert summary is not None and summary.group(0).endswith("nothing skipped"), part2
    assert re.search(r"^final tiers step=28 local,partner,shared$", part2, re.M), part2
    return banners[0][1]


def _shard(local: Path, node: str, kind: str, step: int, rank: int) -> Path:
    import os

    return (local / node / f"bv-{os.getuid()}" / next(
        p.name for p in (local / node / f"bv-{os.getuid()}").iterdir()) / "train" / kind
        / f"step-{step:08d}" / f"rank-{rank:05d}.bvck")


@pytest.mark.timeout(420)
def test_planted_faults_are_skipped_and_named_end_to_end(devcluster: DevCluster,
                                                         tmp_path: Path) -> None:
    """The job holds after step 6 (drained: every 2nd save). Planted then: the surviving
    node's own shard torn, its copy of the other node's shard with a flipped byte; the other
    node crashed with its disk. The relaunched step must load no torn or corrupt copy: both
    ranks resume step 6 from shared storage, and the summary names both faults."""
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    shared, local, go = tmp_path / "shared", tmp_path / "local", tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2", "--spare-nodes", "1",
         "--procs-per-node", "1", str(REPO / "examples" / "train_store.py"),
         "--shared", str(shared), "--local-base", str(local), "--steps", "12",
         "--ckpt-every", "2", "--drain-every", "2", "--step-s", "0.2", "--hold-at", "6",
         "--hold-file", str(go)],
        cwd=tmp_path, env=devcluster.environ(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    crashed: str | None = None
    try:
        _wait("the hold", r"^holding at step 6$", tmp_path, proc, 200)
        first = BANNER.search(_output(tmp_path))
        assert first is not None
        kept, crashed = hostlist.expand_hostlist(first.group(3))
        rank_of = {m[2]: int(m[0]) for m in RESUMED.findall(_output(tmp_path))}
        mine, other = rank_of[kept], rank_of[crashed]
        torn = _shard(local, kept, "own", 6, mine)
        with open(torn, "r+b") as f:
            f.truncate(torn.stat().st_size - 7)
        flipped = _shard(local, kept, "held", 6, other)
        data = bytearray(flipped.read_bytes())
        data[len(data) // 3] ^= 0x10
        flipped.write_bytes(bytes(data))
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        shutil.rmtree(local / crashed)
        _wait("attempt 2", r"^==== bv attempt 2 job", tmp_path, proc, 150)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out + _output(tmp_path)
    finally:
        go.touch()
        if proc.poll() is None:
            proc.kill()
        if crashed is not None:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
    part2 = _output(tmp_path)[_output(tmp_path).index("==== bv attempt 2 job"):]
    rows = [m for m in RESUMED.findall(part2) if m[1] == "2"]
    # Every rank resumed step 6 (the script checks each loaded value: no corrupt load) from
    # shared storage, the one place left holding a good copy of both shards.
    assert sorted((r[3], r[4]) for r in rows) == [("6", "shared"), ("6", "shared")], part2
    summary = re.search(r"^bv ckpt: resumed step 6 .*$", part2, re.M)
    assert summary is not None, part2
    line = summary.group(0)
    assert f"rank {mine} step 6 local (own copy on this node): torn" in line, line
    assert f"rank {other} step 6 " in line and "corrupt: checksum mismatch" in line, line
    assert line.count("torn") == 1 and line.count("checksum mismatch") == 1, line
    assert re.search(r"^final tiers step=10 local,partner,shared$", part2, re.M), part2
