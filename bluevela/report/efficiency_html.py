"""The `--efficiency --html` page: one self-contained file (no scripts, no external resources).

Sized for 1,000 nodes: the node x time heatmap is ONE embedded palette PNG (one pixel per node
and time bin, encoded here with zlib: no imaging library), the per-node distributions are
histograms with the stragglers labelled, and only the stragglers get a time series, drawn
against the job's 10-90 % band and median. Stragglers and their evidence come first.
"""

from __future__ import annotations

import base64
import html
import math
import struct
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bluevela.report.efficiency import fmt_duration

if TYPE_CHECKING:
    import numpy as np

    from bluevela.report.efficiency import Efficiency

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#666;margin-bottom:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:140px}
.card b{display:block;font-size:20px}.card span{color:#666;font-size:12px}
.bad{color:#b00020}.ok{color:#1b7f3b}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eee;
padding:3px 8px;text-align:left}th{background:#f6f6f6}
svg text{font-size:11px;fill:#333}.note{color:#666;font-size:12px}
"""

# viridis, 5 anchors, interpolated to 254 levels; index 255 = no data (light grey)
_ANCHORS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def _palette() -> bytes:
    out = bytearray()
    for i in range(254):
        x = i / 253 * (len(_ANCHORS) - 1)
        k = min(int(x), len(_ANCHORS) - 2)
        f = x - k
        a, b = _ANCHORS[k], _ANCHORS[k + 1]
        out += bytes(round(a[c] + (b[c] - a[c]) * f) for c in range(3))
    out += bytes((200, 200, 200)) + bytes((230, 230, 230))
    return bytes(out)


def _color(v: float, lo: float, hi: float) -> str:
    pal = _palette()
    i = 0 if hi <= lo else max(0, min(253, round((v - lo) / (hi - lo) * 253)))
    return "#" + pal[3 * i:3 * i + 3].hex()


def png_palette(index: np.ndarray) -> bytes:
    """An 8-bit palette PNG of a [H, W] uint8 index array (255 = no data)."""
    import numpy as np

    h, w = index.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = np.hstack([np.zeros((h, 1), np.uint8), index.astype(np.uint8)]).tobytes()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 3, 0, 0, 0))
            + chunk(b"PLTE", _palette()) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float | None, unit: str = "", nd: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.{nd}f}{unit}"


def _dur(s: float | None) -> str:
    return fmt_duration(s, missing="–")


_UNITS = {"util_pct": ("GPU utilisation", "%", 0.0, 100.0),
          "cpu_busy_pct": ("CPU busy", "%", 0.0, 100.0),
          "cpu_throttled_pct": ("CPU throttled (share of time)", "%", 0.0, 100.0),
          "power_w": ("GPU power", " W", None, None),
          "sm_clock_mhz": ("SM clock", " MHz", None, None)}


def _heatmap(values: np.ndarray, title: str, lo: float, hi: float, nodes: Sequence[str],
             marked: dict[str, str], times: np.ndarray, steady: np.ndarray) -> str:
    """Nodes (rows) x time bins (columns) as one PNG inside an SVG with axes and labels."""
    import numpy as np

    n, b = values.shape
    with np.errstate(invalid="ignore"):
        idx = np.clip(np.round((values - lo) / max(hi - lo, 1e-9) * 253), 0, 253)
    idx = np.where(np.isfinite(values), idx, 255).astype(np.uint8)
    png = base64.b64encode(png_palette(idx)).decode()
    row = 24 if n <= 8 else 12 if n <= 40 else 4 if n <= 200 else 1
    left, top, width = 120, 18, 820
    height = n * row
    parts = [f'<svg width="{left + width + 190}" height="{max(top + height + 40, 170)}" '
             f'role="img" aria-label="{_e(title)}">']
    # steady-state strip
    for k in range(b):
        if steady[k]:
            x = left + width * k / b
            parts.append(f'<rect x="{x:.1f}" y="4" width="{width / b + 0.5:.1f}" height="8" '
                         'fill="#9ecae1"/>')
    parts.append(f'<text x="{left - 6}" y="12" text-anchor="end">steady</text>')
    parts.append(f'<image x="{left}" y="{top}" width="{width}" height="{height}" '
                 f'preserveAspectRatio="none" style="image-rendering:pixelated" '
                 f'href="data:image/png;base64,{png}"/>')
    if n <= 40:
        for i, name in enumerate(nodes):
            parts.append(f'<text x="{left - 6}" y="{top + i * row + row / 2 + 4:.1f}" '
                         f'text-anchor="end">{_e(name)}</text>')
    else:
        parts.append(f'<text x="{left - 6}" y="{top + 10}" text-anchor="end">{_e(nodes[0])}'
                     f'</text><text x="{left - 6}" y="{top + height}" text-anchor="end">'
                     f'{_e(nodes[-1])}</text>')
    for j, (name, why) in enumerate(sorted(marked.items())[:20]):
        if name not in nodes:
            continue
        y = top + nodes.index(name) * row + row / 2
        ly = min(top + height - 4, max(top + 8, y)) + (0 if n <= 40 else 0)
        parts.append(f'<line x1="{left + width}" y1="{y:.1f}" x2="{left + width + 14}" '
                     f'y2="{ly:.1f}" stroke="#b00020"/>'
                     f'<text x="{left + width + 16}" y="{ly + 4:.1f}" fill="#b00020" '
                     f'class="bad"><title>{_e(why)}</title>{_e(name)}</text>')
        del j
    if len(times):
        span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
        for k in range(6):
            frac = k / 5
            parts.append(f'<text x="{left + width * frac:.0f}" y="{top + height + 16}" '
                         f'text-anchor="middle">{_dur(span * frac)}</text>')
    parts.append(f'<text x="{left + width / 2}" y="{top + height + 34}" text-anchor="middle">'
                 f'time since the first sample</text>')
    # colour legend
    for k in range(11):
        v = lo + (hi - lo) * k / 10
        parts.append(f'<rect x="{left + width + 120}" y="{top + 10 + (10 - k) * 12}" '
                     f'width="14" height="12" fill="{_color(v, lo, hi)}"/>')
        if k % 5 == 0:
            parts.append(f'<text x="{left + width + 138}" y="{top + 20 + (10 - k) * 12}">'
                         f'{v:.0f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _histogram(values: np.ndarray, names: Sequence[str], title: str, unit: str,
               marked: dict[str, str]) -> str:
    """Distribution of per-unit values; bars holding a straggler red, stragglers labelled."""
    import numpy as np

    ok = np.isfinite(values)
    if not ok.any():
        return ""
    v = values[ok]
    lo, hi = float(v.min()), float(v.max())
    if hi - lo < 1e-9:
        lo, hi = lo - 1, hi + 1
    bins = 40
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    w, h, left, top = 520, 170, 40, 20
    cmax = max(int(counts.max()), 1)
    which = np.clip(((np.nan_to_num(values, nan=lo) - lo) / (hi - lo) * bins).astype(int),
                    0, bins - 1)
    red = {int(which[i]) for i, nm in enumerate(names) if nm in marked and ok[i]}
    parts = [f'<svg width="{w + left + 20}" height="{h + top + 90}" role="img" '
             f'aria-label="{_e(title)}"><text x="{left}" y="12">{_e(title)}</text>']
    bw = w / bins
    for k, c in enumerate(counts):
        if not c:
            continue
        bh = max(1.0, h * math.log1p(int(c)) / math.log1p(cmax))
        fill = "#b00020" if k in red else "#4c78a8"
        parts.append(f'<rect x="{left + k * bw:.1f}" y="{top + h - bh:.1f}" '
                     f'width="{bw - 1:.1f}" height="{bh:.1f}" fill="{fill}">'
                     f'<title>{int(c)} in [{edges[k]:.1f}, {edges[k + 1]:.1f})</title></rect>')
    nd = 0 if hi - lo >= 10 else 1 if hi - lo >= 1 else 2
    for k in range(5):
        x = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{left + w * k / 4:.0f}" y="{top + h + 14}" '
                     f'text-anchor="middle">{x:.{nd}f}{_e(unit)}</text>')
    seen: dict[str, float] = {}  # one label per straggler (a whole node: its first GPU)
    for i, nm in enumerate(names):
        if nm in marked and ok[i] and marked[nm] not in seen:
            seen[marked[nm]] = float(values[i])
    lab = [(x, nm) for nm, x in seen.items()]
    for j, (x, nm) in enumerate(sorted(lab)[:8]):
        px = left + (x - lo) / (hi - lo) * w
        anchor = "end" if px > left + 0.7 * w else "start"
        parts.append(f'<line x1="{px:.1f}" y1="{top + h + 18}" x2="{px:.1f}" '
                     f'y2="{top + h + 26 + 12 * j}" stroke="#b00020"/>'
                     f'<text x="{px + (-3 if anchor == "end" else 3):.1f}" '
                     f'y="{top + h + 34 + 12 * j}" fill="#b00020" text-anchor="{anchor}">'
                     f'{_e(nm)} {x:.{nd}f}{_e(unit)}</text>')
    parts.append(f'<text x="{left + w}" y="12" text-anchor="end" class="note">'
                 f'{len(v)} values, log-scaled counts</text></svg>')
    return "".join(parts)


def _line_chart(line: dict[str, Any], times: np.ndarray, steady: np.ndarray) -> str:
    """One straggler's series (red) against the job's 10-90 % band (grey) and median (black)."""
    import numpy as np

    series, band = line["series"], line["band"]
    name, unit, lo, hi = _UNITS.get(line["metric"], (line["metric"], "", None, None))
    allv = np.concatenate([series[np.isfinite(series)], band[np.isfinite(band)]])
    if not len(allv):
        return ""
    lo = float(allv.min()) if lo is None else lo
    hi = float(allv.max()) if hi is None else hi
    if hi - lo < 1e-9:
        hi = lo + 1
    w, h, left, top = 480, 150, 60, 22
    b = len(series)

    def xy(k: int, v: float) -> str:
        x = left + (w * k / max(b - 1, 1))
        y = top + h - (v - lo) / (hi - lo) * h
        return f"{x:.1f},{y:.1f}"

    def path(v: np.ndarray) -> str:
        out, pen = [], "M"
        for k in range(b):
            if not np.isfinite(v[k]):
                pen = "M"
                continue
            out.append(pen + xy(k, float(v[k])))
            pen = "L"
        return " ".join(out)

    ok = np.isfinite(band[0]) & np.isfinite(band[2])
    poly = [xy(k, float(band[2][k])) for k in range(b) if ok[k]] + \
        [xy(k, float(band[0][k])) for k in reversed(range(b)) if ok[k]]
    parts = [f'<svg width="{w + left + 20}" height="{h + top + 34}" role="img" '
             f'aria-label="{_e(line["label"])}">'
             f'<text x="{left}" y="14"><tspan fill="#b00020">{_e(line["label"])}</tspan> '
             f'{_e(name)} vs job median (10–90 % band)</text>']
    if poly:
        parts.append(f'<polygon points="{" ".join(poly)}" fill="#ddd"/>')
    parts.append(f'<path d="{path(band[1])}" stroke="#333" fill="none" stroke-width="1"/>')
    parts.append(f'<path d="{path(series)}" stroke="#b00020" fill="none" stroke-width="1.6"/>')
    for k in range(3):
        v = lo + (hi - lo) * k / 2
        parts.append(f'<text x="{left - 4}" y="{top + h - h * k / 2 + 4:.0f}" '
                     f'text-anchor="end">{v:.0f}{_e(unit)}</text>')
    if len(times):
        parts.append(f'<text x="{left}" y="{top + h + 16}">0 s</text><text x="{left + w}" '
                     f'y="{top + h + 16}" text-anchor="end">{_dur(float(times[-1] - times[0]))}'
                     '</text>')
    parts.append("</svg>")
    del steady
    return "".join(parts)


def _gpu_cell(s: Any) -> str:
    if s.gpu is not None:
        return str(s.gpu)
    gpu_keys = ("util_pct", "power_w", "sm_clock_mhz", "hw_power_brake", "thermal",
                "hw_slowdown")
    return "all" if any(k in s.metrics for k in gpu_keys) else "CPU"


def render_html(eff: Efficiency) -> str:
    """The page for one job's efficiency analysis."""
    import numpy as np

    d = eff.to_dict()
    bins = eff.bins
    times = np.asarray(bins.get("time", np.zeros(0)))
    steady = np.asarray(bins.get("steady", np.zeros(0, bool)))
    marked: dict[str, str] = {}
    for s in eff.stragglers:
        marked.setdefault(s.node, s.evidence)
    g, cpu, en, rs = d["gpu"], d["cpu"], d["energy"], d["restarts"]
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(eff.t0_unix_s or 0))
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
           f"<title>Job {eff.job_id} efficiency</title><style>{_CSS}</style></head><body>",
           f"<h1>Job {eff.job_id}: efficiency and stragglers</h1>",
           f"<div class='sub'>{len(eff.nodes)} nodes × {eff.n_gpus} GPUs · {start} · "
           f"{_dur(eff.duration_s)} at {eff.interval_s:g} s ({eff.n_samples} samples) · steady "
           f"state {_dur(d['steady']['samples'] * eff.interval_s)} (by "
           f"{_e(d['steady']['basis'])})</div>"]
    cards = []
    if g:
        cards += [(_fmt(g.get("util_steady_pct"), " %"), "GPU util, steady state"),
                  (_fmt(g.get("util_mean_pct"), " %"), "GPU util, whole job"),
                  (_fmt(g.get("power_steady_w"), " W"), "power per GPU, steady"),
                  (_fmt(g.get("power_total_steady_kw"), " kW", 1), "job power, steady"),
                  (str(g.get("idle_gpus", 0)), "idle GPUs")]
    if en.get("series_kwh") is not None:
        cards.append((_fmt(en["series_kwh"], " kWh", 1), "GPU energy (samples)"))
    if en.get("epilog_j") is not None:
        cards.append((_fmt(en["epilog_j"] / 3.6e6, " kWh", 1),
                      f"GPU energy (epilog, {en['epilog_nodes']} nodes)"))
    if cpu.get("busy_mean_pct") is not None:
        cards.append((_fmt(cpu["busy_mean_pct"], " %"), "CPU busy"))
    cards.append((_dur(rs.get("lost_s") or 0), f"lost to {rs['count']} restart gap(s)"))
    n_str = len(eff.straggler_nodes)
    cards.append((f"<span class='{'bad' if n_str else 'ok'}'>{n_str}</span>",
                  "straggler node(s)"))
    out.append("<div class='cards'>" + "".join(
        f"<div class='card'><b>{v}</b><span>{_e(k)}</span></div>" for v, k in cards) + "</div>")

    out.append("<h2>Stragglers</h2>")
    if eff.stragglers:
        out.append("<table><tr><th>node</th><th>GPU</th><th>evidence</th></tr>" + "".join(
            f"<tr><td class='bad'>{_e(s.node)}</td><td>{_gpu_cell(s)}</td>"
            f"<td>{_e(s.evidence)}</td></tr>" for s in eff.stragglers[:200]) + "</table>")
    else:
        out.append("<p class='ok'>None: every GPU and node stayed within the thresholds of the "
                   "job's median (below).</p>")
    if eff.missing:
        out.append("<p><b>No verdict (too few samples):</b> " + ", ".join(
            f"{_e(m['node'])} ({_e(m['why'])})" for m in eff.missing[:50]) + "</p>")

    for values, metric in bins.get("heats", []):
        title, unit, lo, hi = _UNITS[metric]
        if metric != "cpu_throttled_pct":  # colours over the steady state's own range
            fin = values[:, steady] if steady.any() else values
            fin = fin[np.isfinite(fin)]
            lo, hi = (float(np.percentile(fin, 0.05)), float(np.percentile(fin, 99.95))) \
                if len(fin) else (0.0, 1.0)
        over = " (its lowest GPU in each bin)" if metric in ("util_pct", "power_w") else ""
        out.append(f"<h2>{_e(title)} per node over time</h2><p class='note'>One row per node"
                   f"{over}, one column per {_dur(bins['bin_s'])}; colours {lo:.0f}–{hi:.0f}"
                   f"{_e(unit)}; grey = no samples; the blue strip marks the steady state. "
                   "Stragglers marked on the right.</p>")
        out.append(_heatmap(values, title, lo or 0.0, 100.0 if hi is None else hi, eff.nodes,
                            marked, times, steady))

    out.append("<h2>Distributions over the job (steady state)</h2>")
    gpu_names = [f"{nd} GPU {j}" for nd in eff.nodes for j in range(eff.n_gpus)]
    for key, metrics, title, unit in (
            ("gpu_util", ("util_pct",), "GPU utilisation per GPU", "%"),
            ("gpu_power", ("power_w", "hw_power_brake"), "GPU power per GPU", " W")):
        if key not in bins or not np.isfinite(bins[key]).any():
            continue
        marks: dict[str, str] = {}
        for s in eff.stragglers:
            if any(m in s.metrics for m in metrics):
                gpus = [s.gpu] if s.gpu is not None else range(eff.n_gpus)
                marks.update({f"{s.node} GPU {j}": s.label for j in gpus})
        out.append(_histogram(np.asarray(bins[key], float).ravel(), gpu_names, title, unit,
                              marks))
    names = [p["node"] for p in d["per_node"]]
    for key, metrics, title, unit in (
            ("cpu_busy_pct", ("cpu_busy_pct",), "CPU busy per node", "%"),
            ("cpu_throttled_pct", ("cpu_throttled",), "CPU throttled per node (share of time)",
             "%")):
        vals = np.array([np.nan if p[key] is None else p[key] for p in d["per_node"]], float)
        if np.isfinite(vals).any():
            marks = {s.node: s.node for s in eff.stragglers
                     if any(m in s.metrics for m in metrics)}
            out.append(_histogram(vals, names, title, unit, marks))

    if bins.get("lines"):
        out.append("<h2>Stragglers over time</h2>")
        out.extend(_line_chart(line, times, steady) for line in bins["lines"])

    if eff.idle_gpus:
        out.append(f"<h2>Idle GPUs ({len(eff.idle_gpus)})</h2><p>" + ", ".join(
            f"{_e(x['node'])} GPU {x['gpu']}" for x in eff.idle_gpus[:100])
            + (" …" if len(eff.idle_gpus) > 100 else "") + "</p>")
    out.append("<h2>Restarts</h2><p>" + (
        ", ".join(f"{_dur(x['duration_s'])} at +{_dur(x['start_unix_s'] - (eff.t0_unix_s or 0))}"
                  for x in rs["gaps"]) or "no gap") + f". <span class='note'>{_e(rs['source'])}"
        "</span></p>")
    th = d["thresholds"]
    out.append("<h2>How stragglers are decided</h2><p class='note'>Over the steady state, "
               "per GPU and per node: below the job's median by more than "
               f"{th['mad_k']:g} × MAD (scaled) and by at least {th['util_min_drop_pct']:g} "
               f"utilisation points / {th['power_min_drop_rel']:.0%} power / "
               f"{th['clock_min_drop_rel']:.0%} SM clock / {th['cpu_busy_min_drop_pct']:g} CPU "
               f"busy points; or a HW throttle reason in ≥ {th['throttle_min_share']:.0%} of "
               f"samples while the job's median is ≤ {th['throttle_max_median_share']:.0%}; or "
               f"CPU throttled (> {th['cpu_throttled_sample_pct']:g} % of an interval) in ≥ "
               f"{th['cpu_throttled_min_share']:.0%} of samples. Idle GPUs (util ≤ "
               f"{th['idle_util_pct']:g} % in ≥ {th['idle_min_share']:.0%} of samples) are "
               "listed, not compared.</p>")
    for note in eff.notes:
        out.append(f"<p class='note'>{_e(note)}</p>")
    out.append("</body></html>")
    return "\n".join(out)
