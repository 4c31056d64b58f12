"""A lost node without a spare, on the REAL dev cluster (issue 19; docs/resilience.md).

One test, two scenarios in a row (each brings up a 2-node DDP job on the 3-node cluster and
SIGKILLs its second node with `slurm/devcluster crash`):

- grow: node3 is free. The supervisor grows the SAME job by node3 (Slurm's
  permit_job_expansion, which the dev cluster sets) and relaunches there from the checkpoint:
  no Slurm requeue (Restarts=0), the end line says which node was grown and how long it took.
- no node free: node3 is held by another job. The grow finds no node by its deadline; the job
  lets go of the dead node and is requeued (Restarts=1), and the end line says why.

The grown node's prolog ran under the helper job's id: `bv archive show JOB` shows it as
that node's, and the node's time series is on the job's efficiency page (issue 28 §2). Both: every attempt's output is in the file (`bv logs --attempt N`), `bv submit --wait` exits
0, `bv status` tells the truth (restarts, final state).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import hostlist
import pytest
import yaml

from tests.conftest import DEVCLUSTER, HOSTILE, REPO, DevCluster
from tests.launch.test_recovery_cluster import (
    BANNER,
    END,
    _finish,
    _output,
    _wait_for,
    grow_problem,
)

pytestmark = pytest.mark.cluster


def ready_to_grow(cluster: DevCluster, tmp_path: Path, deadline_s: float = 15) -> Path:
    """Every node resumed and the cluster idle; a copy of the repo's site.yaml with the grow
    deadline `deadline_s` (its path)."""
    cluster.resume_all()
    cluster.wait_idle(timeout=120)
    data = yaml.safe_load((REPO / "site.yaml").read_text())
    data.setdefault("launch", {})["grow_deadline_s"] = deadline_s
    path = tmp_path / "site-grow.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run_crash(cluster: DevCluster, workdir: Path, site: Path,
               before_crash: list[str] | None = None,
               options: Sequence[str] = ()) -> tuple[str, str, str]:
    """Submit (with `options`), crash the second node at step 9, wait for the end. (output,
    crashed node, job id). `before_crash`: a command run just before the crash."""
    proc = submit_ddp(cluster, workdir, site, steps=24, options=options)
    crashed: str | None = None
    try:
        job, crashed = second_node_at_step_9(workdir, proc)
        if before_crash:
            cluster.run(before_crash)
        cluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        out = _finish(proc, 240)
        assert proc.returncode == 0, out
    finally:
        stop_and_revive(cluster, proc, crashed)
    text = _output(workdir)
    return text, crashed, job


def stop_and_revive(cluster: DevCluster, proc: subprocess.Popen[str], crashed: str | None
                    ) -> None:
    """A crash test's cleanup: its `bv submit --wait` killed if still running, the node it
    crashed (if any still is) revived."""
    if proc.poll() is None:
        proc.kill()
    if crashed is not None:
        cluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)


def submit_ddp(cluster: DevCluster, workdir: Path, site: Path, *, steps: int,
               options: Sequence[str] = ()) -> subprocess.Popen[str]:
    """`bv submit --wait` (with `options`, site file `site`) of a 2-node examples/train_ddp.py,
    one rank a node, 0.4 s a step, a checkpoint every 4 steps, in a new `workdir`."""
    workdir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", "-N", "2", "--procs-per-node",
         "1", *options, str(REPO / "examples" / "train_ddp.py"), "--ckpt-dir", str(workdir / "ckpt"),
         "--steps", str(steps), "--step-s", "0.4", "--ckpt-every", "4"],
        cwd=workdir, env=cluster.environ(BV_SITE=str(site)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def second_node_at_step_9(workdir: Path, proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Once attempt 1 of the job in `workdir` is at step 9: (its job id, its second node),
    the node a test then crashes."""
    _wait_for("step=9 of attempt 1", lambda: "step=9 attempt=1" in _output(workdir), 150,
              proc)
    first = BANNER.search(_output(workdir))
    assert first is not None
    return first.group(2), hostlist.expand_hostlist(first.group(3))[1]


