"""What the efficiency analysis returns: its thresholds, findings, stragglers and the job's result.

Plain data (no numpy at import): `report/efficiency.py` fills it, `report/efficiency_text.py`
and the page (`report/efficiency_html.py`) lay it out, `Efficiency.to_dict()` is the `--json`
form (docs/efficiency.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

GPU_METRICS = ("util_pct", "power_w", "sm_clock_mhz", "temp_c")
NODE_METRICS = ("cpu_busy_pct", "cpu_throttled_pct")
# The order of a straggler's findings in its evidence; the first six are about its GPUs, the
# last two about its node's CPU.
FINDING_ORDER = ("util_pct", "power_w", "sm_clock_mhz", "hw_power_brake", "thermal",
                 "hw_slowdown", "cpu_throttled", "cpu_busy_pct")
_GPU_FINDINGS = frozenset(FINDING_ORDER[:6])


def finding_rank(metric: str) -> int:
    """Where a finding on `metric` goes in the evidence (`FINDING_ORDER`; unknown ones last)."""
    return FINDING_ORDER.index(metric) if metric in FINDING_ORDER else len(FINDING_ORDER)


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


def rnd(v: Any, nd: int = 1) -> float | None:
    """A JSON-friendly rounded float (None for None, NaN and infinity)."""
    if v is None:
        return None
    f = float(v)
    return None if math.isnan(f) or math.isinf(f) else round(f, nd)


@dataclass(frozen=True)
class Finding:
    """One metric on which a GPU (or a node's GPUs, or its CPU) is out of line with the job.

    `text` is the evidence in words; `value` and `job_median` (rounded, None when unknown)
    and `extra` are the figures behind it, `score` how far out it is (robust z, or 10 x a
    share), for sorting.
    """

    metric: str
    text: str
    value: float | None
    job_median: float | None
    score: float
    extra: tuple[tuple[str, float | None], ...] = ()

    @property
    def figures(self) -> dict[str, float | None]:
        """`{value, job_median, ...extra}`: the finding in the `--json` form."""
        return {"value": self.value, "job_median": self.job_median, **dict(self.extra)}

    @property
    def on_gpu(self) -> bool:
        """About GPUs (utilisation, power, clock, a throttle reason), not the node's CPU."""
        return self.metric in _GPU_FINDINGS

    @property
    def rank(self) -> int:
        """Where it goes in the evidence (`FINDING_ORDER`)."""
        return finding_rank(self.metric)


@dataclass(frozen=True)
class Straggler:
    """One GPU (gpu >= 0), all GPUs of a node (gpu None, findings on GPUs) or a node's CPU."""

    node: str
    gpu: int | None
    evidence: str
    findings: tuple[Finding, ...]

    @property
    def label(self) -> str:
        return self.node if self.gpu is None else f"{self.node} GPU {self.gpu}"

    @property
    def metrics(self) -> dict[str, dict[str, float | None]]:
        """metric -> {value, job_median, ...}, in evidence order (the `--json` form)."""
        return {f.metric: f.figures for f in self.findings}

    @property
    def score(self) -> float:
        return max(f.score for f in self.findings)

    def flags(self, metrics: tuple[str, ...]) -> bool:
        """Whether one of its findings is on one of `metrics`."""
        return any(f.metric in metrics for f in self.findings)


@dataclass
class StragglerLine:
    """A straggler's per-bin series against the job's 10/50/90 % band over its peers."""

    label: str
    metric: str
    series: np.ndarray  # [B]
    band: np.ndarray  # [3, B]


@dataclass
class PlotBins:
    """Per time bin, what the page draws (nothing of it is in the `--json` form)."""

    time: np.ndarray | None = None  # [B] each bin's first sample (unix s)
    bin_s: float = 0.0
    steady: np.ndarray | None = None  # [B] bool: the bin is in the steady state
    heats: list[tuple[np.ndarray, str]] = field(default_factory=list)  # ([N, B], metric)
    lines: list[StragglerLine] = field(default_factory=list)
    gpu_util: np.ndarray | None = None  # [N, G] steady means of the non-idle GPUs
    gpu_power: np.ndarray | None = None


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
    bins: PlotBins = field(default_factory=PlotBins, repr=False)

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
