"""`bv bench report`: one self-contained HTML page per night, readable in a minute.

Sections, most urgent first: the verdict (failing and drained nodes, slow pairs), the measured
pairs (a node x node heatmap on a small cluster; on a large one a histogram and a list sorted
slowest first), the distribution of every headline figure over all nodes with the failing and
worst nodes labelled, trends (every node on a small cluster; on a large one only the failing and
regressed nodes, plus the fleet's median), and one compact text row per node.
A 1,000-node night stays under 2 MB (it was 202 MB as a million-cell heatmap and 3,000 trend
panels). The numbers come from `bluevela.report.nightly`; the charts are matplotlib figures
inlined as SVG through `bluevela.report.page`: no JavaScript, nothing fetched. Every text from
the record is HTML-escaped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from bluevela.bench.result import Status
from bluevela.bench.store import (
    NightRecord,
    NodeRow,
    list_nights,
    night_path,
    read_night,
    read_nights,
)
from bluevela.errors import ArchiveError
from bluevela.report import page
from bluevela.report.nightly import (
    FIGURES,
    LOWER_IS_BETTER,
    MAX_PROBLEM_ROWS,
    MAX_TREND_NODES,
    SMALL_CLUSTER,
    TREND_NIGHTS,
    WORST_N,
    flagged_nodes,
    fleet_trends,
    floors,
    node_series,
    tonight_values,
)
from bluevela.report.page import esc as _e
from bluevela.report.page import fmt_num as _fmt
from bluevela.util.names import natural_key

logger = logging.getLogger(__name__)

_STATUS_COLOR = {Status.OK: page.OK, Status.WARNING: "#f9a825", Status.CRITICAL: page.BAD,
                 Status.UNKNOWN: page.MUTED}
_BINS = 40


# -- plots ----------------------------------------------------------------------------------

def _axes(fig: Any, width: float, height: float, pad: tuple[float, float, float, float]
          ) -> Any:
    """Axes inside `fig` with margins (left, right, top, bottom) in pixels."""
    left, right, top, bottom = pad
    return fig.add_axes((left / width, bottom / height, (width - left - right) / width,
                         (height - top - bottom) / height))


def trend_svg(title: str, points: Sequence[tuple[str, float]], floor: float, unit: str = "",
              ceiling: bool = False, width: int = 260, height: int = 120) -> str:
    """A small line chart of `points` (night, value) with the floor (or ceiling) dashed, the
    nights beyond it red; each point shows its night and value on hover."""
    vals = [v for _, v in points if math.isfinite(v)]
    top = max([*vals, floor, 1e-12]) * 1.15
    n = len(points)
    fig = page.figure(width, height)
    fig.text(4 / width, 1 - 13 / height, title, fontsize=10, color="#333")
    ax = _axes(fig, width, height, (42, 8, 18, 18))
    ax.patch.set_visible(False)  # the page's white: one path less per chart
    shown = [(i, night, v) for i, (night, v) in enumerate(points) if math.isfinite(v)]
    xs = [i for i, _, _ in shown]
    ys = [v for _, _, v in shown]
    hover = [f"{night}: {_fmt(v)} {unit}".rstrip() for _, night, v in shown]
    dot = page.dot()
    # over the axis line (zorder 3): a point at 0 is hovered, not the line
    ax.plot(xs, ys, "-", marker=dot, color=page.LINE, lw=1.5, ms=5, gid="series",
            clip_on=False, solid_capstyle="butt", zorder=3)
    titles = {"series": hover}
    if floor > 0:
        bad = [k for k, v in enumerate(ys) if (v > floor if ceiling else v < floor)]
        if bad:
            ax.plot([xs[k] for k in bad], [ys[k] for k in bad], marker=dot, ls="",
                    color=page.BAD, ms=5, gid="out-of-bounds", clip_on=False, zorder=3)
            titles["out-of-bounds"] = [hover[k] for k in bad]  # drawn over the blue ones
        # inside the axes by the y limits: no clip path to write
        ax.axhline(floor, color=page.BAD, ls=(0, (4, 3)), lw=1, clip_on=False)
        ax.text(1, floor, f"{'ceiling' if ceiling else 'floor'} {_fmt(floor)}", color=page.BAD,
                fontsize=8, ha="right", va="bottom", transform=ax.get_yaxis_transform())
    ax.set_ylim(0, top)
    ax.set_yticks([0, top], ["0", _fmt(top)])
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_xticks([0, n - 1] if n > 1 else [0] if n else [],
                  [points[0][0], points[-1][0]] if n > 1 else [p[0] for p in points])
    ax.tick_params(labelsize=8, length=0)
    ax.spines["left"].set_visible(False)
    ax.spines["bottom"].set(capstyle="butt", joinstyle="round")  # the page's defaults: unsaid
    return page.svg(fig, f"{title} ({unit})" if unit else title, "trend", titles=titles)


def heatmap_svg(rec: NightRecord, floor_of: dict[tuple[str, str], float]) -> str:
    """Pairwise busbw (GB/s) as a node x node matrix; red below the floor, grey unmeasured;
    each cell names its pair and value on hover."""
    nodes = sorted({p.node for p in rec.pairs} | {p.peer for p in rec.pairs}, key=natural_key)
    if not nodes:
        return '<p class="muted">No pair was measured this night.</p>'
    best: dict[tuple[str, str], float] = {}
    for p in rec.pairs:
        if math.isfinite(p.pair_busbw_gbs):
            for key in ((p.node, p.peer), (p.peer, p.node)):
                # the last round is the freshest look at a pair measured twice
                best[key] = p.pair_busbw_gbs
    from matplotlib.patches import Rectangle

    cell, left, top_pad = 56, 70, 24
    n = len(nodes)
    size_w, size_h = left + cell * n + 10, top_pad + cell * n + 10
    vmax = max(best.values(), default=1.0)
    hover: dict[str, list[str]] = {}
    fig = page.figure(size_w, size_h)
    ax = _axes(fig, size_w, size_h, (left, 10, top_pad, 10))
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.patch.set_visible(False)  # the page's white
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes):
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
                    fill = f"#{shade:02x}{min(255, shade + 40):02x}{shade:02x}"
                label = _fmt(v)
            ax.add_patch(Rectangle((j, i), 1 - 2 / cell, 1 - 2 / cell, color=fill,
                                   gid=f"cell-{i}-{j}", clip_on=False))  # inside the axes
            if a != b:  # the cell and its number (drawn over it) say the pair on hover
                hover[f"cell-{i}-{j}"] = hover[f"value-{i}-{j}"] = [
                    f"{a} – {b}: {label} GB/s" if v is not None else f"{a} – {b}: not measured"]
            if label:
                ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=10,
                        gid=f"value-{i}-{j}")
    ax.set_xticks([k + 0.5 for k in range(n)], nodes)
    ax.set_yticks([k + 0.5 for k in range(n)], nodes)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return page.svg(fig, "pairwise all_reduce busbw (GB/s)", "heatmap", titles=hover)


# -- large-cluster views --------------------------------------------------------------------

def histogram_svg(name: str, values: dict[str, float], floor: float, unit: str,
                  marked: Sequence[str], width: int = 540, height: int = 170,
                  failing: Collection[str] = ()) -> str:
    """All nodes' values of one figure as a histogram, the floor (or ceiling) dashed, and the
    `marked` nodes drawn as ticks and named below: red for the `failing` ones and values out
    of bounds, orange for the others (the worst)."""
    vals = sorted(v for v in values.values() if math.isfinite(v))
    ceiling = name in LOWER_IS_BETTER
    lo, hi = _hist_range(vals, floor)
    counts = [0] * _BINS
    for v in vals:
        counts[max(0, min(_BINS - 1, int((v - lo) / (hi - lo) * _BINS)))] += 1
    cmax = max(counts, default=1) or 1
    title = f"{name} ({unit}), {len(vals)} nodes" if unit else f"{name}, {len(vals)} nodes"
    fig = page.figure(width, height)
    fig.text(4 / width, 1 - 14 / height, title, fontsize=11)
    ax = _axes(fig, width, height, (40, 12, 20, 44))
    ax.set_facecolor("#fafafa")
    ax.stairs(counts, [lo + k * (hi - lo) / _BINS for k in range(_BINS + 1)], fill=True,
              color=page.BAR)
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, cmax * 1.05)
    ax.set_yticks([cmax], [str(cmax)])
    ax.set_xticks([lo, hi], [_fmt(lo), _fmt(hi)])
    ax.tick_params(labelsize=8, length=2)
    ax.get_xticklabels()[0].set_horizontalalignment("left")
    ax.get_xticklabels()[-1].set_horizontalalignment("right")
    if floor > 0:
        _floor_mark(ax, floor, lo, hi, ceiling)
    _marked_nodes(fig, ax, values, marked, failing, floor, ceiling, cmax, width, height)
    return page.svg(fig, title, "hist")


def _hist_range(vals: Sequence[float], floor: float) -> tuple[float, float]:
    """The histogram's x range: the values', widened to the floor when it is near them, a
    little margin, never below 0 for values and a floor that are not."""
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
    return lo, hi


def _floor_mark(ax: Any, floor: float, lo: float, hi: float, ceiling: bool) -> None:
    """The floor (or ceiling): a dashed line with its label inside the range, else an arrow
    at the edge it is beyond."""
    label = f'{"ceiling" if ceiling else "floor"} {_fmt(floor)}'
    if lo <= floor <= hi:
        ax.axvline(floor, color=page.BAD, ls=(0, (4, 3)), lw=1)
        right = floor > (lo + hi) / 2
        ax.text(floor, 0.97, f"{label} " if right else f" {label}", color=page.BAD,
                fontsize=8, ha="right" if right else "left", va="top",
                transform=ax.get_xaxis_transform())
    else:
        left = floor < lo
        ax.text(0.005 if left else 0.995, 0.97, f"◂ {label}" if left else f"{label} ▸",
                color=page.BAD, fontsize=8, ha="left" if left else "right", va="top",
                transform=ax.transAxes)


def _marked_nodes(fig: Any, ax: Any, values: dict[str, float], marked: Sequence[str],
                  failing: Collection[str], floor: float, ceiling: bool, cmax: int,
                  width: int, height: int) -> None:
    """The `marked` nodes as ticks (red: failing or out of bounds, orange: the worst) and
    named below the axes, as many as fit the width."""
    bad_lab: list[str] = []
    worst_lab: list[str] = []
    ticks: dict[str, list[float]] = {page.BAD: [], page.WARN: []}
    for node in (n for n in marked if n in values):
        v = values[node]
        bad = node in failing or (floor > 0 and (v > floor if ceiling else v < floor))
        ticks[page.BAD if bad else page.WARN].append(v)
        (bad_lab if bad else worst_lab).append(f"{node} {_fmt(v)}")
    for color, xs in ticks.items():
        if xs:
            ax.vlines(xs, 0, cmax * 1.05, colors=color, lw=1.5)
    budget = width // 6  # characters of 10 px text that fit the width
    for i, (labels, color, what) in enumerate(((bad_lab, page.BAD, "failing"),
                                               (worst_lab, page.WARN, "worst"))):
        shown: list[str] = []
        for lab in labels:
            if len(what) + sum(len(t) + 2 for t in [*shown, lab]) + 6 > budget:
                break
            shown.append(lab)
        if labels:
            more = f" (+{len(labels) - len(shown)})" if len(labels) > len(shown) else ""
            fig.text(4 / width, (20 - 12 * i) / height, f"{what}: {', '.join(shown)}{more}",
                     fontsize=9, color=color)


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
    """One fixed-width text row per node, failing ones first; each column as wide as its
    longest entry (a 1,000-node page: 44 kB less than 13 characters for every figure)."""
    names = [f for f in FIGURES if f in tonight]
    order = sorted(rec.nodes, key=lambda n: (-Status(n.status).severity if n.culprit
                                             or n.status != Status.OK else 1,
                                             natural_key(n.node)))
    table = [["node", "class", "status", *names]]
    table += [[n.node, n.node_class, Status(n.status).name,
               *[_fmt(tonight[f].get(n.node, math.nan)) for f in names]] for n in order]
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    rows = [" ".join(cell.ljust(w) if c < 3 else cell.rjust(w)
                     for c, (cell, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in table]
    return f'<pre id="node-rows">{_e(chr(10).join(rows))}</pre>'


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
    out = [f"<h1>Nightly acceptance {_e(rec.night)} – {_e(rec.cluster)} "
           f'<span class="badge" style="background:{badge}">{_e(worst_status.name)}</span></h1>',
           f'<p class="muted">{len(rec.nodes)} node(s), {len(rec.pairs)} pair measurement(s); '
           f'<span class="{"bad" if failing else "ok"}">{len(failing)} failing</span>; '
           f"{_e(rec.started_utc)} → {_e(rec.finished_utc)}; bluevela {_e(rec.version)}</p>"]
    out += _verdict_section(rec, failing)
    floor_of = floors(rec)
    series = node_series(records)
    units = {row.name: row.unit for r in records for row in r.figures if row.headline}
    if small:
        out.append("<h2>Pairwise all_reduce busbw (GB/s)</h2>")
        out.append(heatmap_svg(rec, floor_of))
    else:
        out.append("<h2>Measured pairs: all_reduce busbw (GB/s)</h2>")
        out.extend(pairs_section(rec, floor_of))
        out += _distributions_section(rec, failing, floor_of, units)
    out += _trends_section(rec, records, series, floor_of, units, small)
    if not small:
        out.append("<h2>Every node tonight</h2>")
        out.append(f"<details><summary>{len(rec.nodes)} nodes, failing first</summary>"
                   + node_rows(rec, tonight_values(rec)) + "</details>")
    return page.document(f"bluevela nightly {rec.night} – {rec.cluster}", out)


def _verdict_section(rec: NightRecord, failing: Sequence[NodeRow]) -> list[str]:
    """The failing and drained nodes, the slow links and pairs, the failed measurements."""
    out = ["<h2>Failures and drained nodes</h2>"]
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
    return out


def _distributions_section(rec: NightRecord, failing: Sequence[NodeRow],
                           floor_of: dict[tuple[str, str], float],
                           units: dict[str, str]) -> list[str]:
    """A large cluster's histograms of tonight's figures over all nodes."""
    tonight = tonight_values(rec)
    failing_names = [n.node for n in sorted(failing, key=lambda r: natural_key(r.node))]
    out = ["<h2>Distributions over all nodes tonight</h2>",
           f'<p class="muted">Failing nodes in red, the {WORST_N} worst others in '
           "orange; the dashed line is the class floor (ceiling for latency).</p>"
           '<div class="grid">']
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
    return out


def _trends_section(rec: NightRecord, records: Sequence[NightRecord],
                    series: dict[str, dict[str, list[tuple[str, float]]]],
                    floor_of: dict[tuple[str, str], float], units: dict[str, str],
                    small: bool) -> list[str]:
    """Each node's trend over the nights (a large cluster: the fleet median and only the
    failing or regressed nodes)."""
    out: list[str] = []
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
    return out


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
    page.write_page(html_path, text)
    return html_path