def _check_resumed(cluster: DevCluster, text: str, job: str, crashed: str) -> list[str]:
    """Attempt 2 resumed from the checkpoint on two healthy nodes and finished; both attempts'
    output is in the file and `bv logs --attempt N` gives each. Attempt 2's nodes."""
    banners = BANNER.findall(text)
    assert [b[0] for b in banners] == ["1", "2"], text
    second = hostlist.expand_hostlist(banners[1][2])
    assert len(second) == 2 and crashed not in second, banners
    part2 = text[text.index("==== bv attempt 2 job"):]
    resumed = {int(s) for s in re.findall(r"^rank=\d+ attempt=2 resumed_from_step=(\d+)$",
                                          part2, re.M)}
    assert len(resumed) == 1 and 4 <= min(resumed) <= 12, part2
    assert "step=9 attempt=1" in text and "step=24 attempt=2" in part2
    hosts = set(re.findall(r"^rank=\d+ world_size=2 host=(\S+) ", part2, re.M))
    assert hosts == set(second), part2
    assert END.findall(text)[-1] == ("2", "exit 0")
    one = cluster.bv("logs", job, "--attempt", "1").stdout
    two = cluster.bv("logs", job, "--attempt", "2").stdout
    assert "step=9 attempt=1" in one and "attempt=2" not in one
    assert two.startswith("==== bv attempt 2 job") and "step=24 attempt=2" in two
    return second


@pytest.mark.timeout(900)
def test_lost_node_without_spare_grows_the_job_else_requeues(devcluster: DevCluster,
                                                             tmp_path: Path) -> None:
    site = ready_to_grow(devcluster, tmp_path)
    problem = grow_problem(devcluster)
    if problem is not None:
        # 24.11 and later: bv does not grow there (bluevela/slurm/releases.py); node3 free,
        # the job lets go of the dead node and is requeued, and the end line says why.
        text, crashed, job = _run_crash(devcluster, tmp_path / "nogrow", site)
        _check_resumed(devcluster, text, job, crashed)
        end = END.search(text)
        assert end is not None and end.group(1) == "1"
        assert f"; no node grown ({problem}): the job lets go of {crashed} and is requeued " \
            "by bv" in end.group(2), end.group(2)
        status = json.loads(devcluster.bv("status", job, "--json").stdout)
        assert status["state"] == "COMPLETED" and status["restarts"] == 1, status
        assert not devcluster.run(["squeue", "-h", "-t", "all", "-n", f"bv-grow-{job}", "-o",
                                   "%i"]).stdout.strip()  # no helper job was asked for
        return

    # 1. grow: node3 is free. The job's name and comment look like `scontrol show job` fields
    #    (and a config line): the grow reads none of them as one (issue 23).
    text, crashed, job = _run_crash(devcluster, tmp_path / "grow", site, options=[
        "-J", f"lr = 0.1 Partition=evil NodeList=node9 NumNodes=7 {HOSTILE[0]}",
        "--comment", "x OverSubscribe=YES TimeLimit=1 Features=gpu"])
    second = _check_resumed(devcluster, text, job, crashed)
    end1 = END.search(text)
    assert end1 is not None and end1.group(1) == "1"
    m = re.search(r"\(grown (\S+) in ([\d.]+) s, same job, no Slurm requeue\)", end1.group(2))
    assert m is not None and f"{crashed} lost" in end1.group(2), end1.group(2)
    grown = m.group(1)
    assert grown not in (crashed, "node1") and grown in second, (grown, second)
    assert float(m.group(2)) < 15
    show = devcluster.run(["scontrol", "show", "job", job]).stdout
    assert "Restarts=0" in show and "JobName=lr = 0.1 Partition=evil" in show, show
    # No helper job left (bluevela/launch/grow.py: release_helpers).
    assert devcluster.run(["squeue", "-h", "-t", "all", "-n", f"bv-grow-{job}", "-o",
                           "%i %T"]).stdout.split()[1::2] in ([], ["COMPLETED"],
                                                              ["CANCELLED"]), job
    status = json.loads(devcluster.bv("status", job, "--json").stdout)
    assert status["state"] == "COMPLETED" and status["restarts"] == 0, status
    # bv's attempts: the same job, no Slurm restart, attempt 2 on the grown node, the time.
    ours = status["bv_attempts"]
    assert [(a["attempt"], a["grown"], a["slurm_requeue"]) for a in ours] == [
        (1, grown, False), (2, None, False)], ours
    assert ours[0]["grow_s"] == float(m.group(2)) and ours[1]["ended"] == "exit 0"
    rows = [ln.split("\t") for ln in devcluster.bv("status", job).stdout.splitlines()]
    assert [job, "1", ours[0]["nodes"], f"{grown} in {m.group(2)} s", "no"] in \
        [r[:5] for r in rows], rows
    _check_grown_prolog(devcluster, job, grown)

    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)

    # 2. no node free: node3 is held by another job until the grow has given up.
    blocker = devcluster.run(["sbatch", "--parsable", "-w", "node3", "--exclusive",
                              "-o", "/dev/null", "--wrap", "sleep 600"],
                             cwd=tmp_path).stdout.strip()
    try:
        _wait_for("the blocker running", lambda: "RUNNING" in devcluster.run(
            ["squeue", "-h", "-j", blocker, "-o", "%T"], check=False).stdout, 60)
        text2, crashed2, job2 = _run_crash_with_release(devcluster, tmp_path / "nofree", site,
                                                        blocker)
    finally:
        devcluster.run(["scancel", blocker], check=False)
    _check_resumed(devcluster, text2, job2, crashed2)
    end = END.search(text2)
    assert end is not None and end.group(1) == "1"
    assert "no node grown (no node granted in" in end.group(2), end.group(2)
    assert f"lets go of {crashed2} and is requeued by bv" in end.group(2), end.group(2)
    show = devcluster.run(["scontrol", "show", "job", job2]).stdout
    assert "Restarts=1" in show, show
    status = json.loads(devcluster.bv("status", job2, "--json").stdout)
    assert status["state"] == "COMPLETED" and status["restarts"] == 1, status
    assert "no node grown" in status["attempts"][0]["cause"], status["attempts"]
    ours = status["bv_attempts"]
    assert [(a["attempt"], a["grown"], a["slurm_requeue"]) for a in ours] == [
        (1, None, True), (2, None, False)], ours


