"""Elastic shrink on the REAL dev cluster, on whichever Slurm release it runs (issue 34): a
3-node data-parallel job with `--min-nodes 2` loses a node (every process of it SIGKILLed,
slurmd included) and goes on from its checkpoint on the 2 nodes left, in the same allocation
(`--no-kill`: no Slurm requeue), and `bv submit --wait` exits 0.

The same job asks for Slurm 25.11's expedited requeue where the running Slurm takes it
(`bv submit --requeue=expedite`; slurm/devcluster allows it from 25.11): slurmctld records it
(`ExpeditedRequeue=Yes`) and it changes nothing of the shrink. Where the Slurm has none (22.05,
24.11) bv refuses it in one line before sbatch runs, and the job goes without it. One job for
both: the suite's time (tests/run-releases runs this on every built release).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import hostlist
import pytest

from bluevela.slurm.cli_client import parse_config
from bluevela.slurm.releases import expedite_problem
from tests.conftest import DEVCLUSTER, REPO, DevCluster

BANNER = re.compile(r"^==== bv attempt (\d+) job (\d+) nodes (\S+) previous: (.*) ====$", re.M)
END = re.compile(r"^==== bv attempt (\d+) ended: (.*) ====$", re.M)


def _output(cwd: Path) -> str:
    files = sorted(cwd.glob("bv-*.out"))
    return files[0].read_text(errors="replace") if files else ""


def _wait_output(what: str, pattern: str, cwd: Path, proc: subprocess.Popen[str],
                 timeout: float) -> str:
    """The job's output once `pattern` is in it (bounded; the submit must still be running)."""
    deadline = time.monotonic() + timeout
    while True:
        text = _output(cwd)
        if re.search(pattern, text, re.M):
            return text
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"bv submit --wait ended ({proc.returncode}) before {what}:\n"
                                 f"{out}\n{text}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s:\n{text}")
        time.sleep(0.2)


@pytest.mark.timeout(420)
def test_node_crash_shrinks_the_job_with_expedite_where_slurm_has_it(devcluster: DevCluster,
                                                                     tmp_path: Path) -> None:
    devcluster.resume_all()
    devcluster.wait_idle(timeout=120)
    config = parse_config(devcluster.run(["scontrol", "show", "config"]).stdout)
    problem = expedite_problem(config)
    script = str(REPO / "examples" / "train_ddp.py")
    if problem is not None:  # before 25.11: one line, exit 2, no job
        refused = devcluster.bv("submit", "--requeue=expedite", "--no-python-check", script,
                                check=False, cwd=tmp_path)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.strip().splitlines()[-1] == \
            f"bv: error: --requeue=expedite: {problem}"
        assert not list(tmp_path.glob("bv-*.out"))
    expedite = ["--requeue=expedite"] if problem is None else []
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bluevela", "submit", "--wait", *expedite, "-N", "3",
         "--min-nodes", "2", "--procs-per-node", "1", script, "--ckpt-dir", str(ckpt),
         "--steps", "16", "--step-s", "0.4", "--ckpt-every", "4"],
        cwd=tmp_path, env=devcluster.environ(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    crashed: str | None = None
    try:
        text = _wait_output("attempt 1's step 6", r"^step=6 attempt=1$", tmp_path, proc, 240)
        first = BANNER.search(text)
        assert first is not None, text
        job_id, step_nodes = first.group(2), hostlist.expand_hostlist(first.group(3))
        assert len(step_nodes) == 3, text
        show = devcluster.run(["scontrol", "show", "job", job_id]).stdout
        assert ("ExpeditedRequeue=Yes" in show) == (problem is None), show
        crashed = step_nodes[2]  # not the first: the batch script (bv's supervisor) is there
        devcluster.run([sys.executable, str(DEVCLUSTER), "crash", crashed])
        _wait_output("attempt 2", r"^==== bv attempt 2 job", tmp_path, proc, 180)
        devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"bv submit --wait still running:\n{_output(tmp_path)}") from exc
        assert proc.returncode == 0, out + _output(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if crashed is not None:
            devcluster.run([sys.executable, str(DEVCLUSTER), "revive", crashed], check=False)
    text = _output(tmp_path)
    banners = BANNER.findall(text)
    assert [b[0] for b in banners] == ["1", "2"], text
    survivors = [n for n in step_nodes if n != crashed]
    assert hostlist.expand_hostlist(banners[1][2]) == survivors, banners
    previous = banners[1][3]
    assert f"{crashed} lost" in previous, previous
    assert f"relaunching on 2 of 3 nodes ({hostlist.collect_hostlist(survivors)})" in previous, \
        previous
    part2 = text[text.index("==== bv attempt 2 job"):]
    # world size 2 now, resumed from a checkpoint (every 4 steps), not from step 0
    hosts = set(re.findall(r"^rank=\d+ world_size=2 host=(\S+) ", part2, re.M))
    assert hosts == set(survivors), part2
    resumed = {int(s) for s in re.findall(r"^rank=\d+ attempt=2 resumed_from_step=(\d+)$",
                                          part2, re.M)}
    assert len(resumed) == 1 and 4 <= min(resumed) <= 12, part2
    assert "step=16 attempt=2" in part2 and END.findall(text)[-1] == ("2", "exit 0"), part2
    show = devcluster.run(["scontrol", "show", "job", job_id], check=False).stdout
    if show:  # still known to slurmctld (MinJobAge): the shrink was no Slurm requeue
        assert "Restarts=0" in show, show
