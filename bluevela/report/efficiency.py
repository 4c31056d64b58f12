"""Job efficiency and stragglers from a job's time series (`bv archive show JOB --efficiency`).

Pure analysis over the job's series file (`<archive>/series/<job_id>.h5`, docs/archive.md) and
the job's archive rows (`query.show_job`: node list, epilog telemetry such as `gpu_energy_j`).

One pass over the file, a block of nodes at a time (the file is chunked per node), keeps only
per-(node, GPU, time bin) sums and counts (`_Acc`): memory is O(nodes x GPUs x bins), not
O(samples); a 1,000-node x 8-GPU x 8,640-sample job needs ~100 MB whatever its length.
From those:

- the job's steady state: time bins where the job-wide activity (mean GPU utilisation, or CPU
  busy on nodes without GPUs) is at least `steady_frac` of its 90th percentile over the job
  (start-up, restarts and the tail are left out);
- per GPU and per node, means over the steady state; the job's median and MAD (scaled by
  1.4826) over all its (non-idle) GPUs or nodes; a unit is a straggler on a metric when it is
  below the median by more than `mad_k` MADs AND by a minimum effect (`Thresholds`), or when a
  HW throttle reason / CPU cgroup throttling is present in a minimum share of its steady samples
  while the job's median share is near zero. Every straggler comes with its evidence as text.

See docs/efficiency.md for the figures and thresholds.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bluevela.errors import ArchiveError
from bluevela.report import page

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

# NVML clocks event (throttle) reason bits (nvmlClocksEventReason*).
REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8,
    "sync_boost": 0x10, "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
# The reasons that make a GPU a straggler when one GPU shows them and the job does not.
# (SW power cap is normal at full load and is reported, not flagged.)
THROTTLE_CLASSES: dict[str, tuple[int, str]] = {
    "hw_slowdown": (0x8, "HW slowdown"),
    "thermal": (0x20 | 0x40, "thermal slowdown"),
    "hw_power_brake": (0x80, "HW power brake"),
    "sw_power_cap": (0x4, "SW power cap"),
}
_FLAGGED_CLASSES = ("hw_slowdown", "thermal", "hw_power_brake")
GPU_METRICS = ("util_pct", "power_w", "sm_clock_mhz", "temp_c")
NODE_METRICS = ("cpu_busy_pct", "cpu_throttled_pct")
MAX_BINS = 288  # 5-minute bins over a day; per-bin sums are what the analysis keeps
_MAD_SCALE = 1.4826


@dataclass(frozen=True)
class Thresholds:
    """When a GPU or node is named a straggler, and what counts as idle or a restart gap."""

    mad_k: float = 4.0  # robust z: below median - mad_k * 1.4826 * MAD ...
    util_min_drop_pct: float = 10.0  # ... and at least this many utilisation points lower
    power_min_drop_rel: float = 0.15  # ... power at least 15 % below the job's median
    power_min_drop_w: float = 20.0  # ... and at least 20 W
    clock_min_drop_rel: float = 0.10  # ... SM clock at least 10 % below the median
    throttle_min_share: float = 0.10  # HW throttle reason in >= 10 % of steady samples ...
    throttle_max_median_share: float = 0.02  # ... while the job's median share is <= 2 %
    cpu_throttled_sample_pct: float = 5.0  # a sample with > 5 % of its interval throttled ...
    cpu_throttled_min_share: float = 0.20  # ... in >= 20 % of steady samples (job median <=)
    cpu_busy_min_drop_pct: float = 20.0  # CPU busy at least 20 points below the median
    idle_util_pct: float = 2.0  # a GPU sample at or below this is idle
    idle_min_share: float = 0.90  # idle GPU: idle in >= 90 % of its steady samples
    steady_frac: float = 0.5  # steady state: activity >= 50 % of its 90th percentile
    gap_activity_frac: float = 0.1  # restart gap: activity < 10 % of its 90th percentile ...
    gap_min_s: float = 60.0  # ... for at least this long (shorter: a stall, e.g. a checkpoint)
    min_coverage: float = 0.5  # a unit with samples in < 50 % of the steady state: no verdict
    min_peers: int = 3  # fewer units than this with data: no comparison


# --------------------------------------------------------------------------------- sources


class SeriesLike(Protocol):
    """What `analyze` needs of a `bluevela.archive.series.JobSeries`."""

    time: Any
    nodes: list[str]
    gpu: dict[str, Any]
    node: dict[str, Any]
    interval_s: float
    job_id: int


@dataclass
class _Source:
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


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _h5_source(f: Any, path: Path) -> _Source:
    import numpy as np

    try:
        if f.attrs.get("format") not in ("bluevela-job-series", b"bluevela-job-series"):
            raise ArchiveError(f"{path}: not a bluevela job series file")
        time = np.asarray(f["time"][()], dtype=np.float64)
        nodes = [_text(n).rstrip("\x00") for n in f["nodes"][()]]
        gpu = {m: f[f"gpu/{m}"] for m in (*GPU_METRICS, "clocks_event_reasons")
               if f"gpu/{m}" in f}
        node = {m: f[f"node/{m}"] for m in NODE_METRICS if f"node/{m}" in f}
        n_gpus = int(next(iter(gpu.values())).shape[1]) if gpu else 0
        interval = float(f.attrs["interval_s"])
        job_id = int(f.attrs["job_id"])
    except (KeyError, ValueError, TypeError, OSError) as exc:
        raise ArchiveError(f"{path}: not a readable job series ({exc})") from exc
    n, t = len(nodes), len(time)
    for name, ds, want in [*((f"gpu/{m}", d, (n, n_gpus, t)) for m, d in gpu.items()),
                           *((f"node/{m}", d, (n, t)) for m, d in node.items())]:
        if tuple(ds.shape) != want:
            raise ArchiveError(f"{path}: /{name} has shape {tuple(ds.shape)}, expected {want}")
    if not (math.isfinite(interval) and interval > 0):
        raise ArchiveError(f"{path}: interval_s {interval} is not a positive number")
    return _Source(job_id, nodes, time, interval, n_gpus, gpu, node)


def _mem_source(series: SeriesLike) -> _Source:
    import numpy as np

    gpu = {m: v for m, v in series.gpu.items() if m in (*GPU_METRICS, "clocks_event_reasons")}
    node = {m: v for m, v in series.node.items() if m in NODE_METRICS}
    n_gpus = int(next(iter(gpu.values())).shape[1]) if gpu else 0
    return _Source(int(series.job_id), list(series.nodes), np.asarray(series.time, np.float64),
                   float(series.interval_s), n_gpus, gpu, node)


def series_path(archive_dir: Path, job_id: int) -> Path:
    """Where ingest puts a job's series (`bluevela.archive.series`; docs/archive.md)."""
    from bluevela.archive import series

    return series.series_path(Path(archive_dir), int(job_id))