def _check_grown_prolog(cluster: DevCluster, job: str, grown: str) -> None:
    """The grown node's prolog ran under the helper job's id (bv-grow-JOB): once both are
    archived, `bv archive show JOB` shows it as that node's prolog, marked (issue 28 §2)."""
    helpers = cluster.run(["squeue", "-h", "-t", "all", "-n", f"bv-grow-{job}", "-o",
                           "%i"]).stdout.split()
    assert len(helpers) == 1, helpers
    for j in (job, helpers[0]):
        cluster.bv("archive", "ingest", "--job", j, "--wait", "60", "--timeout-min", "0")
    shown = json.loads(cluster.bv("archive", "show", job, "--json").stdout)
    nodes = {n["node"]: n for n in shown["nodes"]}
    assert nodes[grown]["prolog"]["grown_via_job"] == int(helpers[0]), nodes[grown]
    assert nodes[grown]["prolog"]["health"]["status"] == "OK"
    assert nodes[grown]["epilog"] is not None and shown["missing_prolog_nodes"] == []
    row = [ln for ln in cluster.bv("archive", "show", job).stdout.splitlines()
           if ln.startswith(grown + "\t")]
    assert len(row) == 1 and f"(grown via job {helpers[0]})" in row[0], row
    # Its time series and telemetry are the job's from the join (the helper's epilog handed
    # the node over: health/state.py take_over).
    assert "job_wall_s" in nodes[grown]["epilog"]["telemetry"], nodes[grown]["epilog"]
    eff = json.loads(cluster.bv("archive", "show", job, "--efficiency", "--json").stdout)
    assert grown in [r["node"] for r in eff["per_node"]], eff["per_node"]
    assert grown not in {m["node"] for m in eff["missing"]
                         if m["why"] == "no time series from this node"}, eff["missing"]


def _run_crash_with_release(cluster: DevCluster, workdir: Path, site: Path,
                            blocker: str) -> tuple[str, str, str]:
    """`_run_crash`, with a watcher that cancels the blocker job once attempt 1 has ended
    (the grow gave up): the requeued job then has node3 to start on."""
    import threading

    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if END.search(_output(workdir)) if workdir.exists() else False:
                cluster.run(["scancel", blocker], check=False)
                return
            stop.wait(0.5)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        return _run_crash(cluster, workdir, site)
    finally:
        stop.set()
        t.join(5)
