"""Growing a job in place of a lost node (bluevela/launch/grow.py): the pure parts on output
recorded on the dev cluster (tests/data/README.md), and the supervisor's hang path in place on
its stand-ins (tests/supervisor_standins.py: the REAL supervisor, agents and ranks; stand-in
srun/torchrun/scontrol). The grow itself against Slurm: tests/launch/test_grow_cluster.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import hostlist
import pytest

from bluevela.launch.grow import (
    granted_job,
    helper_name,
    parse_resize,
    run_cli,
    salloc_argv,
    shape_of,
    support_problem,
)
from bluevela.launch.request import SubmitRequest
from bluevela.launch.supervisor import parse_args
from bluevela.slurm.cli_client import JOB_FIELDS, job_fields_argv, parse_config, parse_job_fields
from tests.conftest import DATA
from tests.supervisor_standins import Job

SLURM = DATA / "slurm"


def _jobs() -> dict[str, dict[str, str]]:
    text = (SLURM / "squeue-fields-22.05.txt").read_text()
    return {j: parse_job_fields(text, j) for j in ("10", "11")}


def test_squeue_asks_for_the_recorded_fields() -> None:
    argv = job_fields_argv("10")
    assert argv[:6] == ["squeue", "-h", "-t", "all", "-j", "10"]
    assert argv[7] == "\t".join(code for _, code in JOB_FIELDS)  # what the recording used
    assert JOB_FIELDS[-1][0] == "Features"  # the one the user typed: last, split off last


def test_a_hostile_job_name_is_never_read_as_a_field() -> None:
    """Job 10 is named `lr = 0.1 it's $(id) Partition=evil NodeList=node9 NumNodes=7` (and a
    comment with more): its scontrol line has those words, squeue's fields do not."""
    line = (SLURM / "show-job-o-hostile-22.05.txt").read_text().splitlines()[0]
    assert "Partition=evil NodeList=node9" in line and " = " in line
    fields = _jobs()["10"]
    assert fields["Partition"] == "debug" and fields["NodeList"] == "node1"
    assert fields["NumNodes"] == "1" and fields["OverSubscribe"] == "NO"
    assert fields["TimeLimit"] == "2-00:00:00" and fields["JobState"] == "RUNNING"
    shape = shape_of(fields)
    assert shape.nodes == ["node1"] and shape.partition == "debug" and shape.exclusive
    assert shape.minutes_left == 2 * 24 * 60  # 4 s in
    argv = salloc_argv("10", shape, ["node1"], 15)
    assert "--partition=debug" in argv and not any("evil" in a or "node9" in a for a in argv)
    # Another job's line, a short one, a line of junk: no fields of job 10.
    text = (SLURM / "squeue-fields-22.05.txt").read_text()
    assert parse_job_fields(text, "1") == {} and parse_job_fields("10\tRUNNING\n", "10") == {}
    assert parse_job_fields(line, "10") == {}


def test_shape_of_a_shared_and_an_exclusive_job() -> None:
    jobs = _jobs()
    shared, exclusive = shape_of(jobs["11"]), shape_of(jobs["10"])
    # Job 11: `sbatch -N2 -c1 --mem=100` (OverSubscribe=OK, TimeLimit=UNLIMITED).
    assert shared.partition == "debug" and not shared.exclusive
    assert shared.minutes_left is None and shared.cpus_per_node == 1
    assert shared.account == "" and shared.constraints == "" and shared.qos == ""
    assert shared.mem_per_node == "100M" and shared.gres == ""
    assert shared.nodes == ["node2", "node3"]
    assert exclusive.exclusive and exclusive.mem_per_node == ""


def test_salloc_asks_for_one_node_of_the_same_kind_never_a_lost_one() -> None:
    shape = shape_of(_jobs()["11"])
    argv = salloc_argv("11", shape, ["node2", "node1", "node2"], 15.7)
    assert argv[:2] == ["salloc", "--no-shell"]
    assert "--nodes=1" in argv and "--dependency=expand:11" in argv
    assert "--immediate=15" in argv and "--partition=debug" in argv
    assert "--exclude=node1,node2" in argv and "--exclusive" not in argv
    assert "--mincpus=1" not in argv and "--mem=100M" in argv
    assert f"--job-name={helper_name('11')}" in argv and helper_name("11") == "bv-grow-11"
    assert not any(a.startswith(("--account=", "--time=", "--constraint=")) for a in argv)
    ex = salloc_argv("10", shape_of(_jobs()["10"]), [], 1)
    # Placed for the job's remaining time; no --deadline (it delays the placement to the next
    # scheduling cycle: +1.7 s a grow on the dev cluster).
    assert "--exclusive" in ex and f"--time={2 * 24 * 60}" in ex
    assert not any(a.startswith("--deadline") for a in ex + argv)
    assert not any(a.startswith("--exclude") for a in ex)
    assert "--nodes=2" in salloc_argv("11", shape, ["node2", "node3"], 15, count=2)


