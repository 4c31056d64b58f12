"""Which GPUs and nodes lag the job, and the evidence in words.

Per GPU and per node, over the steady state: the job's median and MAD (scaled by 1.4826) over
its non-idle, covered units; a unit is a straggler on a metric when it is below the median by
more than `mad_k` MADs AND by a minimum effect (`Thresholds`), or when a HW throttle reason /
CPU cgroup throttling is present in a minimum share of its steady samples while the job's
median share is near zero. Each such metric is one `Finding`; a node whose every GPU is out on
the same metric(s) is named once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bluevela.health.throttle import CLASSES, FLAGGED_CLASSES
from bluevela.report.efficiency_model import Finding, Straggler, Thresholds, finding_rank, rnd

if TYPE_CHECKING:
    import numpy as np

    from bluevela.report.efficiency_stages import CpuFigures, GpuFigures

_MAD_SCALE = 1.4826


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


def describe(metric: str, v: float | None, med: float | None) -> str:
    """A finding in words: `util 70% vs job median 95%`."""
    v = math.nan if v is None else v
    med = math.nan if med is None else med
    if metric == "util_pct":
        return f"util {v:.0f}% vs job median {med:.0f}%"
    if metric == "power_w":
        return f"power {v:.0f} W vs job median {med:.0f} W"
    if metric == "sm_clock_mhz":
        return f"SM clock {v:.0f} MHz vs job median {med:.0f} MHz"
    if metric in CLASSES:
        return f"{CLASSES[metric].label} {_pct(v)} of samples (job median {_pct(med)})"
    return f"{metric} {v:g} vs job median {med:g}"


def _gpu_findings(s: GpuFigures, th: Thresholds) -> dict[tuple[int, int], list[Finding]]:
    """Every (node, GPU) out of line, with its findings in the order found."""
    import numpy as np

    found: dict[tuple[int, int], list[Finding]] = {}

    def add(mask: np.ndarray, metric: str, med: float, vals: np.ndarray,
            score: np.ndarray) -> None:
        for i, j in zip(*np.nonzero(mask), strict=True):
            v = float(vals[i, j])
            found.setdefault((int(i), int(j)), []).append(Finding(
                metric, describe(metric, v, med), rnd(v, 3), rnd(med, 3), float(score[i, j])))

    lows: list[tuple[str, np.ndarray, float, float]] = [
        ("util_pct", s.util, th.util_min_drop_pct, 0.0),
        ("power_w", s.power, th.power_min_drop_w, th.power_min_drop_rel),
        ("sm_clock_mhz", s.clock, 0.0, th.clock_min_drop_rel)]
    for metric, vals, min_abs, min_rel in lows:
        m, med, z = _low(vals, s.pool, th, min_abs, min_rel)
        add(m, metric, med, vals, z)
    for c in FLAGGED_CLASSES:
        if c in s.shares:
            m, med = _share_outliers(s.shares[c], s.pool, th, th.throttle_min_share,
                                     th.throttle_max_median_share)
            add(m, c, med, s.shares[c], s.shares[c] * 10)
    return found


def _temp_note(temp: np.ndarray, pool: np.ndarray, i: int, j: int | None) -> str:
    import numpy as np

    v = temp[i, j] if j is not None else np.nanmean(temp[i])
    med = float(np.nanmedian(np.where(pool, temp, np.nan))) if np.isfinite(temp).any() \
        else math.nan
    if not np.isfinite(v) or math.isnan(med):
        return ""
    return f" ({float(v):.0f} °C vs job median {med:.0f} °C)"


def _whole_node(s: GpuFigures, nodes: Sequence[str], i: int,
                gpus: dict[int, list[Finding]]) -> Straggler | None:
    """Node `i` named once, when every GPU of it is out on the same metric(s)."""
    import numpy as np

    present = int(s.pool[i].sum())
    common = set.intersection(*({f.metric for f in fs} for fs in gpus.values()))
    if present < 2 or len(gpus) != present or not common:
        return None
    merged = []
    for metric in sorted(common, key=finding_rank):
        same = [next(f for f in fs if f.metric == metric) for fs in gpus.values()]
        mean_v = float(np.mean([f.value for f in same if f.value is not None]))
        med = same[0].job_median
        merged.append(Finding(metric, describe(metric, mean_v, med), rnd(mean_v, 3), med,
                              max(f.score for f in same)))
    note = _temp_note(s.temp, s.pool, i, None) if "thermal" in common else ""
    return Straggler(nodes[i], None, f"{nodes[i]} (all {present} GPUs): "
                     + ", ".join(f.text for f in merged) + note, tuple(merged))


def gpu_stragglers(nodes: Sequence[str], s: GpuFigures, th: Thresholds) -> list[Straggler]:
    """The GPUs (or whole nodes' GPUs) that lag the job's median over the steady state."""
    by_node: dict[int, dict[int, list[Finding]]] = {}
    for (i, j), fs in _gpu_findings(s, th).items():
        by_node.setdefault(i, {})[j] = fs
    out: list[Straggler] = []
    for i, gpus in sorted(by_node.items()):
        whole = _whole_node(s, nodes, i, gpus)
        if whole is not None:
            out.append(whole)
            continue
        for j, fs in sorted(gpus.items()):
            fs.sort(key=lambda f: f.rank)
            note = _temp_note(s.temp, s.pool, i, j) if any(f.metric == "thermal" for f in fs) \
                else ""
            out.append(Straggler(nodes[i], j, f"{nodes[i]} GPU {j}: "
                                 + ", ".join(f.text for f in fs) + note, tuple(fs)))
    return out


def _cpu_throttled(covered: np.ndarray, c: CpuFigures, th: Thresholds
                   ) -> list[tuple[int, Finding]]:
    import numpy as np

    m, med = _share_outliers(c.throttled_share, covered, th, th.cpu_throttled_min_share,
                             th.cpu_throttled_min_share / 2)
    if not m.any():
        return []
    others = np.where(covered & ~m, c.throttled_share, np.nan)
    omax = float(np.nanmax(others)) if np.isfinite(others).any() else math.nan
    out = []
    for i in np.flatnonzero(m).tolist():
        share = c.throttled_share[i]
        text = f"CPU throttled {_pct(share)} of samples"
        if not math.isnan(omax):
            text += f" (others ≤{_pct(omax)})"
        if np.isfinite(c.throttled_pct[i]):
            text += f", {c.throttled_pct[i]:.0f}% of the time on average"
        out.append((int(i), Finding(
            "cpu_throttled", text, rnd(share, 3), rnd(med, 3), float(share) * 10,
            (("others_max", rnd(omax, 3)), ("throttled_pct", rnd(c.throttled_pct[i]))))))
    return out


def cpu_stragglers(nodes: Sequence[str], covered: np.ndarray, c: CpuFigures,
                   th: Thresholds) -> list[Straggler]:
    """The nodes whose CPU cgroup was throttled while the others' was not, or whose CPU was
    much less busy than the job's median."""
    import numpy as np

    found: dict[int, list[Finding]] = {}
    for i, f in _cpu_throttled(covered, c, th):
        found.setdefault(i, []).append(f)
    m, med, z = _low(c.busy, covered, th, th.cpu_busy_min_drop_pct, 0.0)
    for k in np.flatnonzero(m).tolist():
        found.setdefault(k, []).append(Finding(
            "cpu_busy_pct", f"CPU busy {c.busy[k]:.0f}% vs job median {med:.0f}%",
            rnd(c.busy[k]), rnd(med), float(z[k])))
    return [Straggler(nodes[i], None, f"{nodes[i]}: " + ", ".join(f.text for f in fs),
                      tuple(fs)) for i, fs in sorted(found.items())]


def find_stragglers(nodes: Sequence[str], gpu: GpuFigures | None, covered: np.ndarray,
                    cpu: CpuFigures, th: Thresholds) -> list[Straggler]:
    """GPU stragglers (when the job is judged by its GPUs) and CPU ones, worst first."""
    out = gpu_stragglers(nodes, gpu, th) if gpu is not None else []
    out += cpu_stragglers(nodes, covered, cpu, th)
    out.sort(key=lambda s: (-s.score, s.node, -1 if s.gpu is None else s.gpu))
    return out
