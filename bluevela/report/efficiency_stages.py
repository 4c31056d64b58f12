"""The efficiency analysis's stages over the per-bin sums (`efficiency_source.Acc`), in order:
the steady state, coverage, GPU and CPU figures, energy, restarts, per-node rows, and the bins
the page draws. Each is a function with a dataclass result; `report/efficiency.py` runs them.

The steady state: time bins where the job-wide activity (mean GPU utilisation, or CPU busy on
nodes without GPUs) is at least `steady_frac` of its 90th percentile over the job (start-up,
restarts and the tail are left out). Per GPU and per node, figures are means over it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bluevela.health.throttle import CLASSES
from bluevela.report.efficiency_model import PlotBins, Straggler, StragglerLine, Thresholds, rnd
from bluevela.report.efficiency_source import Acc, Source, binsum, div

if TYPE_CHECKING:
    import numpy as np


@dataclass
class SteadyState:
    """The bins the job was at work in, and the job-wide activity they were chosen by."""

    use_gpu: bool  # judged by GPU utilisation (else CPU busy: no GPUs, or idle ones)
    basis: str  # "GPU utilisation" or "CPU busy"
    activity: np.ndarray  # [T] job-wide activity per sample
    p90: float  # its 90th percentile (NaN when it has none)
    bins: np.ndarray  # [B] bool
    samples: int

    def summary(self, acc: Acc, time: np.ndarray) -> dict[str, Any]:
        """The `steady` figures of the `--json` form."""
        import numpy as np

        idx = np.flatnonzero(self.bins)
        s0 = int(acc.starts[idx[0]])
        s1 = int(acc.starts[idx[-1]] + acc.bin_len[idx[-1]] - 1)
        return {"basis": self.basis, "samples": self.samples,
                "share": rnd(self.samples / len(time), 3), "start_unix_s": rnd(time[s0], 1),
                "end_unix_s": rnd(time[s1], 1), "activity_p90": rnd(self.p90)}


def steady_state(acc: Acc, n_gpus: int, th: Thresholds) -> SteadyState:
    """Job-wide activity: GPU utilisation when the GPUs did anything, else CPU busy."""
    import numpy as np

    cnt = acc.act_cnt.sum()
    util_mean = float(acc.act_sum.sum() / cnt) if cnt else math.nan
    use_gpu = n_gpus > 0 and "util_pct" in acc.sums and not math.isnan(util_mean) and \
        util_mean > th.idle_util_pct
    act = div(acc.act_sum, acc.act_cnt) if use_gpu else div(acc.cpu_sum, acc.cpu_cnt)
    basis = "GPU utilisation" if use_gpu else "CPU busy"
    if not use_gpu and not np.isfinite(act).any():
        act = np.where(acc.act_cnt > 0, 0.0, np.nan)
        basis = "GPU utilisation"
    act_bins = div(binsum(np.nan_to_num(act), acc.starts),
                   binsum(np.isfinite(act).astype(int), acc.starts))
    p90 = float(np.nanpercentile(act, 90)) if np.isfinite(act).any() else math.nan
    if math.isnan(p90) or p90 <= 0:
        sb = np.isfinite(act_bins)
    else:
        sb = np.isfinite(act_bins) & (act_bins >= th.steady_frac * p90)
    if not sb.any():
        sb = np.ones(acc.n_bins, bool)
    return SteadyState(use_gpu, basis, act, p90, sb, int(acc.bin_len[sb].sum()))


@dataclass
class Coverage:
    """Which nodes sampled enough of the steady state to be judged."""

    node: np.ndarray  # [N] share of the steady state's samples each node has
    covered: np.ndarray  # [N] bool: at least `min_coverage`
    missing: list[dict[str, Any]]  # nodes with no verdict, and why


def coverage(acc: Acc, steady: SteadyState, nodes: Sequence[str], job: dict[str, Any] | None,
             th: Thresholds) -> Coverage:
    """Each node's coverage of the steady state; the job's nodes with no series at all."""
    import numpy as np

    metric = "util_pct" if steady.use_gpu else ("cpu_busy_pct" if "cpu_busy_pct" in acc.counts
                                                else None)
    if metric is not None:
        cnt = acc.counts[metric][..., steady.bins].sum(-1)
        node_cov = (cnt.max(axis=1) if cnt.ndim == 2 else cnt) / max(steady.samples, 1)
    else:
        node_cov = np.ones(len(nodes))
    missing: list[dict[str, Any]] = []
    expected = list((job or {}).get("nodelist") or []) or \
        [x["node"] for x in (job or {}).get("nodes") or [] if x.get("expected", True)]
    for name in sorted(set(expected) - set(nodes)):
        missing.append({"node": name, "coverage": 0.0, "why": "no time series from this node"})
    for i, name in enumerate(nodes):
        if node_cov[i] < th.min_coverage:
            missing.append({"node": name, "coverage": rnd(node_cov[i], 3),
                            "why": f"samples in {node_cov[i]:.0%} of the steady state"})
    return Coverage(node_cov, node_cov >= th.min_coverage, missing)


@dataclass
class GpuFigures:
    """Per GPU [N, G], over the steady state (NaN where a metric or a GPU is absent)."""

    present: np.ndarray  # bool: the GPU has samples
    util: np.ndarray
    power: np.ndarray
    clock: np.ndarray
    temp: np.ndarray
    idle_share: np.ndarray  # share of its samples at or below idle_util_pct
    idle: np.ndarray  # bool: idle (listed, not compared)
    pool: np.ndarray  # bool: compared (present, not idle, its node covered)
    shares: dict[str, np.ndarray]  # throttle class -> share of samples with it


def gpu_figures(acc: Acc, steady: SteadyState, cov: Coverage, th: Thresholds) -> GpuFigures:
    """The steady means of each GPU, its idle and throttle shares, and who is compared."""
    import numpy as np

    n, g = acc.energy_j.shape
    sb = steady.bins
    nan = np.full((n, g), np.nan)
    mean = {m: acc.steady_mean(m, sb) if g and m in acc.sums else nan
            for m in ("util_pct", "power_w", "sm_clock_mhz", "temp_c")}
    present = np.zeros((n, g), bool)
    idle_share = nan
    shares: dict[str, np.ndarray] = {}
    if g:
        for m in ("util_pct", "power_w"):
            if m in acc.counts:
                present = acc.counts[m].sum(-1) > 0
                break
        if "util_pct" in acc.sums:
            idle_share = div(acc.idle_counts[..., sb].sum(-1),
                             acc.counts["util_pct"][..., sb].sum(-1))
        valid = acc.reason_counts["valid"][..., sb].sum(-1)
        shares = {c: div(acc.reason_counts[c][..., sb].sum(-1), valid) for c in CLASSES}
    idle = present & (idle_share >= th.idle_min_share) if steady.use_gpu else \
        np.zeros((n, g), bool)
    return GpuFigures(present, mean["util_pct"], mean["power_w"], mean["sm_clock_mhz"],
                      mean["temp_c"], idle_share, idle, present & ~idle & cov.covered[:, None],
                      shares)


def gpu_summary(acc: Acc, gpu: GpuFigures) -> dict[str, Any]:
    """The `gpu` figures of the `--json` form (empty without GPUs)."""
    import numpy as np

    if not gpu.present.shape[1]:
        return {}
    on = gpu.present
    any_on = bool(on.any())

    def over_present(x: np.ndarray, fn: Any, nd: int = 1) -> float | None:
        return rnd(fn(np.where(on, x, np.nan)), nd) if any_on else None

    def overall(m: str) -> float | None:
        return rnd(acc.overall_mean(m)) if m in acc.sums else None

    with np.errstate(invalid="ignore"):
        return {
            "util_mean_pct": overall("util_pct"),
            "util_steady_pct": over_present(gpu.util, np.nanmean),
            "power_mean_w": overall("power_w"),
            "power_steady_w": over_present(gpu.power, np.nanmean),
            "power_total_steady_kw": rnd(np.nansum(np.where(on, gpu.power, 0)) / 1e3, 2),
            "sm_clock_steady_mhz": over_present(gpu.clock, np.nanmedian)
            if "sm_clock_mhz" in acc.sums else None,
            "throttle_share": {c: over_present(s, np.nanmean, 4)
                               for c, s in gpu.shares.items()} if any_on else {},
            "idle_gpus": int(gpu.idle.sum()),
        }


def idle_gpus(nodes: Sequence[str], gpu: GpuFigures) -> list[dict[str, Any]]:
    """The idle GPUs, node by node."""
    import numpy as np

    return [{"node": nodes[i], "gpu": int(j), "idle_share": rnd(gpu.idle_share[i, j], 3)}
            for i, j in zip(*np.nonzero(gpu.idle), strict=True)]


@dataclass
class CpuFigures:
    """Per node [N], over the steady state, and the job's means (`summary`)."""

    busy: np.ndarray
    throttled_pct: np.ndarray  # mean share of each interval throttled
    throttled_share: np.ndarray  # share of samples throttled above cpu_throttled_sample_pct
    summary: dict[str, Any]  # the `cpu` figures of the `--json` form


