"""Recovery inside the job on the REAL dev cluster (bv's supervisor, docs/resilience.md).

- A node dies mid-run (every process in its namespace SIGKILLed, slurmd included): the job
  goes on from its checkpoint on the spare node of the SAME allocation (no Slurm requeue), or
  without a spare is requeued at once without that node; both attempts' output is in the
  file, and `bv submit --wait` exits 0.
- One rank hangs (sleeps forever): the watchdog ends the step within the hang timeout, names
  that rank and its node, and the step is relaunched in the same allocation (no Slurm
  requeue: issue 19); the next attempt finishes. No spare and growth on (site.yaml
  launch.grow_deadline_s): the job grows by the free node in place of the hung rank's, lets
  go of that one, and the end line says so (issue 28 §2; in place when the grow fails:
  tests/launch/test_policy.py, and on stand-ins tests/launch/test_grow.py).

Not timed tests beyond a generous bound on the watchdog; benchmarks/bench_recovery.py measures.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import hostlist
import pytest

from tests.conftest import DATA, DEVCLUSTER, REPO, DevCluster
from tests.goodput_checks import Job, check_crash_ledger, check_fleet, goodput_events

BANNER = re.compile(r"^==== bv attempt (\d+) job (\d+) nodes (\S+) previous: (.*) ====$", re.M)
END = re.compile(r"^==== bv attempt (\d+) ended: (.*) ====$", re.M)
STEP_S = 0.4


def _submit_wait(cluster: DevCluster, cwd: Path, *args: str,
                 site: Path | None = None) -> subprocess.Popen[str]:
    env = cluster.environ(**({"BV_SITE": str(site)} if site else {}))
    return subprocess.Popen([sys.executable, "-m", "bluevela", "submit", "--wait", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(what: str, cond: Callable[[], object], timeout: float,
              proc: subprocess.Popen[str] | None = None) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"bv submit --wait ended ({proc.returncode}) before {what}:\n"
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.1)


def _output(cwd: Path) -> str:
    files = sorted(cwd.glob("bv-*.out"))
    return files[0].read_text(errors="replace") if files else ""


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"bv submit --wait still running after {timeout:.0f} s:\n{out}") from exc
    return out


def _warm_processes(job_id: str) -> list[int]:
    """The job's warm servers and zygotes still running (launch/warm.py), from the host's
    /proc (it sees every node's namespace)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes()
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"bluevela.launch.warm" in cmd and f"\0SLURM_JOB_ID={job_id}\0".encode() in b"\0" + env:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(400)
@pytest.mark.parametrize("spare,warm", [(1, False), (0, False), (1, True)],
                         ids=["spare", "no-spare", "spare-warm"])
def test_node_crash_resumes_from_checkpoint_on_healthy_nodes(devcluster: DevCluster,
                                                             tmp_path: Path, spare: int,
                                                             warm: bool) -> None:
    """spare: a new step in the same allocation (no Slurm requeue). no-spare (the default):
    the job lets go of the dead node and is requeued through Slurm at once. Then the job's
    goodput ledger (tests/goodput_checks.py): the phases, the crash and the re-done work.
    spare-warm: the same with the warm start (launch/warm.py): the relaunch's ranks are
    forked by the survivor's warm parent, none of attempt 1's ranks is in attempt 2, and no
    warm process of the job outlives it."""
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    ckpt = tmp_path / "ckpt"
    with goodput_events(devcluster) as events:
        job = Job(devcluster, tmp_path, events, *(["--env", "BV_WARM_START=1"] if warm else []),
                  "-N", "2", "--spare-nodes", str(spare),
                  "--procs-per-node", "1", str(REPO / "examples" / "train_ddp.py"),
                  "--ckpt-dir", str(ckpt), "--steps", "24", "--step-s", str(STEP_S),
                  "--ckpt-every", "4")
        proc = job.proc
        crashed: str | None = None
        try:
            job.first_attempt(150)
            job.wait_for("step=9 of attempt 1", r"^step=9 attempt=1$", 150)
            first = BANNER.search(job.output())
            assert first is not None
            step_nodes = hostlist.expand_hostlist(first.group(3))
            assert len(step_nodes) == 2
            crashed = step_nodes[1]
            job.output()
            crash_from = time.time()
            devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
            crash = (crash_from, time.time())
            job.wait_for("attempt 2", r"^==== bv attempt 2 job", 120)
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
            out, err = job.finish(240)
            assert proc.returncode == 0, out + err
        finally:
            if proc.poll() is None:
                proc.kill()
            if crashed is not None:
                devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed],
                               check=False)
        text = _output(tmp_path)
        banners = BANNER.findall(text)
        assert [b[0] for b in banners] == ["1", "2"], text
        second_nodes = hostlist.expand_hostlist(banners[1][2])
        assert len(second_nodes) == 2 and crashed not in second_nodes, banners
        assert f"{crashed} lost" in banners[1][3], banners[1][3]
        if spare:
            assert f"(spare {second_nodes[1]})" in banners[1][3], banners[1][3]
        else:
            assert f"lets go of {crashed} and is requeued by bv" in banners[1][3], banners[1][3]
        # Attempt 2 resumed from the checkpoint (every 4 steps) rather than from step 0 ...
        part2 = text[text.index("==== bv attempt 2 job"):]
        resumed = [int(s) for s in re.findall(r"^rank=\d+ attempt=2 resumed_from_step=(\d+)$",
                                              part2, re.M)]
        assert len(resumed) == 2 and len(set(resumed)) == 1 and 4 <= resumed[0] <= 12, part2
        # ... and finished there, on the healthy nodes; attempt 1's output is still in the file.
        assert "step=9 attempt=1" in text and "step=24 attempt=2" in part2
        hosts = set(re.findall(r"^rank=\d+ world_size=2 host=(\S+) ", part2, re.M))
        assert hosts == set(second_nodes), part2
        assert END.findall(text)[-1] == ("2", "exit 0")
        show = devcluster.run(["scontrol", "show", "job", banners[0][1]], check=False).stdout
        if show:  # still known to slurmctld (MinJobAge): a relaunch is not a Slurm restart
            assert f"Restarts={1 - spare}" in show, show
        # The goodput ledger of the same job: one interruption, the crashed node's.
        check_crash_ledger(devcluster, job, crashed=crashed, crash=crash,
                           resumed_from=resumed[0], step_s=STEP_S, spare=spare)
        check_fleet(devcluster, tmp_path, {job.job_id(): "node failure"}, page=False)
    if warm:
        assert f"agent on {second_nodes[0]}: ranks forked by the node's warm parent" in part2, \
            part2
        _wait_for("the job's warm processes to end",
                  lambda: not _warm_processes(banners[0][1]), 60)


