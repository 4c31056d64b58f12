"""The efficiency analysis's one pass over a job's series: read a block of nodes at a time,
keep per-(node, GPU, time bin) sums and counts (`Acc`).

Memory is O(nodes x GPUs x bins), not O(samples): a 1,000-node x 8-GPU x 8,640-sample job
needs ~100 MB whatever its length. The series comes from an open series file (`file_source`
over `archive.series_layout.open_series`, the one reader of the layout) or from arrays in
memory (`mem_source`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from bluevela.health.throttle import CLASSES
from bluevela.report.efficiency_model import GPU_METRICS, NODE_METRICS, Thresholds

if TYPE_CHECKING:
    import numpy as np

    from bluevela.archive.series_layout import SeriesFile

MAX_BINS = 288  # 5-minute bins over a day; per-bin sums are what the analysis keeps
_REASONS = "clocks_event_reasons"


class SeriesLike(Protocol):
    """What `analyze` needs of a `bluevela.archive.series_layout.JobSeries`."""

    time: Any
    nodes: list[str]
    gpu: dict[str, Any]
    node: dict[str, Any]
    interval_s: float
    job_id: int


@dataclass
class Source:
    """A job series read a block of nodes at a time (from an open h5py file or from arrays)."""

    job_id: int
    nodes: list[str]
    time: np.ndarray
    interval_s: float
    n_gpus: int
    gpu: dict[str, Any]  # metric -> [N, G, T] dataset or array
    node: dict[str, Any]  # metric -> [N, T]

    def blocks(self, size: int) -> Iterator[tuple[int, int, dict[str, np.ndarray],
                                                  dict[str, np.ndarray]]]:
        import numpy as np

        for n0 in range(0, len(self.nodes), size):
            n1 = min(len(self.nodes), n0 + size)
            g = {k: np.asarray(v[n0:n1], dtype=np.float32) for k, v in self.gpu.items()}
            n = {k: np.asarray(v[n0:n1], dtype=np.float32) for k, v in self.node.items()}
            yield n0, n1, g, n


def file_source(sf: SeriesFile) -> Source:
    """The series of an open file (`archive.series_layout.open_series`: shapes checked)."""
    gpu = {m: sf.gpu[m] for m in (*GPU_METRICS, _REASONS) if m in sf.gpu}
    node = {m: sf.node[m] for m in NODE_METRICS if m in sf.node}
    return Source(sf.job_id, list(sf.nodes), sf.time, sf.interval_s, sf.n_gpus, gpu, node)


def mem_source(series: SeriesLike) -> Source:
    """The series in memory (`read_series`'s `JobSeries`)."""
    import numpy as np

    gpu = {m: v for m, v in series.gpu.items() if m in (*GPU_METRICS, _REASONS)}
    node = {m: v for m, v in series.node.items() if m in NODE_METRICS}
    n_gpus = int(next(iter(gpu.values())).shape[1]) if gpu else 0
    return Source(int(series.job_id), list(series.nodes), np.asarray(series.time, np.float64),
                  float(series.interval_s), n_gpus, gpu, node)


@dataclass
class Acc:
    """Per-bin sums and counts, filled block by block; `starts` are the bins' first samples."""

    starts: np.ndarray  # [B]
    sums: dict[str, np.ndarray]  # gpu metric -> [N, G, B] float64; node metric -> [N, B]
    counts: dict[str, np.ndarray]
    reason_counts: dict[str, np.ndarray]  # throttle class (and "valid") -> [N, G, B]
    idle_counts: np.ndarray  # [N, G, B] samples at or below idle_util_pct
    cpu_thr_counts: np.ndarray  # [N, B] samples with cpu_throttled_pct above the threshold
    energy_j: np.ndarray  # [N, G] sum of power * interval
    act_sum: np.ndarray  # [T] job-wide activity numerator (util or CPU busy)
    act_cnt: np.ndarray  # [T]
    cpu_sum: np.ndarray  # [T]
    cpu_cnt: np.ndarray  # [T]

    @property
    def n_bins(self) -> int:
        return len(self.starts)

    @property
    def bin_len(self) -> np.ndarray:
        """Samples per bin."""
        import numpy as np

        return np.diff(np.append(self.starts, len(self.act_sum)))

    def steady_mean(self, m: str, sb: np.ndarray) -> np.ndarray:
        """Per unit, the mean of metric `m` over the bins `sb`."""
        return div(self.sums[m][..., sb].sum(-1), self.counts[m][..., sb].sum(-1))

    def overall_mean(self, m: str) -> float:
        """The mean of metric `m` over every unit and sample."""
        c = self.counts[m].sum()
        return float(self.sums[m].sum() / c) if c else math.nan


def _bin_starts(t: int) -> np.ndarray:
    import numpy as np

    b = max(1, min(t, MAX_BINS))
    bin_of = (np.arange(t, dtype=np.int64) * b) // max(t, 1)
    return np.searchsorted(bin_of, np.arange(b)).astype(np.int64)


def accumulate(src: Source, th: Thresholds, block_nodes: int) -> Acc:
    """One pass over `src`, `block_nodes` nodes at a time."""
    import numpy as np

    n, g, t = len(src.nodes), src.n_gpus, len(src.time)
    starts = _bin_starts(t)
    b = len(starts)
    gm = [m for m in GPU_METRICS if m in src.gpu]
    nm = [m for m in NODE_METRICS if m in src.node]
    acc = Acc(
        starts=starts,
        sums={m: np.zeros((n, g, b)) for m in gm} | {m: np.zeros((n, b)) for m in nm},
        counts={m: np.zeros((n, g, b), np.uint32) for m in gm}
        | {m: np.zeros((n, b), np.uint32) for m in nm},
        reason_counts={c: np.zeros((n, g, b), np.uint32) for c in CLASSES}
        | {"valid": np.zeros((n, g, b), np.uint32)},
        idle_counts=np.zeros((n, g, b), np.uint32),
        cpu_thr_counts=np.zeros((n, b), np.uint32),
        energy_j=np.zeros((n, g)),
        act_sum=np.zeros(t), act_cnt=np.zeros(t), cpu_sum=np.zeros(t), cpu_cnt=np.zeros(t),
    )
    for n0, n1, gb, nb in src.blocks(block_nodes):
        _fold_gpus(acc, n0, n1, gb, src.interval_s, th)
        _fold_nodes(acc, n0, n1, nb, th)
    return acc


def binsum(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums over the bins starting at `starts`, along the last axis."""
    import numpy as np

    return np.add.reduceat(x, starts, axis=-1)


def div(a: Any, c: Any) -> Any:
    """a / c where c > 0, else NaN."""
    import numpy as np

    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, a / np.maximum(c, 1), np.nan)


def _fold_means(acc: Acc, block: dict[str, np.ndarray], n0: int, n1: int
                ) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Per-bin sums and sample counts of each metric of `block` that `acc` keeps, for nodes
    n0..n1; yields (metric, values, finite mask) for the counts kept beside them."""
    import numpy as np

    for m, x in block.items():
        if m not in acc.sums:
            continue
        ok = np.isfinite(x)
        acc.sums[m][n0:n1] = binsum(np.where(ok, x, 0).astype(np.float64), acc.starts)
        acc.counts[m][n0:n1] = binsum(ok.astype(np.uint32), acc.starts)
        yield m, x, ok


def _fold_gpus(acc: Acc, n0: int, n1: int, gb: dict[str, np.ndarray], interval: float,
               th: Thresholds) -> None:
    import numpy as np

    for m, x, ok in _fold_means(acc, gb, n0, n1):
        if m == "util_pct":
            acc.idle_counts[n0:n1] = binsum((ok & (x <= th.idle_util_pct)).astype(np.uint32),
                                            acc.starts)
            acc.act_sum += np.where(ok, x, 0).sum(axis=(0, 1), dtype=np.float64)
            acc.act_cnt += ok.sum(axis=(0, 1))
        elif m == "power_w":
            acc.energy_j[n0:n1] = np.where(ok, x, 0).sum(axis=2, dtype=np.float64) * interval
    if _REASONS in gb:
        x = gb[_REASONS]
        ok = np.isfinite(x)
        bits = np.where(ok, x, 0).astype(np.int64)
        acc.reason_counts["valid"][n0:n1] = binsum(ok.astype(np.uint32), acc.starts)
        for c, cls in CLASSES.items():
            acc.reason_counts[c][n0:n1] = binsum(((bits & cls.mask) != 0).astype(np.uint32),
                                                 acc.starts)


def _fold_nodes(acc: Acc, n0: int, n1: int, nb: dict[str, np.ndarray],
                th: Thresholds) -> None:
    import numpy as np

    for m, x, ok in _fold_means(acc, nb, n0, n1):
        if m == "cpu_throttled_pct":
            acc.cpu_thr_counts[n0:n1] = binsum(
                (ok & (x > th.cpu_throttled_sample_pct)).astype(np.uint32), acc.starts)
        elif m == "cpu_busy_pct":
            acc.cpu_sum += np.where(ok, x, 0).sum(axis=0, dtype=np.float64)
            acc.cpu_cnt += ok.sum(axis=0)