# --------------------------------------------------------------------------------- result


@dataclass
class Straggler:
    """One GPU (gpu >= 0), all GPUs of a node (gpu None, all_gpus True) or a node's CPU."""

    node: str
    gpu: int | None
    evidence: str
    metrics: dict[str, dict[str, float | None]]  # metric -> {value, job_median, ...}
    score: float  # how far out (robust z or share); for sorting

    @property
    def label(self) -> str:
        return self.node if self.gpu is None else f"{self.node} GPU {self.gpu}"


@dataclass
class Efficiency:
    """The analysis of one job. `to_dict()` is the `--json` form; `bins` feeds the HTML."""

    job_id: int
    interval_s: float
    n_samples: int
    t0_unix_s: float | None
    duration_s: float
    nodes: list[str]
    n_gpus: int  # per node (max)
    gpus_present: int
    steady: dict[str, Any]
    gpu: dict[str, Any]
    cpu: dict[str, Any]
    energy: dict[str, Any]
    restarts: dict[str, Any]
    idle_gpus: list[dict[str, Any]]
    per_node: list[dict[str, Any]]
    stragglers: list[Straggler]
    missing: list[dict[str, Any]]
    notes: list[str]
    thresholds: Thresholds
    bins: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def straggler_nodes(self) -> list[str]:
        return sorted({s.node for s in self.stragglers})

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "interval_s": self.interval_s, "n_samples": self.n_samples,
            "t0_unix_s": self.t0_unix_s, "duration_s": self.duration_s,
            "nodes": len(self.nodes), "gpus_per_node": self.n_gpus,
            "gpus": self.gpus_present, "steady": self.steady, "gpu": self.gpu,
            "cpu": self.cpu, "energy": self.energy, "restarts": self.restarts,
            "idle_gpus": self.idle_gpus, "per_node": self.per_node,
            "stragglers": [{"node": s.node, "gpu": s.gpu, "evidence": s.evidence,
                            "metrics": s.metrics} for s in self.stragglers],
            "missing": self.missing, "notes": self.notes,
            "thresholds": asdict(self.thresholds),
        }


# --------------------------------------------------------------------------------- analysis


