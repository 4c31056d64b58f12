"""`bv bench report`: one self-contained HTML page per night, readable in a minute.

Sections, most urgent first: the verdict (failing and drained nodes, slow pairs), the measured
pairs (a node x node heatmap on a small cluster; on a large one a histogram and a list sorted
slowest first), the distribution of every headline figure over all nodes with the failing and
worst nodes labelled, trends (every node on a small cluster; on a large one only the failing and
regressed nodes, plus the fleet's median), and one compact text row per node.
A 1,000-node night stays under 2 MB (it was 202 MB as a million-cell heatmap and 3,000 trend
panels). Plots are inline SVG generated here: no JavaScript, no fonts or images fetched, no
matplotlib. Every text from the record is HTML-escaped.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Collection, Sequence
from pathlib import Path

from bluevela.bench.result import Status
from bluevela.bench.store import NightRecord, list_nights, night_path, read_night, read_nights
from bluevela.errors import ArchiveError
from bluevela.util.fs import atomic_write
from bluevela.util.names import natural_key

logger = logging.getLogger(__name__)

TREND_NIGHTS = 30
#: Headline figures in display order; lower is better only for latency.
FIGURES = ("gemm_tflops", "hbm_gbs", "h2d_gbs", "d2h_gbs", "allreduce_busbw_gbs",
           "pair_busbw_gbs", "mpi_bw_gbs", "mpi_lat_us")
LOWER_IS_BETTER = {"mpi_lat_us"}
_STATUS_COLOR = {Status.OK: "#2e7d32", Status.WARNING: "#f9a825", Status.CRITICAL: "#c62828",
                 Status.UNKNOWN: "#757575"}

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.ok{color:#2e7d32}.bad{color:#c62828}
.warn{color:#b26a00}.muted{color:#757575}.grid{display:flex;flex-wrap:wrap;gap:8px}
.card{border:1px solid #eee;padding:4px}.badge{display:inline-block;padding:2px 8px;
border-radius:4px;color:#fff;font-weight:bold}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "–"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


# -- data -----------------------------------------------------------------------------------

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


# -- plots ----------------------------------------------------------------------------------

def trend_svg(title: str, points: Sequence[tuple[str, float]], floor: float, unit: str = "",
              ceiling: bool = False, width: int = 260, height: int = 120) -> str:
    """A small line chart of `points` (night, value) with the floor (or ceiling) dashed."""
    pad_l, pad_r, pad_t, pad_b = 42, 8, 18, 18
    vals = [v for _, v in points if math.isfinite(v)]
    top = max([*vals, floor, 1e-12]) * 1.15
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    n = len(points)

    def x(i: int) -> float:
        return pad_l + (w * i / (n - 1) if n > 1 else w / 2)

    def y(v: float) -> float:
        return pad_t + h - h * max(0.0, v) / top

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="trend" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img">',
             f"<title>{_e(title)}</title>",
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa"/>',
             f'<text x="4" y="12" font-size="11" fill="#333">{_e(title)}</text>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" '
             'stroke="#999"/>',
             f'<text x="{pad_l - 4}" y="{pad_t + 8}" font-size="9" text-anchor="end" '
             f'fill="#666">{_e(_fmt(top))}</text>',
             f'<text x="{pad_l - 4}" y="{pad_t + h}" font-size="9" text-anchor="end" '
             'fill="#666">0</text>']
    if floor > 0:
        fy = y(floor)
        parts.append(f'<line class="floor" x1="{pad_l}" y1="{fy:.1f}" x2="{pad_l + w}" '
                     f'y2="{fy:.1f}" stroke="#c62828" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{pad_l + w}" y="{fy - 2:.1f}" font-size="9" text-anchor="end" '
                     f'fill="#c62828">{"ceiling" if ceiling else "floor"} {_e(_fmt(floor))}'
                     "</text>")
    coords = [(x(i), y(v)) for i, (_, v) in enumerate(points) if math.isfinite(v)]
    if len(coords) > 1:
        pts = " ".join(f"{a:.1f},{b:.1f}" for a, b in coords)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#1565c0" stroke-width="1.5"/>')
    for (i, (night, v)) in enumerate(points):
        if not math.isfinite(v):
            continue
        bad = floor > 0 and (v > floor if ceiling else v < floor)
        parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" '
                     f'fill="{"#c62828" if bad else "#1565c0"}"><title>{_e(night)}: '
                     f"{_e(_fmt(v))} {_e(unit)}</title></circle>")
    if points:
        parts.append(f'<text x="{pad_l}" y="{height - 4}" font-size="9" fill="#666">'
                     f"{_e(points[0][0])}</text>")
        if n > 1:
            parts.append(f'<text x="{pad_l + w}" y="{height - 4}" font-size="9" '
                         f'text-anchor="end" fill="#666">{_e(points[-1][0])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def heatmap_svg(rec: NightRecord, floor_of: dict[tuple[str, str], float]) -> str:
    """Pairwise busbw (GB/s) as a node x node matrix; red below the floor, grey unmeasured."""
    nodes = sorted({p.node for p in rec.pairs} | {p.peer for p in rec.pairs}, key=natural_key)
    if not nodes:
        return '<p class="muted">No pair was measured this night.</p>'
    best: dict[tuple[str, str], float] = {}
    for p in rec.pairs:
        if math.isfinite(p.pair_busbw_gbs):
            for key in ((p.node, p.peer), (p.peer, p.node)):
                # the last round is the freshest look at a pair measured twice
                best[key] = p.pair_busbw_gbs
    cell, left, top_pad = 56, 70, 60
    size_w = left + cell * len(nodes) + 10
    size_h = top_pad + cell * len(nodes) + 10
    vals = list(best.values())
    vmax = max(vals) if vals else 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{size_w}" '
             f'height="{size_h}" viewBox="0 0 {size_w} {size_h}" role="img">',
             "<title>pairwise all_reduce busbw (GB/s)</title>"]
    for i, n in enumerate(nodes):
        parts.append(f'<text x="{left - 6}" y="{top_pad + cell * i + cell / 2 + 4}" '
                     f'font-size="11" text-anchor="end">{_e(n)}</text>')
        parts.append(f'<text x="{left + cell * i + cell / 2}" y="{top_pad - 8}" font-size="11" '
                     f'text-anchor="middle">{_e(n)}</text>')
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
            x0, y0 = left + cell * j, top_pad + cell * i
            v = best.get((a, b))
            if a == b or v is None:
                fill, label = ("#eeeeee", "" if a == b else "–")
            else:
                floor = max(floor_of.get((a, "pair_busbw_gbs"), 0.0),
                            floor_of.get((b, "pair_busbw_gbs"), 0.0))
                if floor > 0 and v < floor:
                    fill = "#e57373"
                else:
                    shade = int(200 - 120 * (v / vmax if vmax > 0 else 0))
                    fill = f"rgb({shade},{min(255, shade + 40)},{shade})"
                label = _fmt(v)
            parts.append(f'<rect class="cell" x="{x0}" y="{y0}" width="{cell - 2}" '
                         f'height="{cell - 2}" fill="{fill}"><title>{_e(a)} – {_e(b)}: '
                         f"{_e(label)} GB/s</title></rect>")
            if label:
                parts.append(f'<text x="{x0 + cell / 2 - 1}" y="{y0 + cell / 2 + 4}" '
                             f'font-size="11" text-anchor="middle">{_e(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# -- large-cluster views --------------------------------------------------------------------

#: Up to this many nodes the page keeps the node x node heatmap and every node's trends.
SMALL_CLUSTER = 16
#: On a larger cluster: the worst nodes labelled per histogram, nodes given trend panels, rows
#: of the problem table, and pairs listed by name before the rest are folded away.
WORST_N = 5
MAX_TREND_NODES = 24
MAX_PROBLEM_ROWS = 200
#: A node's figure this far (%) worse than its own median of the past nights is "regressed".
REGRESSION_PCT = 10.0
_BINS = 40


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


def histogram_svg(name: str, values: dict[str, float], floor: float, unit: str,
                  marked: Sequence[str], width: int = 540, height: int = 170,
                  failing: Collection[str] = ()) -> str:
    """All nodes' values of one figure as a histogram, the floor (or ceiling) dashed, and the
    `marked` nodes drawn as ticks and named below: red for the `failing` ones and values out
    of bounds, orange for the others (the worst)."""
    vals = sorted(v for v in values.values() if math.isfinite(v))
    ceiling = name in LOWER_IS_BETTER
    pad_l, pad_r, pad_t, pad_b = 40, 12, 20, 44
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    lo, hi = (vals[0], vals[-1]) if vals else (0.0, 1.0)
    # the floor widens the axis only when it is near the data; far off, it is an edge arrow
    if floor > 0 and (lo - (hi - lo) * 0.5 <= floor <= hi + (hi - lo) * 0.5 or hi <= lo):
        lo, hi = min(lo, floor), max(hi, floor)
    if hi <= lo:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    span = hi - lo
    lo, hi = lo - 0.02 * span, hi + 0.02 * span
    if vals and vals[0] >= 0 and (floor >= 0):
        lo = max(lo, 0.0)
    counts = [0] * _BINS
    for v in vals:
        counts[max(0, min(_BINS - 1, int((v - lo) / (hi - lo) * _BINS)))] += 1
    cmax = max(counts, default=1) or 1

    def x(v: float) -> float:
        return pad_l + w * (v - lo) / (hi - lo)

    title = f"{name} ({unit}), {len(vals)} nodes" if unit else f"{name}, {len(vals)} nodes"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="hist" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img">',
             f"<title>{_e(title)}</title>",
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa"/>',
             f'<text x="4" y="13" font-size="12" fill="#222">{_e(title)}</text>',
             f'<text x="{pad_l - 4}" y="{pad_t + 8}" font-size="9" text-anchor="end" '
             f'fill="#666">{cmax}</text>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" '
             'stroke="#999"/>',
             f'<text x="{pad_l}" y="{pad_t + h + 11}" font-size="9" fill="#666">'
             f"{_e(_fmt(lo))}</text>",
             f'<text x="{pad_l + w}" y="{pad_t + h + 11}" font-size="9" text-anchor="end" '
             f'fill="#666">{_e(_fmt(hi))}</text>']
    bw = w / _BINS
    for i, c in enumerate(counts):
        if c:
            bh = max(1.0, h * c / cmax)
            parts.append(f'<rect x="{pad_l + i * bw:.1f}" y="{pad_t + h - bh:.1f}" '
                         f'width="{bw - 1:.1f}" height="{bh:.1f}" fill="#90a4ae">'
                         f"<title>{_e(_fmt(lo + i * (hi - lo) / _BINS))}–"
                         f"{_e(_fmt(lo + (i + 1) * (hi - lo) / _BINS))}: {c} node(s)</title>"
                         "</rect>")
    if floor > 0:
        label = f'{"ceiling" if ceiling else "floor"} {_fmt(floor)}'
        if lo <= floor <= hi:
            fx = x(floor)
            parts.append(f'<line class="floor" x1="{fx:.1f}" y1="{pad_t}" x2="{fx:.1f}" '
                         f'y2="{pad_t + h}" stroke="#c62828" stroke-dasharray="4 3"/>')
            anchor = "end" if fx > pad_l + w / 2 else "start"
            fx += -3 if anchor == "end" else 3
        else:
            left = floor < lo
            fx, anchor = (pad_l + 2, "start") if left else (pad_l + w - 2, "end")
            label = f"◂ {label}" if left else f"{label} ▸"
        parts.append(f'<text x="{fx:.1f}" y="{pad_t + 8}" font-size="9" text-anchor="{anchor}" '
                     f'fill="#c62828">{_e(label)}</text>')
    bad_lab: list[str] = []
    worst_lab: list[str] = []
    for node in (n for n in marked if n in values):
        v = values[node]
        bad = node in failing or (floor > 0 and (v > floor if ceiling else v < floor))
        color = "#c62828" if bad else "#e65100"
        mx = x(v)
        parts.append(f'<line x1="{mx:.1f}" y1="{pad_t}" x2="{mx:.1f}" y2="{pad_t + h}" '
                     f'stroke="{color}" stroke-width="1.5"><title>{_e(node)}: {_e(_fmt(v))}'
                     "</title></line>")
        (bad_lab if bad else worst_lab).append(f"{node} {_fmt(v)}")
    budget = width // 6  # characters of 10 px text that fit the width
    for i, (labels, color, what) in enumerate(((bad_lab, "#c62828", "failing"),
                                               (worst_lab, "#e65100", "worst"))):
        shown: list[str] = []
        for lab in labels:
            if len(what) + sum(len(t) + 2 for t in [*shown, lab]) + 6 > budget:
                break
            shown.append(lab)
        if labels:
            more = f" (+{len(labels) - len(shown)})" if len(labels) > len(shown) else ""
            parts.append(f'<text x="4" y="{pad_t + h + 24 + 12 * i}" font-size="10" '
                         f'fill="{color}">{_e(what)}: {_e(", ".join(shown) + more)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def pairs_section(rec: NightRecord, floor_of: dict[tuple[str, str], float]) -> list[str]:
    """The measured pairs of a large cluster: a histogram of busbw, then the pairs as rows,
    slow ones first, then by busbw ascending."""
    last: dict[tuple[str, str], tuple[float, float, bool, int]] = {}
    for p in rec.pairs:  # the last round is the freshest look at a pair measured twice
        last[(p.node, p.peer)] = (p.pair_busbw_gbs, p.mpi_bw_gbs, p.slow, p.round)
    if not last:
        return ['<p class="muted">No pair was measured this night.</p>']

    def pair_floor(a: str, b: str) -> float:
        return max(floor_of.get((a, "pair_busbw_gbs"), 0.0),
                   floor_of.get((b, "pair_busbw_gbs"), 0.0))

    order = sorted(last, key=lambda k: (not last[k][2], last[k][0] if math.isfinite(last[k][0])
                                        else -math.inf, natural_key(k[0]), natural_key(k[1])))
    slow = [k for k in order if last[k][2]]
    worst = slow + [k for k in order if not last[k][2]][:WORST_N]
    values = {f"{a}–{b}": last[(a, b)][0] for a, b in order}
    floors_seen = sorted({pair_floor(a, b) for a, b in order})
    out = [f'<p>{len(last)} pair(s) measured, <span class="{"bad" if slow else "ok"}">'
           f"{len(slow)} slow</span>.</p>",
           histogram_svg("pair_busbw_gbs", values, floors_seen[0] if floors_seen else 0.0,
                         "GB/s", [f"{a}–{b}" for a, b in worst],
                         failing={f"{a}–{b}" for a, b in slow})]
    out.append('<table id="pairs"><tr><th>pair</th><th>round</th><th>busbw GB/s</th>'
               "<th>mpi GB/s</th><th>floor</th><th></th></tr>")
    for a, b in worst:
        busbw, mpi, is_slow, rnd = last[(a, b)]
        out.append(f'<tr><td class="{"bad" if is_slow else "warn"}">{_e(a)}–{_e(b)}</td>'
                   f"<td>{rnd}</td><td>{_e(_fmt(busbw))}</td><td>{_e(_fmt(mpi))}</td>"
                   f"<td>{_e(_fmt(pair_floor(a, b)))}</td>"
                   f"<td>{'slow' if is_slow else 'among the slowest'}</td></tr>")
    out.append("</table>")
    rows = [f"{'pair':<28} {'round':>5} {'busbw':>9} {'mpi':>9} slow"]
    for a, b in order:
        busbw, mpi, is_slow, rnd = last[(a, b)]
        rows.append(f"{a + '–' + b:<28} {rnd:>5} {_fmt(busbw):>9} {_fmt(mpi):>9} "
                    f"{'yes' if is_slow else ''}".rstrip())
    out.append(f"<details><summary>All {len(order)} pairs, slowest first</summary>"
               f'<pre id="pair-rows">{_e(chr(10).join(rows))}</pre></details>')
    return out


def node_rows(rec: NightRecord, tonight: dict[str, dict[str, float]]) -> str:
    """One fixed-width text row per node, failing ones first."""
    names = [f for f in FIGURES if f in tonight]
    order = sorted(rec.nodes, key=lambda n: (-Status(n.status).severity if n.culprit
                                             or n.status != Status.OK else 1,
                                             natural_key(n.node)))
    rows = [f"{'node':<20} {'class':<10} {'status':<8} "
            + " ".join(f"{f[:13]:>13}" for f in names)]
    for n in order:
        rows.append(f"{n.node:<20} {n.node_class:<10} {Status(n.status).name:<8} "
                    + " ".join(f"{_fmt(tonight[f].get(n.node, math.nan)):>13}" for f in names))
    return f'<pre id="node-rows">{_e(chr(10).join(rows))}</pre>'


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


# -- page -----------------------------------------------------------------------------------

def render_html(rec: NightRecord, past: Sequence[NightRecord]) -> str:
    """The report page of night `rec`, with trends over `past` (which may include `rec`)."""
    records = sorted({r.night: r for r in [*past, rec]}.values(), key=lambda r: r.night)
    worst_status = max((Status(n.status) for n in rec.nodes), default=Status.OK,
                       key=lambda s: s.severity)
    badge = _STATUS_COLOR[worst_status]
    subjects = {p.node for p in rec.pairs} | {p.peer for p in rec.pairs} | {
        n.node for n in rec.nodes}
    small = len(subjects) <= SMALL_CLUSTER
    failing = [n for n in rec.nodes if n.culprit or n.status == Status.CRITICAL]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>bluevela nightly {_e(rec.night)} – {_e(rec.cluster)}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>Nightly acceptance {_e(rec.night)} – {_e(rec.cluster)} "
           f'<span class="badge" style="background:{badge}">{_e(worst_status.name)}</span></h1>',
           f'<p class="muted">{len(rec.nodes)} node(s), {len(rec.pairs)} pair measurement(s); '
           f'<span class="{"bad" if failing else "ok"}">{len(failing)} failing</span>; '
           f"{_e(rec.started_utc)} → {_e(rec.finished_utc)}; bluevela {_e(rec.version)}</p>"]

    # Verdict
    out.append("<h2>Failures and drained nodes</h2>")
    if failing:
        out.append('<table id="drained"><tr><th>node</th><th>class</th><th>drained</th>'
                   "<th>reason</th></tr>")
        for n in sorted(failing, key=lambda r: natural_key(r.node)):
            out.append(f'<tr><td class="bad">{_e(n.node)}</td><td>{_e(n.node_class)}</td>'
                       f"<td>{'yes' if n.drained else 'no'}</td><td>{_e(n.reason)}</td></tr>")
        out.append("</table>")
    else:
        out.append('<p class="ok" id="drained">No node failed acceptance.</p>')
    if rec.link_faults:
        out.append("<p>Slow links (each node fine with another partner): "
                   + ", ".join(_e(f"{a}–{b}") for a, b in rec.link_faults) + "</p>")
    if rec.unresolved:
        out.append("<p>Slow pairs not isolated: "
                   + ", ".join(_e(f"{a}–{b}") for a, b in rec.unresolved) + "</p>")
    problems = sorted((r for r in rec.results if r.status != Status.OK),
                      key=lambda r: (-Status(r.status).severity, natural_key(r.node)))
    if problems:
        out.append('<table id="failures"><tr><th>subject</th><th>measurement</th>'
                   "<th>status</th><th>message</th></tr>")
        for r in problems[:MAX_PROBLEM_ROWS]:
            subject = f"{r.node}+{r.peer}" if r.peer else r.node
            status = Status(r.status)
            cls = "bad" if status is Status.CRITICAL else "warn"
            out.append(f"<tr><td>{_e(subject)}</td><td>{_e(r.measurement)}</td>"
                       f'<td class="{cls}">{_e(status.name)}</td><td>{_e(r.message)}</td></tr>')
        out.append("</table>")
        if len(problems) > MAX_PROBLEM_ROWS:
            out.append(f'<p class="muted">… and {len(problems) - MAX_PROBLEM_ROWS} more '
                       "(every node's status is in the table at the end).</p>")

    floor_of = floors(rec)
    series = node_series(records)
    units = {row.name: row.unit for r in records for row in r.figures if row.headline}
    if small:
        out.append("<h2>Pairwise all_reduce busbw (GB/s)</h2>")
        out.append(heatmap_svg(rec, floor_of))
    else:
        out.append("<h2>Measured pairs: all_reduce busbw (GB/s)</h2>")
        out.extend(pairs_section(rec, floor_of))
        # Distributions
        tonight = tonight_values(rec)
        failing_names = [n.node for n in sorted(failing, key=lambda r: natural_key(r.node))]
        out.append("<h2>Distributions over all nodes tonight</h2>")
        out.append(f'<p class="muted">Failing nodes in red, the {WORST_N} worst others in '
                   "orange; the dashed line is the class floor (ceiling for latency).</p>"
                   '<div class="grid">')
        for name in FIGURES:
            values = tonight.get(name)
            if not values:
                continue
            order = sorted(values, key=lambda n: values[n], reverse=name in LOWER_IS_BETTER)
            worst = [n for n in order if n not in set(failing_names)][:WORST_N]
            fl = sorted(floor_of.get((n, name), 0.0) for n in values)
            floor = fl[len(fl) // 2] if fl else 0.0
            out.append('<div class="card">' + histogram_svg(
                name, values, floor, units.get(name, ""),
                [*[n for n in failing_names if n in values][:2 * WORST_N], *worst],
                failing=set(failing_names)) + "</div>")
        out.append("</div>")

    # Trends
    if small:
        out.append(f"<h2>Trends over the last {len(records)} night(s)</h2>")
        trend_nodes = [(n, "") for n in sorted(series, key=natural_key)]
    else:
        flagged = flagged_nodes(rec, series)
        trend_nodes = flagged[:MAX_TREND_NODES]
        out.append(f"<h2>Trends over the last {len(records)} night(s): fleet median and "
                   f"{len(trend_nodes)} failing or regressed node(s)</h2>")
        if len(flagged) > len(trend_nodes):
            out.append(f'<p class="muted">{len(flagged) - len(trend_nodes)} more flagged '
                       "node(s) not drawn: "
                       + _e(", ".join(n for n, _ in flagged[MAX_TREND_NODES:])) + "</p>")
        out.append('<h3>fleet median</h3><div class="grid">')
        medians = fleet_trends(series)
        for name in FIGURES:
            pts = medians.get(name)
            if pts:
                out.append('<div class="card">' + trend_svg(
                    f"median {name}", pts, 0.0, units.get(name, ""),
                    ceiling=name in LOWER_IS_BETTER) + "</div>")
        out.append("</div>")
    for node, why in trend_nodes:
        figs = series.get(node, {})
        label = f" <span class=\"bad\">{_e(why)}</span>" if why else ""
        out.append(f"<h3>{_e(node)}{label}</h3><div class=\"grid\">")
        for name in FIGURES:
            if name not in figs:
                continue
            floor = floor_of.get((node, name), 0.0)
            out.append('<div class="card">' + trend_svg(
                f"{node} {name}", figs[name], floor, units.get(name, ""),
                ceiling=name in LOWER_IS_BETTER) + "</div>")
        out.append("</div>")
    if not small:
        out.append("<h2>Every node tonight</h2>")
        out.append(f"<details><summary>{len(rec.nodes)} nodes, failing first</summary>"
                   + node_rows(rec, tonight_values(rec)) + "</details>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(root: Path, night: str | None, html_path: Path,
                 nights: int = TREND_NIGHTS) -> Path:
    """Render night `night` (default: the latest) of the nightly directory `root` to
    `html_path`, atomically.

    Raises:
        ArchiveError: when there is no such night.
    """
    known = list_nights(root)
    if not known:
        raise ArchiveError(f"{root}: no nightly record yet")
    night = night or known[-1]
    if night not in known:
        raise ArchiveError(f"no nightly record for {night} in {root} "
                           f"(latest: {', '.join(known[-3:])})")
    rec = read_night(night_path(root, night))
    past = read_nights(root, [n for n in known if n < night][-(nights - 1):])
    text = render_html(rec, past)
    atomic_write(html_path, text.encode("utf-8"))
    return html_path
