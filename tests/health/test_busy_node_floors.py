"""Issue 24: on a busy node the node check's memory and free-space floors judge the totals.

Free memory and free disk while a job runs are the job's use, not a node fault: the
healthcheck slurmd runs at a restart under jobs, or a prolog on a shared node, must not drain
for them. The facts are this machine's own (/proc/meminfo, statvfs of /tmp), the floors are
set between what is free and what there is in all, and the running job is a real stand-in
slurmstepd (tests/health/test_busy_node.py's) read from the real /proc by health/jobprocs.py.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from bluevela.health.checks import get_check
from bluevela.health.context import ProbeContext
from bluevela.health.jobprocs import running_jobs
from bluevela.health.result import CheckResult, Status
from bluevela.site import NodeClass, load_site
from tests.health.test_busy_node import JOB, job  # noqa: F401 - the stand-in job fixture

REPO = Path(__file__).resolve().parents[2]
GIB = float(1 << 30)


def _between() -> tuple[float, float, float, float]:
    """(available, total) memory and (free, size) of /tmp, in GiB, from this machine."""
    kib = {k: int(v.split()[0]) for k, _, v in
           (line.partition(":") for line in Path("/proc/meminfo").read_text().splitlines())}
    avail, total = kib["MemAvailable"] * 1024, kib["MemTotal"] * 1024
    st = os.statvfs("/tmp")
    return (avail / GIB, total / GIB, st.f_bavail * st.f_frsize / GIB,
            st.f_blocks * st.f_frsize / GIB)


def _cls(mem_gib: float, tmp_gib: float) -> NodeClass:
    cpu = load_site(REPO / "site.yaml").node_class(name="cpu")
    return replace(cpu, node=replace(cpu.node, min_mem_available_gib=mem_gib,
                                     min_free_gib={"/tmp": tmp_gib}))


def _run(cls: NodeClass, phase: str = "healthcheck", job_id: int | None = None) -> CheckResult:
    ctx = ProbeContext(cls, "cpu", root=Path("/"), phase=phase, job_id=job_id)
    return get_check("node").run_once(ctx)


def _floors() -> NodeClass:
    """Floors above what is free now, below what there is in all."""
    avail, total, free, size = _between()
    if total - avail < 0.2 or size - free < 0.2:
        pytest.skip("this machine's memory or /tmp is nearly all free: no floor fits between")
    return _cls((avail + total) / 2, (free + size) / 2)


def test_an_idle_node_judges_what_is_free() -> None:
    if running_jobs(Path("/")).ids:
        pytest.skip("the suite runs inside a Slurm job here: this node is busy")
    r = _run(_floors())
    assert r.status is Status.CRITICAL, r
    assert "GiB memory available <" in r.summary and "/tmp" in r.summary and "GiB free <" in r.summary


def test_a_busy_node_judges_totals_not_the_jobs_use(job: tuple[int, int]) -> None:  # noqa: F811
    """A running job: the same floors pass (the free memory and disk are the job's use), and the
    summary says what was judged; 9058adc drained it ("memory available <")."""
    r = _run(_floors())
    assert r.status is Status.OK, r
    assert f"job {JOB}" in r.summary and "judged on totals" in r.summary, r.summary
    # The prolog of a second job on a shared node: the other job makes it busy too.
    assert _run(_floors(), "prolog", job_id=JOB + 1).status is Status.OK
    # The hook's own job does not: its prolog judges what is free.
    own = _run(_floors(), "prolog", job_id=JOB)
    if not running_jobs(Path("/")).others(JOB):
        assert own.status is Status.CRITICAL, own


def test_a_busy_node_that_lost_memory_or_disk_is_still_critical(
        job: tuple[int, int]) -> None:  # noqa: F811
    """Floors above the totals: no job explains that (a DIMM gone, a file system too small)."""
    _, total, _, size = _between()
    r = _run(_cls(total + 1.0, size + 1.0))
    assert r.status is Status.CRITICAL, r
    assert "GiB memory in all <" in r.summary and "GiB in all <" in r.summary, r.summary