def cpu_figures(acc: Acc, steady: SteadyState, n_nodes: int) -> CpuFigures:
    """CPU busy and cgroup throttling per node."""
    import numpy as np

    sb = steady.bins
    nan = np.full(n_nodes, np.nan)
    busy = acc.steady_mean("cpu_busy_pct", sb) if "cpu_busy_pct" in acc.sums else nan
    thr = acc.steady_mean("cpu_throttled_pct", sb) if "cpu_throttled_pct" in acc.sums else nan
    share = div(acc.cpu_thr_counts[:, sb].sum(-1),
                acc.counts["cpu_throttled_pct"][:, sb].sum(-1)) \
        if "cpu_throttled_pct" in acc.counts else nan
    summary = {m: rnd(acc.overall_mean(metric)) if metric in acc.sums else None
               for m, metric in (("busy_mean_pct", "cpu_busy_pct"),
                                 ("throttled_mean_pct", "cpu_throttled_pct"))}
    return CpuFigures(busy, thr, share, summary)


@dataclass
class Energy:
    """GPU energy: from the sampled power, and from the epilogs' NVML counters."""

    node_j: np.ndarray  # [N] from the samples (NaN without power samples)
    epilog_j: dict[str, float]  # node -> the epilog's counter difference
    summary: dict[str, Any]  # the `energy` figures of the `--json` form