def grow_problem(cluster: DevCluster) -> str | None:
    """Why the cluster's Slurm cannot grow a job for bv (None: it can): 22.05 grows; on 24.11
    and later bv does not (bluevela/slurm/releases.py) and falls back, saying why."""
    from bluevela.launch.grow import support_problem
    from bluevela.slurm.cli_client import parse_config

    return support_problem(parse_config(cluster.run(["scontrol", "show", "config"]).stdout))


@pytest.mark.timeout(400)
def test_hung_rank_is_named_and_the_step_relaunched_in_place(devcluster: DevCluster,
                                                            tmp_path: Path) -> None:
    import yaml

    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    hang_timeout = 6.0
    data = yaml.safe_load((REPO / "site.yaml").read_text())
    data.setdefault("launch", {})["grow_deadline_s"] = 15
    site = tmp_path / "site-grow.yaml"
    site.write_text(yaml.safe_dump(data))
    proc = _submit_wait(devcluster, tmp_path, "-N", "2", "--procs-per-node", "1",
                        "--hang-timeout", f"{hang_timeout:g}",
                        str(DATA / "resilience" / "train_ckpt.py"), "--ckpt-dir",
                        str(tmp_path / "ckpt"), "--steps", "10", "--step-time", "0.3", "--ckpt-every", "2",
                        "--hang-rank", "1", "--hang-step", "4", site=site)
    try:
        _wait_for("step=4", lambda: re.search(r"^step=4$", _output(tmp_path), re.M), 150, proc)
        stuck_at = time.monotonic()
        _wait_for("the end of attempt 1", lambda: END.search(_output(tmp_path)), 60, proc)
        ended_after = time.monotonic() - stuck_at
        out = _finish(proc, 240)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
    text = _output(tmp_path)
    # Rank 1 sleeps at step 4; the step is ended within the hang timeout (plus the watchdog's
    # 1 s beats and a loaded 2-core machine's slack), not at the time limit.
    assert ended_after <= hang_timeout + 8, f"ended {ended_after:.1f} s after rank 1 stopped"
    host1 = re.search(r"^rank=1 attempt=1 start_step=0 host=(\S+)$", text, re.M)
    assert host1 is not None, text
    end1 = END.search(text)
    assert end1 is not None and end1.group(1) == "1"
    assert f"hang: rank 1 on {host1.group(1)} stopped first" in end1.group(2), end1.group(2)
    assert "not in a collective" in end1.group(2)
    banners = BANNER.findall(text)
    assert [b[0] for b in banners] == ["1", "2"] and banners[1][3] == end1.group(2)
    problem = grow_problem(devcluster)
    if problem is not None:  # 24.11 and later: no grow; relaunched in place, and it says why
        assert f"; no node grown in place of {host1.group(1)} ({problem}): relaunching on " \
            "the same nodes" in end1.group(2), end1.group(2)
        part2 = text[text.index("==== bv attempt 2 job"):]
        assert "rank=0 done steps=10" in part2, part2
        return
    assert end1.group(2).endswith("same job, no Slurm requeue)"), end1.group(2)
    # No spare, growth on: the free node grown in place of the hung rank's.
    first, second = (hostlist.expand_hostlist(b[2]) for b in banners)
    hung, kept = host1.group(1), [n for n in first if n != host1.group(1)]
    grown = [n for n in second if n not in first]
    assert len(grown) == 1 and hung not in second and kept[0] in second, banners
    assert f"; grown {grown[0]} in place of {hung} (rank 1 hung there): relaunching on " \
        in end1.group(2), end1.group(2)
    # Relaunched in the same allocation, resumed from its checkpoint.
    part2 = text[text.index("==== bv attempt 2 job"):]
    assert re.search(r"^rank=\d attempt=2 start_step=[1-4] ", part2, re.M), part2
    assert "rank=0 done steps=10" in part2
    jobid = banners[0][1]
    show = devcluster.run(["scontrol", "show", "job", jobid], check=False).stdout
    if show:  # still known to slurmctld (MinJobAge)
        assert "Restarts=0" in show, show
        held = re.search(r"^\s*NodeList=(\S+)", show, re.M)
        assert held is not None and hung not in hostlist.expand_hostlist(held.group(1)), show
    # The job let go of the hung node, and no helper job is left.
    assert not devcluster.run(["squeue", "-h", "-t", "PENDING,RUNNING", "-n",
                               f"bv-grow-{jobid}", "-o", "%i"]).stdout.strip()