def test_a_timed_out_salloc_still_names_its_pending_job(tmp_path: Path) -> None:
    """subprocess.run's TimeoutExpired carries bytes even with text=True: what salloc printed
    before it was killed (the pending job's id) must not be lost (issue 23)."""
    import sys

    script = tmp_path / "salloc"
    script.write_text("import sys, time\n"
                      "sys.stderr.write('salloc: Pending job allocation 4242\\n')\n"
                      "sys.stderr.flush()\ntime.sleep(30)\n")
    t0 = time.monotonic()
    call = run_cli([sys.executable, str(script)], 1.0)
    assert time.monotonic() - t0 < 10
    assert call.timed_out and call.status is None and isinstance(call.stderr, str)
    assert call.why == "timed out after 1 s"
    assert granted_job(call.stderr + call.stdout) == "4242", call.stderr


def test_support_needs_permit_job_expansion() -> None:
    text = (SLURM / "show-config-22.05.txt").read_text()  # the dev cluster sets it
    assert support_problem(parse_config(text)) is None
    off = text.replace(",permit_job_expansion", "")
    assert off != text
    why = support_problem(parse_config(off))
    assert why is not None and "cannot grow jobs" in why and "permit_job_expansion" in why
    assert support_problem({}) is not None


def test_resize_script_and_salloc_output() -> None:
    # Written by `scontrol update JobId=6 NumNodes=0` (the helper job giving its node up).
    env = parse_resize((SLURM / "resize-numnodes0-22.05.sh").read_text())
    assert env == {"SLURM_NODELIST": "", "SLURM_JOB_NODELIST": "", "SLURM_NNODES": "0",
                   "SLURM_JOB_NUM_NODES": "0", "SLURM_JOB_CPUS_PER_NODE": ""}
    grown = 'export SLURM_JOB_NODELIST="node[1,3]"\nexport SLURM_NNODES=2\n'
    assert parse_resize(grown) == {"SLURM_JOB_NODELIST": "node[1,3]", "SLURM_NNODES": "2"}
    # A value with shell characters is not a node list: dropped, never passed on.
    assert parse_resize('export SLURM_NODELIST="$(id)"\nexport SLURM_NNODES=`id`\n') == {}
    assert granted_job("salloc: Granted job allocation 6\n") == "6"
    assert granted_job("salloc: Pending job allocation 9\nsalloc: job 9 queued and waiting "
                       "for resources\nsalloc: error: Unable to allocate resources: Connection "
                       "timed out\n") == "9"
    assert granted_job("salloc: error: Invalid dependency\n") is None


def test_the_site_deadline_reaches_the_supervisor() -> None:
    req = SubmitRequest(nodes=2, script="train.py", grow_deadline=30)
    argv = req.supervisor_argv()
    assert "--grow-deadline=30" in argv
    assert parse_args(argv[4:]).grow_deadline == 30
    assert not any(a.startswith("--grow") for a in SubmitRequest(nodes=2, script="t.py")
                   .supervisor_argv())


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "3601"])
def test_a_bad_grow_deadline_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--nodes=2", f"--grow-deadline={bad}", "--", "torchrun", "t.py"])


# -- the hang path in place (real supervisor, stand-ins) ----------------------------------------

def _wait(job: Job, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, job.stdout(), re.M)
        if m is not None:
            return m
        assert job.running(), job.stdout() + job.stderr()
        assert time.monotonic() < deadline, f"no {pattern!r}:\n{job.stdout()}{job.stderr()}"
        time.sleep(0.1)


@pytest.mark.parametrize(("spare", "grow"), [(0, False), (1, False), (0, True)],
                         ids=["same-nodes", "spare", "grow-refused"])
