"""`bv bench report`: one self-contained HTML page per night, readable in a minute.

Sections: the verdict (failures, drained nodes, faulty links), a heatmap of pairwise busbw, and
per-node trends of every headline figure over the recent nights with the class floor drawn in.
Plots are inline SVG generated here: no JavaScript, no fonts or images fetched, no matplotlib.
Every text from the record is HTML-escaped.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from bluevela.bench.pairing import natural_key
from bluevela.bench.result import Status
from bluevela.bench.store import NightRecord, list_nights, night_path, read_night, read_nights
from bluevela.errors import ArchiveError
from bluevela.util.fs import atomic_write

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


# -- page -----------------------------------------------------------------------------------

def render_html(rec: NightRecord, past: Sequence[NightRecord]) -> str:
    """The report page of night `rec`, with trends over `past` (which may include `rec`)."""
    records = sorted({r.night: r for r in [*past, rec]}.values(), key=lambda r: r.night)
    worst_status = max((Status(n.status) for n in rec.nodes), default=Status.OK,
                       key=lambda s: s.severity)
    badge = _STATUS_COLOR[worst_status]
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>bluevela nightly {_e(rec.night)} – {_e(rec.cluster)}</title>",
           f"<style>{_CSS}</style></head><body>",
           f"<h1>Nightly acceptance {_e(rec.night)} – {_e(rec.cluster)} "
           f'<span class="badge" style="background:{badge}">{_e(worst_status.name)}</span></h1>',
           f'<p class="muted">{len(rec.nodes)} node(s), {len(rec.pairs)} pair measurement(s); '
           f"{_e(rec.started_utc)} → {_e(rec.finished_utc)}; bluevela {_e(rec.version)}</p>"]

    # Verdict
    out.append("<h2>Failures and drained nodes</h2>")
    failing = [n for n in rec.nodes if n.culprit or n.status == Status.CRITICAL]
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
    problems = [r for r in rec.results if r.status != Status.OK]
    if problems:
        out.append('<table id="failures"><tr><th>subject</th><th>measurement</th>'
                   "<th>status</th><th>message</th></tr>")
        for r in problems:
            subject = f"{r.node}+{r.peer}" if r.peer else r.node
            status = Status(r.status)
            cls = "bad" if status is Status.CRITICAL else "warn"
            out.append(f"<tr><td>{_e(subject)}</td><td>{_e(r.measurement)}</td>"
                       f'<td class="{cls}">{_e(status.name)}</td><td>{_e(r.message)}</td></tr>')
        out.append("</table>")

    # Heatmap
    floor_of = floors(rec)
    out.append("<h2>Pairwise all_reduce busbw (GB/s)</h2>")
    out.append(heatmap_svg(rec, floor_of))

    # Trends
    out.append(f"<h2>Trends over the last {len(records)} night(s)</h2>")
    series = node_series(records)
    units = {row.name: row.unit for r in records for row in r.figures if row.headline}
    for node in sorted(series, key=natural_key):
        figs = series[node]
        out.append(f"<h3>{_e(node)}</h3><div class=\"grid\">")
        for name in FIGURES:
            if name not in figs:
                continue
            floor = floor_of.get((node, name), 0.0)
            out.append('<div class="card">' + trend_svg(
                f"{node} {name}", figs[name], floor, units.get(name, ""),
                ceiling=name in LOWER_IS_BETTER) + "</div>")
        out.append("</div>")
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
