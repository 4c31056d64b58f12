"""The nightly report's numbers: per-node series over the nights, the floors each figure was
judged by, tonight's values, the nodes worth a trend panel, the fleet's medians. Pure: plain
data from the nightly store's records, tested without the page (`nightly_html` lays it out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bluevela.bench.result import Status
from bluevela.bench.store import NightRecord
from bluevela.util.names import natural_key

TREND_NIGHTS = 30
#: Headline figures in display order; lower is better only for latency.
FIGURES = ("gemm_tflops", "hbm_gbs", "h2d_gbs", "d2h_gbs", "allreduce_busbw_gbs",
           "pair_busbw_gbs", "mpi_bw_gbs", "mpi_lat_us")
LOWER_IS_BETTER = {"mpi_lat_us"}

#: Up to this many nodes the page keeps the node x node heatmap and every node's trends.
SMALL_CLUSTER = 16
#: On a larger cluster: the worst nodes labelled per histogram, nodes given trend panels, rows
#: of the problem table, and pairs listed by name before the rest are folded away.
WORST_N = 5
MAX_TREND_NODES = 24
MAX_PROBLEM_ROWS = 200
#: A node's figure this far (%) worse than its own median of the past nights is "regressed".
REGRESSION_PCT = 10.0


def node_series(records: Sequence[NightRecord]) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """node -> figure -> [(night, value)]: a node's own headline figures, and for pair figures
    its best pair of the night (the highest bandwidth, the lowest latency): a healthy node has
    at least one good partner, so only a node that is slow with everyone dips."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for rec in records:
        for row in rec.figures:
            if not row.headline or row.name not in FIGURES:
                continue
            for subject in (row.node, row.peer) if row.peer else (row.node,):
                by_night = out.setdefault(subject, {}).setdefault(row.name, {})
                old = by_night.get(rec.night)
                if old is None:
                    by_night[rec.night] = row.value
                else:
                    pick = min if row.name in LOWER_IS_BETTER else max
                    by_night[rec.night] = pick(old, row.value)
    return {n: {f: sorted(v.items()) for f, v in figs.items()} for n, figs in out.items()}


def floors(rec: NightRecord) -> dict[tuple[str, str], float]:
    """(node, figure) -> the limit it was judged by that night (0 = none)."""
    out: dict[tuple[str, str], float] = {}
    for row in rec.figures:
        if row.headline:
            for subject in (row.node, row.peer) if row.peer else (row.node,):
                out[(subject, row.name)] = row.limit
    return out


def _worse(name: str, value: float, ref: float) -> float:
    """How much worse `value` is than `ref`, in % (positive = worse)."""
    if not (math.isfinite(value) and math.isfinite(ref)) or ref == 0:
        return 0.0
    change = (value - ref) / abs(ref) * 100.0
    return change if name in LOWER_IS_BETTER else -change


def tonight_values(rec: NightRecord) -> dict[str, dict[str, float]]:
    """figure -> node -> tonight's value (for pair figures the node's best pair)."""
    series = node_series([rec])
    out: dict[str, dict[str, float]] = {}
    for node, figs in series.items():
        for name, points in figs.items():
            if points and math.isfinite(points[-1][1]):
                out.setdefault(name, {})[node] = points[-1][1]
    return out


def flagged_nodes(rec: NightRecord, series: dict[str, dict[str, list[tuple[str, float]]]]
                  ) -> list[tuple[str, str]]:
    """(node, why) of the nodes worth a trend panel: failing ones first, then those with a
    figure judged not OK, then those regressed against their own past, worst first."""
    failing = [n.node for n in sorted(rec.nodes, key=lambda r: natural_key(r.node))
               if n.culprit or n.status == Status.CRITICAL]
    out = [(n, "failing") for n in failing]
    seen = set(failing)
    judged: dict[str, str] = {}
    for row in rec.figures:
        if row.headline and row.status not in (Status.OK, 0) and not row.peer:
            judged.setdefault(row.node, f"{row.name} {Status(row.status).name}")
    for node in sorted(judged, key=natural_key):
        if node not in seen:
            out.append((node, judged[node]))
            seen.add(node)
    regressed: list[tuple[float, str, str]] = []
    for node, figs in series.items():
        if node in seen:
            continue
        worst = (0.0, "")
        for name, points in figs.items():
            if len(points) < 2 or points[-1][0] != rec.night:
                continue
            past = sorted(v for _, v in points[:-1] if math.isfinite(v))
            if not past:
                continue
            drop = _worse(name, points[-1][1], past[len(past) // 2])
            if drop > worst[0]:
                worst = (drop, name)
        if worst[0] > REGRESSION_PCT:
            regressed.append((worst[0], node, f"{worst[1]} {worst[0]:.0f}% worse than its median"))
    for _, node, why in sorted(regressed, key=lambda t: (-t[0], natural_key(t[1]))):
        out.append((node, why))
    return out


def fleet_trends(series: dict[str, dict[str, list[tuple[str, float]]]]
                 ) -> dict[str, list[tuple[str, float]]]:
    """figure -> [(night, median over nodes)], from `node_series`."""
    by: dict[str, dict[str, list[float]]] = {}
    for figs in series.values():
        for name, points in figs.items():
            for night, v in points:
                if math.isfinite(v):
                    by.setdefault(name, {}).setdefault(night, []).append(v)
    return {name: [(night, sorted(vs)[len(vs) // 2]) for night, vs in sorted(nights.items())]
            for name, nights in by.items()}
