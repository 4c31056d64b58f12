"""Job efficiency and stragglers from a job's time series (`bv archive show JOB --efficiency`).

Pure analysis over the job's series file (`<archive>/series/<job_id>.h5`, docs/archive.md) and
the job's archive rows (`query.show_job`: node list, epilog telemetry such as `gpu_energy_j`).
It returns plain data (`report/efficiency_model.py`); the terminal summary
(`report/efficiency_text.py`) and the page (`report/efficiency_html.py`) lay it out.

One pass over the file, a block of nodes at a time, keeps per-(node, GPU, time bin) sums and
counts (`report/efficiency_source.py`); the stages over them (`report/efficiency_stages.py`):
the steady state, coverage, GPU and CPU figures, stragglers (`report/efficiency_stragglers.py`),
energy, restarts, per-node rows. See docs/efficiency.md for the figures and thresholds.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bluevela.archive.series_layout import open_series, series_path
from bluevela.errors import ArchiveError
from bluevela.report import efficiency_stages as st
from bluevela.report.efficiency_model import Efficiency, Thresholds, rnd
from bluevela.report.efficiency_source import (
    Acc,
    SeriesLike,
    Source,
    accumulate,
    file_source,
    mem_source,
)
from bluevela.report.efficiency_stragglers import find_stragglers

logger = logging.getLogger(__name__)


def job_efficiency(archive_dir: Path, job_id: int, *, job: dict[str, Any] | None = None,
                   thresholds: Thresholds | None = None, block_nodes: int = 32) -> Efficiency:
    """Efficiency and stragglers of an archived job, from its series file and its rows.

    Args:
        archive_dir: the archive directory.
        job_id: the job.
        job: the job as `query.show_job` returned it (read here when not given).
        thresholds: straggler and idle thresholds.
        block_nodes: nodes read at a time (memory: block_nodes x GPUs x samples x 4 bytes
            per metric).

    Raises:
        ArchiveError: the job is not archived, or has no (readable) time series.
    """
    if job is None:
        from bluevela.archive.query import show_job

        job = show_job(archive_dir, job_id)
    path = series_path(archive_dir, job_id)
    if not path.is_file():
        raise ArchiveError(f"job {job_id} has no time series in the archive (no {path}; the "
                           "node samplers' data reaches it through the epilog and ingest)")
    return efficiency_of_file(path, job, thresholds=thresholds, block_nodes=block_nodes)


def efficiency_of_file(path: Path, job: dict[str, Any] | None = None, *,
                       thresholds: Thresholds | None = None, block_nodes: int = 32
                       ) -> Efficiency:
    """`analyze` over a series file, read a block of `block_nodes` nodes at a time.

    Raises:
        ArchiveError: the file is missing, not a job series, or unreadable.
    """
    with open_series(path) as sf:
        try:
            return _analyze(file_source(sf), job, thresholds or Thresholds(), block_nodes)
        except OSError as exc:  # a damaged chunk
            raise ArchiveError(f"{path}: unreadable ({exc})") from exc


def analyze(series: SeriesLike, job: dict[str, Any] | None = None, *,
            thresholds: Thresholds | None = None) -> Efficiency:
    """Efficiency and stragglers of an in-memory series (`read_series`'s `JobSeries`).

    Args:
        series: the job's series.
        job: the job as `query.show_job` returns it (node list, epilog telemetry); optional.
        thresholds: straggler and idle thresholds.
    """
    return _analyze(mem_source(series), job, thresholds or Thresholds(), 64)


def _analyze(src: Source, job: dict[str, Any] | None, th: Thresholds,
             block_nodes: int) -> Efficiency:
    if not len(src.time) or not src.nodes:
        raise ArchiveError(f"job {src.job_id}: the time series holds no samples")
    acc = accumulate(src, th, block_nodes)
    with warnings.catch_warnings():  # all-NaN rows (absent GPUs, silent nodes) are expected
        warnings.simplefilter("ignore", RuntimeWarning)
        return _evaluate(src, acc, job, th)


def _evaluate(src: Source, acc: Acc, job: dict[str, Any] | None, th: Thresholds
              ) -> Efficiency:
    """The stages, in order, over the per-bin sums."""
    n, g, t = len(src.nodes), src.n_gpus, len(src.time)
    steady = st.steady_state(acc, g, th)
    cov = st.coverage(acc, steady, src.nodes, job, th)
    gpu = st.gpu_figures(acc, steady, cov, th)
    cpu = st.cpu_figures(acc, steady, n)
    notes = []
    if not steady.use_gpu and g and gpu.present.any():
        notes.append("the GPUs were idle throughout: steady state and stragglers from CPU "
                     "figures")
    stragglers = find_stragglers(src.nodes, gpu if steady.use_gpu else None, cov.covered,
                                 cpu, th)
    en = st.energy(acc, gpu, job)
    units = g * n if steady.use_gpu else n
    restarts = st.restart_gaps(src.time, steady, src.interval_s, units, th)
    st.add_requeues(restarts, job, units)
    rows = st.node_rows(src.nodes, cov, gpu, cpu, en, stragglers)
    return Efficiency(
        job_id=src.job_id, interval_s=src.interval_s, n_samples=t,
        t0_unix_s=rnd(src.time[0], 1), duration_s=float(t * src.interval_s),
        nodes=list(src.nodes), n_gpus=g, gpus_present=int(gpu.present.sum()),
        steady=steady.summary(acc, src.time), gpu=st.gpu_summary(acc, gpu), cpu=cpu.summary,
        energy=en.summary, restarts=restarts, idle_gpus=st.idle_gpus(src.nodes, gpu),
        per_node=[asdict(r) for r in rows], stragglers=stragglers, missing=cov.missing,
        notes=notes, thresholds=th,
        bins=st.plot_bins(src, acc, steady, gpu, stragglers))