@dataclass
class _Acc:
    """Per-bin sums and counts, filled block by block."""

    sums: dict[str, np.ndarray]  # gpu metric -> [N, G, B] float64; node metric -> [N, B]
    counts: dict[str, np.ndarray]
    reason_counts: dict[str, np.ndarray]  # throttle class -> [N, G, B]
    idle_counts: np.ndarray  # [N, G, B] samples at or below idle_util_pct
    cpu_thr_counts: np.ndarray  # [N, B] samples with cpu_throttled_pct above the threshold
    energy_j: np.ndarray  # [N, G] sum of power * interval
    act_sum: np.ndarray  # [T] job-wide activity numerator (util or CPU busy)
    act_cnt: np.ndarray  # [T]
    cpu_sum: np.ndarray  # [T]
    cpu_cnt: np.ndarray  # [T]


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
        ArchiveError: the file is missing or not a job series.
    """
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ArchiveError(f"cannot open {path}: {exc}") from exc
    with f:
        src = _h5_source(f, path)
        try:
            return _analyze(src, job, thresholds or Thresholds(), block_nodes)
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
    return _analyze(_mem_source(series), job, thresholds or Thresholds(), 64)


def _bin_layout(t: int) -> tuple[int, np.ndarray]:
    import numpy as np

    b = max(1, min(t, MAX_BINS))
    bin_of = (np.arange(t, dtype=np.int64) * b) // max(t, 1)
    starts = np.searchsorted(bin_of, np.arange(b)).astype(np.int64)
    return b, starts


def _analyze(src: _Source, job: dict[str, Any] | None, th: Thresholds,
             block_nodes: int) -> Efficiency:
    import numpy as np

    n, g, t = len(src.nodes), src.n_gpus, len(src.time)
    if t == 0 or n == 0:
        raise ArchiveError(f"job {src.job_id}: the time series holds no samples")
    b, starts = _bin_layout(t)
    acc = _Acc(
        sums={m: np.zeros((n, g, b)) for m in GPU_METRICS if m in src.gpu}
        | {m: np.zeros((n, b)) for m in NODE_METRICS if m in src.node},
        counts={m: np.zeros((n, g, b), np.uint32) for m in GPU_METRICS if m in src.gpu}
        | {m: np.zeros((n, b), np.uint32) for m in NODE_METRICS if m in src.node},
        reason_counts={c: np.zeros((n, g, b), np.uint32) for c in THROTTLE_CLASSES}
        | {"valid": np.zeros((n, g, b), np.uint32)},
        idle_counts=np.zeros((n, g, b), np.uint32),
        cpu_thr_counts=np.zeros((n, b), np.uint32),
        energy_j=np.zeros((n, g)),
        act_sum=np.zeros(t), act_cnt=np.zeros(t), cpu_sum=np.zeros(t), cpu_cnt=np.zeros(t),
    )
    for n0, n1, gb, nb in src.blocks(block_nodes):
        _fold_block(acc, n0, n1, gb, nb, starts, src.interval_s, th)
    with warnings.catch_warnings():  # all-NaN rows (absent GPUs, silent nodes) are expected
        warnings.simplefilter("ignore", RuntimeWarning)
        return _evaluate(src, acc, job, th, b, starts)


def _binsum(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    import numpy as np

    return np.add.reduceat(x, starts, axis=-1)


def _fold_mean(acc: _Acc, m: str, x: np.ndarray, n0: int, n1: int,
               starts: np.ndarray) -> np.ndarray:
    """Per-bin sums and sample counts of metric `m` for nodes n0..n1; returns the finite mask."""
    import numpy as np

    ok = np.isfinite(x)
    acc.sums[m][n0:n1] = _binsum(np.where(ok, x, 0).astype(np.float64), starts)
    acc.counts[m][n0:n1] = _binsum(ok.astype(np.uint32), starts)
    return ok


def _fold_block(acc: _Acc, n0: int, n1: int, gb: dict[str, np.ndarray],
                nb: dict[str, np.ndarray], starts: np.ndarray, interval: float,
                th: Thresholds) -> None:
    import numpy as np

    for m, x in gb.items():
        if m not in acc.sums:
            continue
        ok = _fold_mean(acc, m, x, n0, n1, starts)
        if m == "util_pct":
            acc.idle_counts[n0:n1] = _binsum((ok & (x <= th.idle_util_pct)).astype(np.uint32),
                                             starts)
            acc.act_sum += np.where(ok, x, 0).sum(axis=(0, 1), dtype=np.float64)
            acc.act_cnt += ok.sum(axis=(0, 1))
        elif m == "power_w":
            acc.energy_j[n0:n1] = np.where(ok, x, 0).sum(axis=2, dtype=np.float64) * interval
    if "clocks_event_reasons" in gb:
        x = gb["clocks_event_reasons"]
        ok = np.isfinite(x)
        bits = np.where(ok, x, 0).astype(np.int64)
        acc.reason_counts["valid"][n0:n1] = _binsum(ok.astype(np.uint32), starts)
        for c, (mask, _) in THROTTLE_CLASSES.items():
            acc.reason_counts[c][n0:n1] = _binsum(((bits & mask) != 0).astype(np.uint32), starts)
    for m, x in nb.items():
        if m not in acc.sums:
            continue
        ok = _fold_mean(acc, m, x, n0, n1, starts)
        if m == "cpu_throttled_pct":
            acc.cpu_thr_counts[n0:n1] = _binsum(
                (ok & (x > th.cpu_throttled_sample_pct)).astype(np.uint32), starts)
        elif m == "cpu_busy_pct":
            acc.cpu_sum += np.where(ok, x, 0).sum(axis=0, dtype=np.float64)
            acc.cpu_cnt += ok.sum(axis=0)


def _div(a: Any, c: Any) -> Any:
    import numpy as np

    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, a / np.maximum(c, 1), np.nan)


def _r(v: Any, nd: int = 1) -> float | None:
    """A JSON-friendly rounded float (None for NaN)."""
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) or math.isinf(f) else round(f, nd)


def _evaluate(src: _Source, acc: _Acc, job: dict[str, Any] | None, th: Thresholds, b: int,
              starts: np.ndarray) -> Efficiency:
    import numpy as np

    n, g, t = len(src.nodes), src.n_gpus, len(src.time)
    interval = src.interval_s
    notes: list[str] = []
    bin_len = np.diff(np.append(starts, t))  # samples per bin

    # --- job-wide activity: GPU utilisation when the GPUs did anything, else CPU busy
    util_mean = float(acc.act_sum.sum() / acc.act_cnt.sum()) if acc.act_cnt.sum() else math.nan
    use_gpu = g > 0 and "util_pct" in acc.sums and not math.isnan(util_mean) and \
        util_mean > th.idle_util_pct
    act = _div(acc.act_sum, acc.act_cnt) if use_gpu else _div(acc.cpu_sum, acc.cpu_cnt)
    basis = "GPU utilisation" if use_gpu else "CPU busy"
    if not use_gpu and not np.isfinite(act).any():
        act = np.where(acc.act_cnt > 0, 0.0, np.nan)
        basis = "GPU utilisation"
    act_bins = _div(_binsum(np.nan_to_num(act), starts), _binsum(np.isfinite(act).astype(int),
                                                                  starts))
    p90 = float(np.nanpercentile(act, 90)) if np.isfinite(act).any() else math.nan
    if math.isnan(p90) or p90 <= 0:
        steady_bins = np.isfinite(act_bins)
    else:
        steady_bins = np.isfinite(act_bins) & (act_bins >= th.steady_frac * p90)
    if not steady_bins.any():
        steady_bins = np.ones(b, bool)
    steady_samples = int(bin_len[steady_bins].sum())
    sb = steady_bins

    def steady_mean(m: str) -> np.ndarray:
        return _div(acc.sums[m][..., sb].sum(-1), acc.counts[m][..., sb].sum(-1))

    def overall_mean(m: str) -> float:
        c = acc.counts[m].sum()
        return float(acc.sums[m].sum() / c) if c else math.nan

    # --- coverage and missing nodes
    cov_metric = "util_pct" if use_gpu else ("cpu_busy_pct" if "cpu_busy_pct" in acc.counts
                                             else None)
    if cov_metric is not None:
        cnt = acc.counts[cov_metric][..., sb].sum(-1)
        node_cov = (cnt.max(axis=1) if cnt.ndim == 2 else cnt) / max(steady_samples, 1)
    else:
        node_cov = np.ones(n)
    missing: list[dict[str, Any]] = []
    expected = list((job or {}).get("nodelist") or []) or \
        [x["node"] for x in (job or {}).get("nodes") or [] if x.get("expected", True)]
    for name in sorted(set(expected) - set(src.nodes)):
        missing.append({"node": name, "coverage": 0.0, "why": "no time series from this node"})
    for i, name in enumerate(src.nodes):
        if node_cov[i] < th.min_coverage:
            missing.append({"node": name, "coverage": _r(node_cov[i], 3),
                            "why": f"samples in {node_cov[i]:.0%} of the steady state"})
    covered = node_cov >= th.min_coverage

    # --- per-GPU steady figures
    gpu_present = np.zeros((n, g), bool)
    util_s = power_s = clock_s = temp_s = np.full((n, g), np.nan)
    idle_share = np.full((n, g), np.nan)
    shares: dict[str, np.ndarray] = {}
    if g:
        if "util_pct" in acc.counts:
            gpu_present = acc.counts["util_pct"].sum(-1) > 0
        elif "power_w" in acc.counts:
            gpu_present = acc.counts["power_w"].sum(-1) > 0
        if "util_pct" in acc.sums:
            util_s = steady_mean("util_pct")
            idle_share = _div(acc.idle_counts[..., sb].sum(-1),
                              acc.counts["util_pct"][..., sb].sum(-1))
        if "power_w" in acc.sums:
            power_s = steady_mean("power_w")
        if "sm_clock_mhz" in acc.sums:
            clock_s = steady_mean("sm_clock_mhz")
        if "temp_c" in acc.sums:
            temp_s = steady_mean("temp_c")
        valid = acc.reason_counts["valid"][..., sb].sum(-1)
        for c in THROTTLE_CLASSES:
            shares[c] = _div(acc.reason_counts[c][..., sb].sum(-1), valid)
    idle = gpu_present & (idle_share >= th.idle_min_share) if use_gpu else \
        np.zeros((n, g), bool)
    if not use_gpu and g and gpu_present.any():
        notes.append("the GPUs were idle throughout: steady state and stragglers from CPU "
                     "figures")
    pool = gpu_present & ~idle & covered[:, None]

    stragglers: list[Straggler] = []
    if use_gpu:
        stragglers += _gpu_stragglers(src.nodes, pool, util_s, power_s, clock_s, temp_s,
                                      shares, th)
    cpu_busy_s = steady_mean("cpu_busy_pct") if "cpu_busy_pct" in acc.sums else np.full(n, np.nan)
    cpu_thr_s = steady_mean("cpu_throttled_pct") if "cpu_throttled_pct" in acc.sums else \
        np.full(n, np.nan)
    cpu_thr_share = _div(acc.cpu_thr_counts[:, sb].sum(-1),
                         acc.counts["cpu_throttled_pct"][:, sb].sum(-1)) \
        if "cpu_throttled_pct" in acc.counts else np.full(n, np.nan)
    stragglers += _cpu_stragglers(src.nodes, covered, cpu_busy_s, cpu_thr_s, cpu_thr_share, th)
    stragglers.sort(key=lambda s: (-s.score, s.node, -1 if s.gpu is None else s.gpu))

    # --- energy
    tel = _epilog_telemetry(job)
    node_energy = acc.energy_j.sum(axis=1) if g and "power_w" in acc.sums else np.full(n, np.nan)
    epilog_energy = {k: v["gpu_energy_j"] for k, v in tel.items() if "gpu_energy_j" in v}
    power_cov = (acc.counts["power_w"].sum() / max(int(gpu_present.sum()) * t, 1)
                 if g and "power_w" in acc.counts else 0.0)
    energy = {
        "series_j": _r(np.nansum(node_energy), 0) if g and "power_w" in acc.sums else None,
        "series_kwh": _r(np.nansum(node_energy) / 3.6e6, 3) if g and "power_w" in acc.sums
        else None,
        "series_coverage": _r(power_cov, 3),
        "epilog_j": _r(sum(epilog_energy.values()), 0) if epilog_energy else None,
        "epilog_nodes": len(epilog_energy),
        "method": "sum of sampled power x interval per GPU (gaps count 0); epilog: NVML total "
                  "energy counter difference, prolog to epilog",
    }

    # --- restarts: the archive's requeues (attempts), and job-wide activity gaps inside them
    restarts = _restart_gaps(src.time, act, p90, interval, g * n if use_gpu else n, th, basis)
    _add_requeues(restarts, job, g * n if use_gpu else n)

    # --- per node
    per_node: list[dict[str, Any]] = []
    flagged = {s.node for s in stragglers}
    with np.errstate(invalid="ignore"):
        node_util = np.nanmean(np.where(gpu_present, util_s, np.nan), axis=1) if g else \
            np.full(n, np.nan)
        node_power = np.nansum(np.where(gpu_present, power_s, np.nan), axis=1) if g else \
            np.full(n, np.nan)
    for i, name in enumerate(src.nodes):
        per_node.append({
            "node": name, "coverage": _r(node_cov[i], 3),
            "gpu_util_pct": _r(node_util[i]) if g else None,
            "gpu_power_w": _r(node_power[i]) if g and gpu_present[i].any() else None,
            "gpu_energy_j": _r(node_energy[i], 0) if g and gpu_present[i].any() else None,
            "epilog_gpu_energy_j": _r(epilog_energy.get(name), 0),
            "cpu_busy_pct": _r(cpu_busy_s[i]), "cpu_throttled_pct": _r(cpu_thr_s[i]),
            "cpu_throttled_share": _r(cpu_thr_share[i], 3),
            "idle_gpus": [int(j) for j in np.flatnonzero(idle[i])],
            "straggler": name in flagged,
        })
    idle_list = [{"node": src.nodes[i], "gpu": int(j), "idle_share": _r(idle_share[i, j], 3)}
                 for i, j in zip(*np.nonzero(idle), strict=True)]

    gpu_fig: dict[str, Any] = {}
    if g:
        with np.errstate(invalid="ignore"):
            gpu_fig = {
                "util_mean_pct": _r(overall_mean("util_pct")) if "util_pct" in acc.sums
                else None,
                "util_steady_pct": _r(np.nanmean(np.where(gpu_present, util_s, np.nan)))
                if gpu_present.any() else None,
                "power_mean_w": _r(overall_mean("power_w")) if "power_w" in acc.sums else None,
                "power_steady_w": _r(np.nanmean(np.where(gpu_present, power_s, np.nan)))
                if gpu_present.any() else None,
                "power_total_steady_kw": _r(np.nansum(np.where(gpu_present, power_s, 0)) / 1e3,
                                            2),
                "sm_clock_steady_mhz": _r(np.nanmedian(np.where(gpu_present, clock_s, np.nan)))
                if gpu_present.any() and "sm_clock_mhz" in acc.sums else None,
                "throttle_share": {c: _r(np.nanmean(np.where(gpu_present, s, np.nan)), 4)
                                   for c, s in shares.items()} if gpu_present.any() else {},
                "idle_gpus": len(idle_list),
            }
    cpu_fig = {
        "busy_mean_pct": _r(overall_mean("cpu_busy_pct")) if "cpu_busy_pct" in acc.sums
        else None,
        "throttled_mean_pct": _r(overall_mean("cpu_throttled_pct"))
        if "cpu_throttled_pct" in acc.sums else None,
    }
    steady_idx = np.flatnonzero(sb)
    s0 = int(starts[steady_idx[0]])
    s1 = int(starts[steady_idx[-1]] + bin_len[steady_idx[-1]] - 1)
    time = src.time
    steady = {"basis": basis, "samples": steady_samples, "share": _r(steady_samples / t, 3),
              "start_unix_s": _r(time[s0], 1), "end_unix_s": _r(time[s1], 1),
              "activity_p90": _r(p90)}
    eff = Efficiency(
        job_id=src.job_id, interval_s=interval, n_samples=t,
        t0_unix_s=_r(time[0], 1), duration_s=float(t * interval),
        nodes=list(src.nodes), n_gpus=g, gpus_present=int(gpu_present.sum()),
        steady=steady, gpu=gpu_fig, cpu=cpu_fig, energy=energy, restarts=restarts,
        idle_gpus=idle_list, per_node=per_node, stragglers=stragglers, missing=missing,
        notes=notes, thresholds=th)
    eff.bins = _bins_for_plots(src, acc, starts, bin_len, use_gpu, stragglers, sb)
    if g:
        eff.bins["gpu_util"] = np.where(gpu_present & ~idle, util_s, np.nan)
        eff.bins["gpu_power"] = np.where(gpu_present & ~idle, power_s, np.nan)
    return eff


def _robust(values: np.ndarray) -> tuple[float, float]:
    import numpy as np

    v = values[np.isfinite(values)]
    if not len(v):
        return math.nan, math.nan
    med = float(np.median(v))
    return med, float(np.median(np.abs(v - med))) * _MAD_SCALE


def _low(values: np.ndarray, pool: np.ndarray, th: Thresholds, min_abs: float,
         min_rel: float) -> tuple[np.ndarray, float, np.ndarray]:
    """Units of `pool` whose value is low: below median - max(k*MAD, min_abs, min_rel*median).
    Returns (mask, median, robust z)."""
    import numpy as np

    v = np.where(pool, values, np.nan)
    if int(np.isfinite(v).sum()) < th.min_peers:
        return np.zeros(values.shape, bool), math.nan, np.zeros(values.shape)
    med, mad = _robust(v)
    cut = max(th.mad_k * mad, min_abs, min_rel * abs(med))
    with np.errstate(invalid="ignore", divide="ignore"):
        mask = np.isfinite(v) & (v < med - cut)
        z = (med - v) / max(mad, cut / th.mad_k, 1e-9)
    return mask, med, np.nan_to_num(z)


def _share_outliers(shares: np.ndarray, pool: np.ndarray, th: Thresholds, min_share: float,
                    max_median: float) -> tuple[np.ndarray, float]:
    import numpy as np

    v = np.where(pool, shares, np.nan)
    if int(np.isfinite(v).sum()) < th.min_peers:
        return np.zeros(shares.shape, bool), math.nan
    med = float(np.nanmedian(v))
    if med > max_median:
        return np.zeros(shares.shape, bool), med  # the whole job shows it: not one straggler
    return np.isfinite(v) & (v >= min_share) & (v >= med + min_share), med


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _gpu_stragglers(nodes: Sequence[str], pool: np.ndarray, util: np.ndarray,
                    power: np.ndarray, clock: np.ndarray, temp: np.ndarray,
                    shares: dict[str, np.ndarray], th: Thresholds) -> list[Straggler]:
    import numpy as np

    n, g = pool.shape
    findings: dict[tuple[int, int], list[tuple[str, str, dict[str, float | None], float]]] = {}

    def add(mask: np.ndarray, key: str, text_of: Any, med: float, vals: np.ndarray,
            score: np.ndarray) -> None:
        for i, j in zip(*np.nonzero(mask), strict=True):
            findings.setdefault((int(i), int(j)), []).append(
                (key, text_of(float(vals[i, j]), med), {"value": _r(vals[i, j], 3),
                                                       "job_median": _r(med, 3)},
                 float(score[i, j])))

    m, med, z = _low(util, pool, th, th.util_min_drop_pct, 0.0)
    add(m, "util_pct", lambda v, md: f"util {v:.0f}% vs job median {md:.0f}%", med, util, z)
    m, med, z = _low(power, pool, th, th.power_min_drop_w, th.power_min_drop_rel)
    add(m, "power_w", lambda v, md: f"power {v:.0f} W vs job median {md:.0f} W", med, power, z)
    m, med, z = _low(clock, pool, th, 0.0, th.clock_min_drop_rel)
    add(m, "sm_clock_mhz", lambda v, md: f"SM clock {v:.0f} MHz vs job median {md:.0f} MHz",
        med, clock, z)
    for c in _FLAGGED_CLASSES:
        if c not in shares:
            continue
        name = THROTTLE_CLASSES[c][1]
        m, med = _share_outliers(shares[c], pool, th, th.throttle_min_share,
                                 th.throttle_max_median_share)
        add(m, c, lambda v, md, name=name: f"{name} {_pct(v)} of samples (job median "
            f"{_pct(md)})", med, shares[c], shares[c] * 10)
    out: list[Straggler] = []
    by_node: dict[int, dict[int, list[tuple[str, str, dict[str, float | None], float]]]] = {}
    for (i, j), f in findings.items():
        by_node.setdefault(i, {})[j] = f
    for i, gpus in sorted(by_node.items()):
        present = int(pool[i].sum())
        keys_all = set.intersection(*(set(k for k, *_ in f) for f in gpus.values()))
        if present >= 2 and len(gpus) == present and keys_all:
            # every GPU of the node is out on the same metric(s): name the node once
            parts: list[str] = []
            metrics: dict[str, dict[str, float | None]] = {}
            score = 0.0
            for key in sorted(keys_all, key=_metric_order):
                vals = [next(x for x in f if x[0] == key) for f in gpus.values()]
                mean_v = float(np.mean([v[2]["value"] for v in vals if v[2]["value"] is not None]))
                gm = vals[0][2]["job_median"]
                metrics[key] = {"value": _r(mean_v, 3), "job_median": gm}
                parts.append(_describe(key, mean_v, gm))
                score = max(score, max(v[3] for v in vals))
            temp_note = _temp_note(temp, pool, i, None) if "thermal" in keys_all else ""
            out.append(Straggler(nodes[i], None, f"{nodes[i]} (all {present} GPUs): "
                                 + ", ".join(parts) + temp_note, metrics, score))
            continue
        for j, f in sorted(gpus.items()):
            f.sort(key=lambda x: _metric_order(x[0]))
            temp_note = _temp_note(temp, pool, i, j) if any(k == "thermal" for k, *_ in f) \
                else ""
            out.append(Straggler(nodes[i], j, f"{nodes[i]} GPU {j}: "
                                 + ", ".join(x[1] for x in f) + temp_note,
                                 {x[0]: x[2] for x in f}, max(x[3] for x in f)))
    return out


def _metric_order(key: str) -> int:
    order = ["util_pct", "power_w", "sm_clock_mhz", "hw_power_brake", "thermal", "hw_slowdown",
             "cpu_throttled", "cpu_busy_pct"]
    return order.index(key) if key in order else len(order)


def _describe(key: str, v: float | None, med: float | None) -> str:
    v = math.nan if v is None else v
    med = math.nan if med is None else med
    if key == "util_pct":
        return f"util {v:.0f}% vs job median {med:.0f}%"
    if key == "power_w":
        return f"power {v:.0f} W vs job median {med:.0f} W"
    if key == "sm_clock_mhz":
        return f"SM clock {v:.0f} MHz vs job median {med:.0f} MHz"
    if key in THROTTLE_CLASSES:
        return f"{THROTTLE_CLASSES[key][1]} {_pct(v)} of samples (job median {_pct(med)})"
    return f"{key} {v:g} vs job median {med:g}"


def _temp_note(temp: np.ndarray, pool: np.ndarray, i: int, j: int | None) -> str:
    import numpy as np

    v = temp[i, j] if j is not None else np.nanmean(temp[i])
    med = float(np.nanmedian(np.where(pool, temp, np.nan))) if np.isfinite(temp).any() \
        else math.nan
    if not np.isfinite(v) or math.isnan(med):
        return ""
    return f" ({float(v):.0f} °C vs job median {med:.0f} °C)"


def _cpu_stragglers(nodes: Sequence[str], covered: np.ndarray, busy: np.ndarray,
                    thr_pct: np.ndarray, thr_share: np.ndarray, th: Thresholds
                    ) -> list[Straggler]:
    import numpy as np

    found: dict[int, list[tuple[str, str, dict[str, float | None], float]]] = {}
    m, med = _share_outliers(thr_share, covered, th, th.cpu_throttled_min_share,
                             th.cpu_throttled_min_share / 2)
    if m.any():
        others = np.where(covered & ~m, thr_share, np.nan)
        omax = float(np.nanmax(others)) if np.isfinite(others).any() else math.nan
        for i in np.flatnonzero(m).tolist():
            text = (f"CPU throttled {_pct(thr_share[i])} of samples (others ≤{_pct(omax)})"
                    if not math.isnan(omax) else
                    f"CPU throttled {_pct(thr_share[i])} of samples")
            if np.isfinite(thr_pct[i]):
                text += f", {thr_pct[i]:.0f}% of the time on average"
            found.setdefault(int(i), []).append(
                ("cpu_throttled", text, {"value": _r(thr_share[i], 3), "job_median": _r(med, 3),
                                         "others_max": _r(omax, 3),
                                         "throttled_pct": _r(thr_pct[i])},
                 float(thr_share[i]) * 10))
    m, med, z = _low(busy, covered, th, th.cpu_busy_min_drop_pct, 0.0)
    for k in np.flatnonzero(m).tolist():
        found.setdefault(k, []).append(
            ("cpu_busy_pct", f"CPU busy {busy[k]:.0f}% vs job median {med:.0f}%",
             {"value": _r(busy[k]), "job_median": _r(med)}, float(z[k])))
    out = []
    for i, f in sorted(found.items()):
        out.append(Straggler(nodes[i], None, f"{nodes[i]}: " + ", ".join(x[1] for x in f),
                             {x[0]: x[2] for x in f}, max(x[3] for x in f)))
    return out


def _epilog_telemetry(job: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for node in (job or {}).get("nodes") or []:
        ep = node.get("epilog") or {}
        tel = ep.get("telemetry") or {}
        if isinstance(tel, dict) and tel:
            out[str(node.get("node"))] = {k: float(v) for k, v in tel.items()
                                          if isinstance(v, int | float)}
    return out


def _restart_gaps(time: np.ndarray, act: np.ndarray, p90: float, interval: float,
                  units: int, th: Thresholds, basis: str) -> dict[str, Any]:
    """Stretches, between the first and the last active sample, where the job as a whole did
    nothing (activity under `gap_activity_frac` of its 90th percentile, or no node sampled)."""
    import numpy as np

    out: dict[str, Any] = {
        "gaps": [], "count": 0, "lost_s": 0.0, "lost_unit_h": 0.0, "startup_s": None,
        "stalls": 0, "stalls_s": 0.0,
        "source": f"job-wide {basis} in the time series (approximate: resolution one "
                  "sample interval; Slurm requeues are counted from the archive's restart "
                  "counts)",
    }
    if math.isnan(p90) or p90 <= 0:
        return out
    active = np.isfinite(act) & (act >= th.gap_activity_frac * p90)
    idx = np.flatnonzero(active)
    if not len(idx):
        return out
    first, last = int(idx[0]), int(idx[-1])
    out["startup_s"] = _r(first * interval, 1)
    quiet = ~active[first:last + 1]
    if quiet.any():
        edges = np.diff(np.concatenate(([0], quiet.astype(np.int8), [0])))
        runs = zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)
        min_n = max(1, math.ceil(th.gap_min_s / interval))
        for s, e in runs:
            if e - s >= min_n:
                out["gaps"].append({"start_unix_s": _r(time[first + s], 1),
                                    "duration_s": _r((e - s) * interval, 1)})
            else:
                out["stalls"] += 1
                out["stalls_s"] += float((e - s) * interval)
    out["count"] = len(out["gaps"])
    out["stalls_s"] = _r(out["stalls_s"], 1)
    out["lost_s"] = _r(sum(x["duration_s"] for x in out["gaps"]), 1)
    out["lost_unit_h"] = _r(out["lost_s"] * units / 3600.0, 2)
    out["unit"] = "GPU" if basis == "GPU utilisation" else "node"
    return out


def _add_requeues(out: dict[str, Any], job: dict[str, Any] | None, units: int) -> None:
    """Fold the archive's attempts (`query.show_job`'s `attempts`, a requeued job's) into the
    series' restart gaps: `requeues` (the archive's restart count), `requeue_gaps` (each
    attempt's last epilog to the next one's first prolog), `count` = requeues + activity gaps
    inside the attempts (an activity gap that overlaps a requeue gap is that requeue seen in
    the series: dropped, the report times measure it), `lost_s` = both summed."""
    attempts = (job or {}).get("attempts") or []
    restarts = int((job or {}).get("restarts") or 0)
    out["requeues"] = restarts
    out["requeue_gaps"] = []
    if not restarts:
        return
    spans = []
    for prev, cur in zip(attempts, attempts[1:], strict=False):
        a, b = prev.get("last_epilog_unix_s"), cur.get("first_prolog_unix_s")
        if a is None or b is None or b < a:
            continue
        spans.append((float(a), float(b)))
        out["requeue_gaps"].append({"restart": cur["restart"], "start_unix_s": _r(a, 1),
                                    "duration_s": _r(b - a, 1)})
    out["gaps"] = [x for x in out["gaps"] if not any(
        x["start_unix_s"] < b and x["start_unix_s"] + x["duration_s"] > a for a, b in spans)]
    lost = sum(x["duration_s"] for x in out["gaps"] + out["requeue_gaps"])
    out["count"] = restarts + len(out["gaps"])
    out["lost_s"] = _r(lost, 1)
    out["lost_unit_h"] = _r(lost * units / 3600.0, 2)
    out["source"] = (f"{restarts} requeue(s) from the archive (restart counts; gaps between "
                     "attempts from their report times) and job-wide activity gaps inside the "
                     "attempts from the time series")


def _bins_for_plots(src: _Source, acc: _Acc, starts: np.ndarray, bin_len: np.ndarray,
                    use_gpu: bool, stragglers: list[Straggler], sb: np.ndarray
                    ) -> dict[str, Any]:
    """Per-bin arrays for the HTML page: a node x bin heatmap, and for each straggler its
    series against the job's 10/50/90 % band over units (GPUs or nodes)."""
    import numpy as np

    t0 = src.time[starts] if len(src.time) else np.zeros(0)
    out: dict[str, Any] = {"time": t0, "bin_s": float(np.median(bin_len)) * src.interval_s,
                           "steady": sb}
    # Heatmaps: per node and bin; for GPU metrics the node's LOWEST GPU (a mean over 8 GPUs
    # would hide one slow GPU).
    heats = [("util_pct", True), ("power_w", True)] if use_gpu else [("cpu_busy_pct", False)]
    for metric, _ in heats:
        if metric in acc.sums:
            per = _div(acc.sums[metric], acc.counts[metric])
            out.setdefault("heats", []).append(
                (np.nanmin(per, axis=1) if per.ndim == 3 else per, metric))
    if "cpu_throttled_pct" in acc.sums:
        thr = _div(acc.sums["cpu_throttled_pct"], acc.counts["cpu_throttled_pct"])
        if np.isfinite(thr).any() and np.nanmax(thr) > 5.0:
            out.setdefault("heats", []).append((thr, "cpu_throttled_pct"))
    lines = []
    for s in stragglers[:8]:
        key = next(iter(s.metrics))
        metric = {"cpu_throttled": "cpu_throttled_pct"}.get(key, key)
        if metric in THROTTLE_CLASSES:
            metric = "power_w" if "power_w" in acc.sums else "util_pct"
        if metric not in acc.sums:
            continue
        per = _div(acc.sums[metric], acc.counts[metric])  # [N, G, B] or [N, B]
        i = src.nodes.index(s.node)
        if per.ndim == 3:
            mine = per[i, s.gpu] if s.gpu is not None else np.nanmean(per[i], axis=0)
            flat = per.reshape(-1, per.shape[-1])
        else:
            mine, flat = per[i], per
        if np.isfinite(flat).any():
            band = np.nanpercentile(flat, [10, 50, 90], axis=0)
        else:
            band = np.full((3, flat.shape[-1]), np.nan)
        lines.append({"label": s.label, "metric": metric, "series": mine, "band": band})
    out["lines"] = lines
    return out