def _epilog_telemetry(job: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for node in (job or {}).get("nodes") or []:
        ep = node.get("epilog") or {}
        tel = ep.get("telemetry") or {}
        if isinstance(tel, dict) and tel:
            out[str(node.get("node"))] = {k: float(v) for k, v in tel.items()
                                          if isinstance(v, int | float)}
    return out


def energy(acc: Acc, gpu: GpuFigures, job: dict[str, Any] | None) -> Energy:
    """Sum of sampled power x interval per GPU (gaps count 0), and the epilogs' figures."""
    import numpy as np

    n, g = acc.energy_j.shape
    sampled = bool(g) and "power_w" in acc.sums
    node_j = acc.energy_j.sum(axis=1) if sampled else np.full(n, np.nan)
    epilog = {k: v["gpu_energy_j"] for k, v in _epilog_telemetry(job).items()
              if "gpu_energy_j" in v}
    power_cov = (acc.counts["power_w"].sum() / max(int(gpu.present.sum()) * len(acc.act_sum), 1)
                 if g and "power_w" in acc.counts else 0.0)
    summary = {
        "series_j": rnd(np.nansum(node_j), 0) if sampled else None,
        "series_kwh": rnd(np.nansum(node_j) / 3.6e6, 3) if sampled else None,
        "series_coverage": rnd(power_cov, 3),
        "epilog_j": rnd(sum(epilog.values()), 0) if epilog else None,
        "epilog_nodes": len(epilog),
        "method": "sum of sampled power x interval per GPU (gaps count 0); epilog: NVML total "
                  "energy counter difference, prolog to epilog",
    }
    return Energy(node_j, epilog, summary)


def restart_gaps(time: np.ndarray, steady: SteadyState, interval: float, units: int,
                 th: Thresholds) -> dict[str, Any]:
    """Stretches, between the first and the last active sample, where the job as a whole did
    nothing (activity under `gap_activity_frac` of its 90th percentile, or no node sampled);
    shorter than `gap_min_s`, a stall."""
    import numpy as np

    out: dict[str, Any] = {
        "gaps": [], "count": 0, "lost_s": 0.0, "lost_unit_h": 0.0, "startup_s": None,
        "stalls": 0, "stalls_s": 0.0,
        "source": f"job-wide {steady.basis} in the time series (approximate: resolution one "
                  "sample interval; Slurm requeues are counted from the archive's restart "
                  "counts)",
    }
    act, p90 = steady.activity, steady.p90
    if math.isnan(p90) or p90 <= 0:
        return out
    active = np.isfinite(act) & (act >= th.gap_activity_frac * p90)
    idx = np.flatnonzero(active)
    if not len(idx):
        return out
    first, last = int(idx[0]), int(idx[-1])
    out["startup_s"] = rnd(first * interval, 1)
    edges = np.diff(np.concatenate(([0], (~active[first:last + 1]).astype(np.int8), [0])))
    min_n = max(1, math.ceil(th.gap_min_s / interval))
    for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True):
        if e - s >= min_n:
            out["gaps"].append({"start_unix_s": rnd(time[first + s], 1),
                                "duration_s": rnd((e - s) * interval, 1)})
        else:
            out["stalls"] += 1
            out["stalls_s"] += float((e - s) * interval)
    out["count"] = len(out["gaps"])
    out["stalls_s"] = rnd(out["stalls_s"], 1)
    out["lost_s"] = rnd(sum(x["duration_s"] for x in out["gaps"]), 1)
    out["lost_unit_h"] = rnd(out["lost_s"] * units / 3600.0, 2)
    out["unit"] = "GPU" if steady.basis == "GPU utilisation" else "node"
    return out