@pytest.mark.timeout(400)
def test_the_batch_nodes_death_is_in_the_ledger(devcluster: DevCluster, tmp_path: Path) -> None:
    """Issue 28: the node running the batch script and the supervisor dies mid-job. Slurm
    requeues the job; the attempt's goodput events survive on the second node of the step
    (the copy its agent kept) and the ledger names the batch node as the lost node, not "no
    supervisor record" (tests/goodput_checks.py)."""
    from tests.goodput_checks import check_batch_crash_ledger

    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    with goodput_events(devcluster) as events:
        job = Job(devcluster, tmp_path, events, "-N", "2", "--procs-per-node", "1",
                  str(REPO / "examples" / "train_ddp.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                  "--steps", "12", "--step-s", str(STEP_S), "--ckpt-every", "4")
        batch: str | None = None
        try:
            job.first_attempt(150)
            job.wait_for("step=6 of attempt 1", r"^step=6 attempt=1$", 150)
            show = devcluster.run(["scontrol", "show", "job", "-o", job.job_id()]).stdout
            batch = re.search(r"\bBatchHost=(\S+)", show).group(1)  # type: ignore[union-attr]
            crash_from = time.time()
            devcluster.run([sys.executable, str(DEVCLUSTER), "crash", batch])
            crash = (crash_from, time.time())
            job.wait_for("attempt 2 after Slurm's requeue", r"^==== bv attempt 2 job", 200)
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", batch], check=False)
            out, err = job.finish(200)
            assert job.proc.returncode == 0, out + err
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
            if batch is not None:
                devcluster.run([sys.executable, str(DEVCLUSTER), "revive", batch], check=False)
        check_batch_crash_ledger(devcluster, job, batch=batch, crash=crash)