def test_a_hang_relaunches_in_place_without_a_requeue(tmp_path: Path, spare: int,
                                                      grow: bool) -> None:
    """Every rank stops (mode `stall`): the watchdog ends the step, every node answers the
    abort, and the step is relaunched in the same allocation (on the spare instead of the hung
    rank's node when there is one): no `scontrol requeue`, the job then finishes 0. With growth
    on and no spare, the supervisor tries to grow in place of the hung rank's node; this Slurm
    (the stand-in scontrol) cannot: in place all the same, no node let go (issue 28 §2)."""
    nodes = ("n1", "n2", "n3")[: 2 + spare]
    job = Job(tmp_path, nodes=nodes, mode="stall",
              options=["--nodes=2", f"--spare-nodes={spare}", "--hang-timeout=2",
                       *(["--grow-deadline=10"] if grow else [])])
    for name in ("squeue", "scancel"):  # no helper job to find or cancel
        (job.bin / name).write_text("#!/bin/sh\nexit 0\n")
        (job.bin / name).chmod(0o755)
    try:
        job.start()
        for node in nodes[:2]:
            job.wait_for(f"ready.{node}", 60)
        end = _wait(job, r"^==== bv attempt 1 ended: (.*) ====$", 30).group(1)
        hung = re.search(r"hang: rank \d+ on (\S+) stopped first", end)
        assert hung is not None, end
        banner2 = _wait(job, r"^==== bv attempt 2 job 77 nodes (\S+) previous: (.*) ====$", 30)
        assert banner2.group(2) == end
        if spare:
            assert f"(spare n3 for {hung.group(1)}; no Slurm requeue)" in end, end
            second = hostlist.expand_hostlist(banner2.group(1))
            assert hung.group(1) not in second and "n3" in second and len(second) == 2
        else:
            assert end.endswith("relaunching on the same nodes (n[1-2]; no Slurm requeue)"), end
            assert banner2.group(1) == "n[1-2]"
        if grow:
            assert f"; no node grown in place of {hung.group(1)} (this Slurm cannot grow jobs: " \
                "SchedulerParameters lacks permit_job_expansion" in end, end
            assert job.scontrol() == ["show config"], job.scontrol()
        else:
            assert "grown" not in end, end
        job.finish()  # the relaunched ranks end by themselves
        rc = job.wait(60)
        assert rc == 0, job.stdout() + job.stderr()
        assert "==== bv attempt 2 ended: exit 0 ====" in job.stdout()
        # No requeue, no node let go (a read such as `show job` is not an action).
        assert not [c for c in job.scontrol() if c.split()[0] in ("requeue", "update")], \
            job.scontrol()
    finally:
        job.kill()


@pytest.mark.parametrize("permit", [True, False], ids=["permitted", "not-permitted"])
def test_site_validate_says_when_this_slurm_cannot_grow_jobs(tmp_path: Path,
                                                             permit: bool) -> None:
    """`bv site validate` with launch.grow_deadline_s set asks Slurm (`scontrol show config`,
    here the dev cluster's recorded answer, with or without permit_job_expansion)."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.conftest import REPO

    config = (SLURM / "show-config-22.05.txt").read_text()
    if not permit:
        config = config.replace(",permit_job_expansion", "")
    (tmp_path / "config.txt").write_text(config)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\nexec cat {tmp_path / 'config.txt'}\n")
    scontrol.chmod(0o755)
    data = yaml.safe_load((REPO / "site.yaml").read_text())
    data.setdefault("launch", {})["grow_deadline_s"] = 30
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "bluevela", "site", "validate", str(site)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                               "BV_CACHE_DIR": "off"})
    assert proc.returncode == 0 and ": OK (" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    if permit:
        assert proc.stderr == "", proc.stderr
    else:
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert "this Slurm cannot grow jobs: SchedulerParameters lacks permit_job_expansion" \
            in proc.stderr and "(Slurm 22.05.8)" in proc.stderr, proc.stderr


def test_bv_attempts_show_a_grown_node_and_no_requeue() -> None:
    """What `bv status JOB` adds: bv's own attempts, here a grow, then a requeue, then done."""
    from bluevela.launch.attempts import banner, bv_attempts, end_line

    grew = ("node2 lost (its agent's connection closed: the node or its processes died); "
            "relaunching on node[1,3] (grown node3 in 3.1 s, same job, no Slurm requeue)")
    gave_up = ("node3 lost (silent for 10 s (no agent ping)); no spare node (--spare-nodes) and "
               "no shrink (--min-nodes); no node grown (no node granted in 15 s (salloc: "
               "error: Unable to allocate resources: Connection timed out)): the job lets go "
               "of node3 and is requeued by bv")
    text = "\n".join([banner(1, "5", ["node1", "node2"], "none"), "step=9 attempt=1",
                      end_line(1, grew), banner(2, "5", ["node1", "node3"], grew),
                      end_line(2, gave_up), banner(3, "5", ["node1", "node2"], gave_up),
                      "step=24 attempt=3", end_line(3, "exit 0"), ""])
    got = bv_attempts(text)
    assert [(a["attempt"], a["nodes"], a["grown"], a["grow_s"], a["slurm_requeue"])
            for a in got] == [(1, "node[1-2]", "node3", 3.1, False),
                              (2, "node[1,3]", None, None, True),
                              (3, "node[1-2]", None, None, False)]
    assert got[2]["ended"] == "exit 0"