def add_requeues(out: dict[str, Any], job: dict[str, Any] | None, units: int) -> None:
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
        out["requeue_gaps"].append({"restart": cur["restart"], "start_unix_s": rnd(a, 1),
                                    "duration_s": rnd(b - a, 1)})
    out["gaps"] = [x for x in out["gaps"] if not any(
        x["start_unix_s"] < b and x["start_unix_s"] + x["duration_s"] > a for a, b in spans)]
    lost = sum(x["duration_s"] for x in out["gaps"] + out["requeue_gaps"])
    out["count"] = restarts + len(out["gaps"])
    out["lost_s"] = rnd(lost, 1)
    out["lost_unit_h"] = rnd(lost * units / 3600.0, 2)
    out["source"] = (f"{restarts} requeue(s) from the archive (restart counts; gaps between "
                     "attempts from their report times) and job-wide activity gaps inside the "
                     "attempts from the time series")


@dataclass(frozen=True)
class NodeRow:
    """One node's figures over the steady state (a row of the `per_node` table)."""

    node: str
    coverage: float | None
    gpu_util_pct: float | None
    gpu_power_w: float | None
    gpu_energy_j: float | None
    epilog_gpu_energy_j: float | None
    cpu_busy_pct: float | None
    cpu_throttled_pct: float | None
    cpu_throttled_share: float | None
    idle_gpus: list[int]
    straggler: bool


