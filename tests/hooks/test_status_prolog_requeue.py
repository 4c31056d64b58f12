"""`bv status` on a job a node's prolog sent back to PENDING (issue 35): the attempt never
reached bv's supervisor, so the output file has no banner for it, and the attempts table showed
`REQUEUED` with no cause (and with fewer banners than attempts, bv named no cause at all). The
attempt is now named for what most likely happened. The Slurm record below is what the dev
cluster's Slurm 22.05.8 gave for a 2-node job whose node2 prolog failed (ib port down): the
first attempt REQUEUED 3 s after its start, the second PENDING with reason BeginTime."""

from __future__ import annotations

from pathlib import Path

from bluevela.launch.attempts import banner, end_line
from bluevela.launch.logs import NEVER_STARTED, with_causes
from bluevela.slurm.client import AttemptRecord, JobInfo
from bluevela.slurm.states import JobState


def _info(out: Path, *, second: JobState = JobState.COMPLETED) -> JobInfo:
    first = AttemptRecord(1, JobState.REQUEUED, "REQUEUED", None, ("node1", "node2"),
                          1795941213, 1795941216)
    last = AttemptRecord(2, second, second.value, 0, ("node1", "node3"), 1795941252,
                         1795941290)
    return JobInfo(10, second, second.value, 0, None, ("node1", "node3"), name="train_ddp",
                   user="root", stdout=str(out), work_dir=str(out.parent), restarts=1,
                   requeue=True, attempts=(first, last))


def test_an_attempt_the_prolog_refused_is_named(tmp_path: Path) -> None:
    out = tmp_path / "bv-10.out"
    out.write_text(banner(1, "10", ["node1", "node3"], "") + "\nstep=1\n"
                   + end_line(1, "exit 0") + "\n")
    info = with_causes(_info(out))
    assert info.attempts[0].cause == NEVER_STARTED
    assert "prolog" in NEVER_STARTED and "bv health nodes" in NEVER_STARTED
    assert info.attempts[1].cause == ""  # fewer banners: the ran attempt is not guessed


def test_a_requeue_after_a_real_start_is_not_relabelled(tmp_path: Path) -> None:
    """Two banners for two attempts: the causes come from bv's own lines, as before."""
    out = tmp_path / "bv-10.out"
    out.write_text(banner(1, "10", ["node1", "node2"], "") + "\n"
                   + end_line(1, "checkpoint signal, requeued by bv") + "\n"
                   + banner(2, "10", ["node1", "node3"], "checkpoint signal") + "\n"
                   + end_line(2, "exit 0") + "\n")
    info = with_causes(_info(out))
    assert info.attempts[0].cause == "checkpoint signal, requeued by bv"