# --------------------------------------------------------------------------------- text


def fmt_duration(s: float | None, missing: str = "?") -> str:
    """`12 s`, `7 min`, `3.5 h`: the pages' formatter, `?` when unknown (the summary)."""
    return page.fmt_duration(s, missing)


def summary_lines(eff: Efficiency) -> list[str]:
    """The terminal summary: the job's figures in a few lines (stragglers go in a table)."""
    d = eff.to_dict()
    g, cpu, en, rs = d["gpu"], d["cpu"], d["energy"], d["restarts"]
    lines = [f"job {eff.job_id}: {len(eff.nodes)} node(s) x {eff.n_gpus} GPU(s), "
             f"{fmt_duration(eff.duration_s)} at {eff.interval_s:g} s ({eff.n_samples} samples); "
             f"steady state {fmt_duration(d['steady']['samples'] * eff.interval_s)} "
             f"(by {d['steady']['basis']})"]
    if g:
        lines.append(f"GPU util {g['util_steady_pct']}% steady, {g['util_mean_pct']}% whole job; "
                     f"power {g['power_steady_w']} W per GPU, {g['power_total_steady_kw']} kW "
                     f"the job; SM clock {g['sm_clock_steady_mhz']} MHz")
    parts = []
    if en["series_kwh"] is not None:
        parts.append(f"GPU energy {en['series_kwh']} kWh from the samples "
                     f"({en['series_coverage']:.0%} covered)")
    if en["epilog_j"] is not None:
        parts.append(f"{en['epilog_j'] / 3.6e6:.3f} kWh from the epilogs' NVML counters "
                     f"({en['epilog_nodes']} node(s))")
    if parts:
        lines.append("; ".join(parts))
    if cpu["busy_mean_pct"] is not None:
        lines.append(f"CPU busy {cpu['busy_mean_pct']}%, throttled {cpu['throttled_mean_pct']}%"
                     " of the time")
    if eff.idle_gpus:
        shown = ", ".join(f"{x['node']} GPU {x['gpu']}" for x in eff.idle_gpus[:6])
        more = f" (+{len(eff.idle_gpus) - 6})" if len(eff.idle_gpus) > 6 else ""
        lines.append(f"idle GPUs: {len(eff.idle_gpus)}: {shown}{more}")
    if rs.get("requeues"):
        lines.append(f"restarts: {rs['requeues']} requeue(s) (archive) + {len(rs['gaps'])} "
                     f"gap(s) inside attempts, {fmt_duration(rs['lost_s'])} lost "
                     f"({rs['lost_unit_h']} {rs.get('unit', 'GPU')} h)")
    elif rs["count"]:
        lines.append(f"restarts: {rs['count']} gap(s), {fmt_duration(rs['lost_s'])} lost "
                     f"({rs['lost_unit_h']} {rs.get('unit', 'GPU')} h; approximate, from the "
                     "series)")
    if rs["stalls"]:
        lines.append(f"stalls (job-wide idle < {fmt_duration(eff.thresholds.gap_min_s)}, e.g. "
                     f"checkpoints): {rs['stalls']}, {fmt_duration(rs['stalls_s'])} in all")
    for m in eff.missing[:10]:
        lines.append(f"no verdict on {m['node']}: {m['why']}")
    if len(eff.missing) > 10:
        lines.append(f"no verdict on {len(eff.missing) - 10} more node(s)")
    lines.extend(eff.notes)
    n = len(eff.straggler_nodes)
    lines.append(f"stragglers: {n} node(s)" + (":" if n else " (every GPU and node within "
                                               "the thresholds of the job's median)"))
    return lines