def node_rows(nodes: Sequence[str], cov: Coverage, gpu: GpuFigures, cpu: CpuFigures,
              en: Energy, stragglers: Sequence[Straggler]) -> list[NodeRow]:
    """Per node: its GPUs' mean utilisation and summed power, energy, CPU, idle GPUs, and
    whether it is named a straggler."""
    import numpy as np

    n, g = gpu.present.shape
    flagged = {s.node for s in stragglers}
    with np.errstate(invalid="ignore"):
        util = np.nanmean(np.where(gpu.present, gpu.util, np.nan), axis=1) if g else \
            np.full(n, np.nan)
        power = np.nansum(np.where(gpu.present, gpu.power, np.nan), axis=1) if g else \
            np.full(n, np.nan)
    rows = []
    for i, name in enumerate(nodes):
        on = bool(g) and bool(gpu.present[i].any())
        rows.append(NodeRow(
            node=name, coverage=rnd(cov.node[i], 3),
            gpu_util_pct=rnd(util[i]) if g else None,
            gpu_power_w=rnd(power[i]) if on else None,
            gpu_energy_j=rnd(en.node_j[i], 0) if on else None,
            epilog_gpu_energy_j=rnd(en.epilog_j.get(name), 0),
            cpu_busy_pct=rnd(cpu.busy[i]), cpu_throttled_pct=rnd(cpu.throttled_pct[i]),
            cpu_throttled_share=rnd(cpu.throttled_share[i], 3),
            idle_gpus=[int(j) for j in np.flatnonzero(gpu.idle[i])],
            straggler=name in flagged))
    return rows


def _straggler_lines(src: Source, acc: Acc, stragglers: Sequence[Straggler]
                     ) -> list[StragglerLine]:
    """The first 8 stragglers' series on their first finding's metric (a throttle reason: on
    power, else utilisation) against the job's 10/50/90 % band over units."""
    import numpy as np

    lines = []
    for s in stragglers[:8]:
        metric = s.findings[0].metric
        metric = {"cpu_throttled": "cpu_throttled_pct"}.get(metric, metric)
        if metric in CLASSES:
            metric = "power_w" if "power_w" in acc.sums else "util_pct"
        if metric not in acc.sums:
            continue
        per = div(acc.sums[metric], acc.counts[metric])  # [N, G, B] or [N, B]
        i = src.nodes.index(s.node)
        if per.ndim == 3:
            mine = per[i, s.gpu] if s.gpu is not None else np.nanmean(per[i], axis=0)
            flat = per.reshape(-1, per.shape[-1])
        else:
            mine, flat = per[i], per
        band = np.nanpercentile(flat, [10, 50, 90], axis=0) if np.isfinite(flat).any() else \
            np.full((3, flat.shape[-1]), np.nan)
        lines.append(StragglerLine(s.label, metric, mine, band))
    return lines


def plot_bins(src: Source, acc: Acc, steady: SteadyState, gpu: GpuFigures,
              stragglers: Sequence[Straggler]) -> PlotBins:
    """Per-bin arrays for the page: node x bin heatmaps, the stragglers' series, and the
    per-GPU steady figures for its distributions."""
    import numpy as np

    out = PlotBins(time=src.time[acc.starts] if len(src.time) else np.zeros(0),
                   bin_s=float(np.median(acc.bin_len)) * src.interval_s, steady=steady.bins)
    # per node and bin; for GPU metrics the node's LOWEST GPU (a mean over 8 GPUs would hide
    # one slow GPU)
    for metric in ("util_pct", "power_w") if steady.use_gpu else ("cpu_busy_pct",):
        if metric in acc.sums:
            per = div(acc.sums[metric], acc.counts[metric])
            out.heats.append((np.nanmin(per, axis=1) if per.ndim == 3 else per, metric))
    if "cpu_throttled_pct" in acc.sums:
        thr = div(acc.sums["cpu_throttled_pct"], acc.counts["cpu_throttled_pct"])
        if np.isfinite(thr).any() and np.nanmax(thr) > 5.0:
            out.heats.append((thr, "cpu_throttled_pct"))
    out.lines = _straggler_lines(src, acc, stragglers)
    if gpu.present.shape[1]:
        out.gpu_util = np.where(gpu.present & ~gpu.idle, gpu.util, np.nan)
        out.gpu_power = np.where(gpu.present & ~gpu.idle, gpu.power, np.nan)
    return out
