"""The `--efficiency --html` page: one self-contained file (no scripts, no external resources).

Sized for 1,000 nodes: the node x time heatmap is ONE `imshow` image (one pixel per node and
time bin), the per-node distributions are histograms with the stragglers labelled, and only the
stragglers get a time series, drawn against the job's 10-90 % band and median. Stragglers and
their evidence come first. Drawn with matplotlib through `bluevela.report.page`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bluevela.report import page
from bluevela.report.page import esc, fmt_duration, fmt_num

if TYPE_CHECKING:
    import numpy as np

    from bluevela.report.efficiency_model import Efficiency, Straggler, StragglerLine, Thresholds

def _fmt(v: float | None, unit: str = "", nd: int = 0) -> str:
    return fmt_num(v, nd, unit)


def _dur(s: float | None) -> str:
    return fmt_duration(s)


_UNITS = {"util_pct": ("GPU utilisation", "%", 0.0, 100.0),
          "cpu_busy_pct": ("CPU busy", "%", 0.0, 100.0),
          "cpu_throttled_pct": ("CPU throttled (share of time)", "%", 0.0, 100.0),
          "power_w": ("GPU power", " W", None, None),
          "sm_clock_mhz": ("SM clock", " MHz", None, None)}


def _range(lo: float, hi: float, unit: str, *, from_zero: bool = False) -> tuple[float, float]:
    """An axis or colour range over `lo`..`hi` read at a glance: at least 10 points of a
    percentage (0-100) or 10 % of a power or clock, so the noise of a flat job looks as small
    as it is; a share of throttled time from 0."""
    if unit.strip() == "%":
        return page.readable_range(lo, hi, 10.0, lower=0.0, upper=100.0, from_zero=from_zero)
    return page.readable_range(lo, hi, 0.1 * max(abs(lo), abs(hi)), lower=0.0,
                               from_zero=from_zero)


def _time_axis(ax: Any, span: float) -> None:
    """x: time since the first sample, as durations."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.xaxis.set_major_locator(FixedLocator([span * k / 5 for k in range(6)]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _dur(v)))


def _heatmap(values: np.ndarray, title: str, lo: float, hi: float, nodes: Sequence[str],
             marked: dict[str, str], times: np.ndarray, steady: np.ndarray) -> str:
    """Nodes (rows) x time bins (columns): one `imshow` image (one pixel per node and bin),
    the steady state as a strip above, stragglers named on the right, a colour bar."""
    import numpy as np

    n, b = values.shape
    span = float(times[-1] - times[0]) if len(times) > 1 else float(max(b, 1))
    row = 24 if n <= 8 else 12 if n <= 40 else 4 if n <= 200 else 1
    height = n * row
    fig = page.figure(1130, max(height + 70, 170))
    h = fig.get_figheight() * 72
    left, width = 120 / 1130, 820 / 1130
    ax = fig.add_axes((left, 40 / h, width, height / h))
    strip = fig.add_axes((left, (height + 44) / h, width, 8 / h), sharex=ax)
    cmap = page.mpl().colormaps["viridis"].resampled(254).with_extremes(bad="#c8c8c8")
    img = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, vmin=lo, vmax=hi,
                    extent=(0, span, n, 0))
    edges = np.linspace(0, span, b + 1)
    strip.fill_between(edges[:-1], 0, 1, where=steady[:b].astype(bool) if len(steady) else
                       np.zeros(b, bool), step="post", color="#9ecae1", lw=0)
    strip.set_ylim(0, 1)
    strip.set_yticks([0.5], ["steady"])
    strip.tick_params(bottom=False, labelbottom=False, left=False)
    for side in ("left", "bottom"):
        strip.spines[side].set_visible(False)
    if n <= 40:
        ax.set_yticks([i + 0.5 for i in range(n)], list(nodes))
    else:
        ax.set_yticks([0.5, n - 0.5], [nodes[0], nodes[-1]])
    ax.tick_params(left=False)
    _time_axis(ax, span)
    ax.set_xlabel("time since the first sample")
    for name in sorted(marked)[:20]:
        if name in nodes:
            y = nodes.index(name) + 0.5
            ax.annotate(name, xy=(1.0, y), xycoords=("axes fraction", "data"),
                        xytext=(16, 0), textcoords="offset points", va="center",
                        color=page.BAD, arrowprops={"arrowstyle": "-", "color": page.BAD})
    cax = fig.add_axes((left + width + 110 / 1130, 40 / h, 14 / 1130, min(height, 132) / h))
    fig.colorbar(img, cax=cax, ticks=[lo, (lo + hi) / 2, hi], format="%.0f")
    return page.svg(fig, title, "heat")


def _histogram(values: np.ndarray, names: Sequence[str], title: str, unit: str,
               marked: dict[str, str], *, from_zero: bool = False) -> str:
    """Distribution of per-unit values (log-scaled counts) on an axis read at a glance
    (`_range`; "all equal" when they are); bars holding a straggler red, stragglers named
    below."""
    import numpy as np
    from matplotlib.ticker import NullLocator

    ok = np.isfinite(values)
    if not ok.any():
        return ""
    v = values[ok]
    equal = float(v.max()) - float(v.min()) < 1e-9
    lo, hi = _range(float(v.min()), float(v.max()), unit, from_zero=from_zero)
    bins = 40
    counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
    which = np.clip(((np.nan_to_num(values, nan=lo) - lo) / (hi - lo) * bins).astype(int),
                    0, bins - 1)
    red = {int(which[i]) for i, nm in enumerate(names) if nm in marked and ok[i]}
    nd = 0 if hi - lo >= 10 else 1 if hi - lo >= 1 else 2
    spread = (f"all equal: {v[0]:.{nd + 1}f}{unit}" if equal else
              f"{float(v.min()):.{nd + 1}f}–{float(v.max()):.{nd + 1}f}{unit}")
    seen: dict[str, float] = {}  # one label per straggler (a whole node: its first GPU)
    for i, nm in enumerate(names):
        if nm in marked and ok[i] and marked[nm] not in seen:
            seen[marked[nm]] = float(values[i])
    labels = sorted((x, nm) for nm, x in seen.items())[:8]
    fig = page.figure(580, 200 + 12 * len(labels))
    h = fig.get_figheight() * 72
    ax = fig.add_axes((40 / 580, (50 + 12 * len(labels)) / h, 520 / 580, 130 / h))
    # two filled step outlines (the bins holding a straggler in red): two paths, not 40 bars
    hot = np.array([k in red for k in range(bins)])
    ax.stairs(np.where(hot, 0, counts), edges, fill=True, color="#4c78a8", baseline=0.5)
    if hot.any():
        ax.stairs(np.where(hot, counts, 0), edges, fill=True, color=page.BAD, baseline=0.5)
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(2.0, float(counts.max()) * 1.5))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter("{x:g}")  # 1, 10, 100: plain text, no mathtext
    ax.set_xlim(lo, hi)
    ax.set_title(title)
    ax.set_title(f"{len(v)} values, {spread}; log-scaled counts", loc="right",
                 color="#666")
    ax.xaxis.set_major_formatter(f"{{x:.{nd}f}}{unit}")
    for j, (x, nm) in enumerate(labels):
        ax.annotate(f"{nm} {x:.{nd}f}{unit}", xy=(x, 0), xycoords=("data", "axes fraction"),
                    xytext=(0, -26 - 12 * j), textcoords="offset points", color=page.BAD,
                    ha="right" if x > lo + 0.7 * (hi - lo) else "left", va="top",
                    arrowprops={"arrowstyle": "-", "color": page.BAD})
    return page.svg(fig, title, "hist")


def _line_chart(line: StragglerLine, times: np.ndarray) -> str:
    """One straggler's series (red) against the job's 10-90 % band (grey) and median (black)."""
    import numpy as np

    series, band = line.series, line.band
    name, unit, lo, hi = _UNITS.get(line.metric, (line.metric, "", None, None))
    allv = np.concatenate([series[np.isfinite(series)], band[np.isfinite(band)]])
    if not len(allv):
        return ""
    if lo is None or hi is None:
        lo, hi = _range(float(allv.min()), float(allv.max()), unit)
    b = len(series)
    span = float(times[-1] - times[0]) if len(times) > 1 else float(max(b - 1, 1))
    x = np.linspace(0, span, b)
    fig = page.figure(560, 206)
    ax = fig.add_axes((60 / 560, 34 / 206, 480 / 560, 150 / 206))
    ax.fill_between(x, band[0], band[2], color="#ddd", lw=0)
    ax.plot(x, band[1], color="#333", lw=1)
    ax.plot(x, series, color=page.BAD, lw=1.6)
    ax.set_ylim(lo, hi)
    ax.set_yticks([lo, (lo + hi) / 2, hi], [f"{v:.0f}{unit}" for v in (lo, (lo + hi) / 2, hi)])
    ax.set_xlim(0, span)
    _time_axis(ax, span)
    ax.set_title(f"{line.label}: {name} vs job median (10–90 % band)")
    return page.svg(fig, line.label, "line")


def _gpu_cell(s: Straggler) -> str:
    if s.gpu is not None:
        return str(s.gpu)
    return "all" if any(f.on_gpu for f in s.findings) else "CPU"


# The goodput ledger's phases (bluevela/report/goodput.py PHASES) on the time line.
_PHASE_STYLE = {"productive": ("#2ca02c", "productive"), "redone": ("#d62728", "re-done work"),
                "checkpoint": ("#1f77b4", "checkpoint saving"),
                "detection": ("#ff7f0e", "detection"),
                "teardown_relaunch": ("#9467bd", "teardown + relaunch"),
                "startup": ("#bcbd22", "start-up"),
                "queue_hold": ("#7f7f7f", "queue wait + requeue hold"),
                "unattributed": ("#c7c7c7", "unattributed")}


def _ledger_timeline(led: dict[str, Any]) -> str:
    """The job's attempts as rows of phases on one time axis, each interruption marked with
    its cause: where the wall time went, at a glance."""
    pieces = led["pieces"]
    t0 = led["start_unix_s"]
    span = max(led["wall_s"], 1e-3)
    rows = sorted({p["attempt"] for p in pieces})
    fig = page.figure(900, 120 + 34 * len(rows))
    ax = fig.subplots()
    seen: set[str] = set()
    for p in pieces:
        color, label = _PHASE_STYLE.get(p["phase"], ("#000000", p["phase"]))
        ax.barh([rows.index(p["attempt"])], [p["seconds"]], left=p["start"] - t0, height=0.6,
                color=color, label=None if label in seen else label, linewidth=0)
        seen.add(label)
    for intr in led["interruptions"]:
        if intr["at"] is None:
            continue
        x = intr["at"] - t0
        y = rows.index(intr["attempt"]) if intr["attempt"] in rows else 0
        ax.axvline(x, color="#d62728", linewidth=1, linestyle=":")
        ax.annotate(intr["cause"][:60], (x, y - 0.34), fontsize=8, color="#d62728",
                    ha="left", va="bottom", xytext=(3, 0), textcoords="offset points")
    # the ledger's attempt 0 holds only the wait before the first start (attempts count from
    # 1): it is the queue, not an attempt
    ax.set_yticks(range(len(rows)), ["queued" if r == 0 else f"attempt {r}" for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.8)  # top to bottom, room above the first row
    _time_axis(ax, span)
    ax.set_xlim(0, span)
    ax.set_xlabel("time since submission")
    ax.legend(ncol=4, frameon=False, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ettr = led.get("ettr")
    ax.set_title(f"Where the wall time went (ETTR {_fmt(None if ettr is None else 100 * ettr, ' %', 1)})")
    return page.svg(fig, "goodput time line of attempts and phases", "timeline", tight=True)


def _ledger_section(led: dict[str, Any]) -> list[str]:
    wall = led["wall_s"] or 1.0
    rows = "".join(
        f"<tr><td>{esc(_PHASE_STYLE[k][1])}</td><td>{esc(_dur(v))}</td>"
        f"<td>{100 * v / wall:.1f} %</td><td>{_fmt(led['node_hours'][k], '', 3)}</td>"
        f"<td>{_fmt(led['gpu_hours'][k], '', 2)}</td></tr>"
        for k, v in led["phases_s"].items())
    if "idle_spare" in led["node_hours"]:  # the hot spares' own line (report/goodput.py)
        rows += (f"<tr><td>idle spare</td><td>{led.get('spares', 0)} spare(s)</td><td></td>"
                 f"<td>{_fmt(led['node_hours']['idle_spare'], '', 3)}</td>"
                 f"<td>{_fmt(led['gpu_hours']['idle_spare'], '', 2)}</td></tr>"
                 f"<tr><td>in all</td><td>{esc(_dur(led['wall_s']))}</td><td></td>"
                 f"<td>{_fmt(led.get('total_node_hours'), '', 3)}</td>"
                 f"<td>{_fmt(sum(led['gpu_hours'].values()), '', 2)}</td></tr>")
    causes = "".join(
        f"<li>attempt {i['attempt']}: {esc(i['cause'])}, re-done {esc(_dur(i['redone_s']))}, "
        f"lost in all {esc(_dur(i['lost_s']))}"
        + "".join(f" · <code>{esc(e['history'])}</code>" for e in i["evidence"]) + "</li>"
        for i in led["interruptions"])
    return ["<h2>Goodput ledger</h2>", _ledger_timeline(led),
            "<table><thead><tr><th>phase</th><th>time</th><th>share</th><th>node hours</th>"
            "<th>GPU hours</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>",
            f"<ul>{causes}</ul>" if causes else "<p>No interruption.</p>",
            "<p class='note'>Phases: docs/resilience.md, \"Where the time went\".</p>"]


def _header(eff: Efficiency) -> list[str]:
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(eff.t0_unix_s or 0))
    return [f"<h1>Job {eff.job_id}: efficiency and stragglers</h1>",
            f"<div class='sub'>{len(eff.nodes)} nodes × {eff.n_gpus} GPUs · {start} · "
            f"{_dur(eff.duration_s)} at {eff.interval_s:g} s ({eff.n_samples} samples) · steady "
            f"state {_dur(eff.steady['samples'] * eff.interval_s)} (by "
            f"{esc(eff.steady['basis'])})</div>"]


def _tiles(eff: Efficiency) -> str:
    """The job's figures at a glance."""
    g, cpu, en, rs = eff.gpu, eff.cpu, eff.energy, eff.restarts
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
    return "<div class='tiles'>" + "".join(
        f"<div class='tile'><b>{v}</b><span>{esc(k)}</span></div>" for v, k in cards) + "</div>"


def _straggler_table(eff: Efficiency) -> list[str]:
    out = ["<h2>Stragglers</h2>"]
    if eff.stragglers:
        out.append("<table><tr><th>node</th><th>GPU</th><th>evidence</th></tr>" + "".join(
            f"<tr><td class='bad'>{esc(s.node)}</td><td>{_gpu_cell(s)}</td>"
            f"<td>{esc(s.evidence)}</td></tr>" for s in eff.stragglers[:200]) + "</table>")
    else:
        out.append("<p class='ok'>None: every GPU and node stayed within the thresholds of the "
                   "job's median (below).</p>")
    if eff.missing:
        out.append("<p><b>No verdict (too few samples):</b> " + ", ".join(
            f"{esc(m['node'])} ({esc(m['why'])})" for m in eff.missing[:50]) + "</p>")
    return out


def _heatmaps(eff: Efficiency, marked: dict[str, str], times: np.ndarray,
              steady: np.ndarray) -> list[str]:
    """A node x time heatmap per metric, coloured over the steady state's own range."""
    import numpy as np

    out = []
    for values, metric in eff.bins.heats:
        title, unit, lo, hi = _UNITS[metric]
        if metric != "cpu_throttled_pct":  # colours over the steady state's own range
            fin = values[:, steady] if steady.any() else values
            fin = fin[np.isfinite(fin)]
            lo, hi = _range(float(np.percentile(fin, 0.05)), float(np.percentile(fin, 99.95)),
                            unit) if len(fin) else (0.0, 1.0)
        over = " (its lowest GPU in each bin)" if metric in ("util_pct", "power_w") else ""
        out.append(f"<h2>{esc(title)} per node over time</h2><p class='note'>One row per node"
                   f"{over}, one column per {_dur(eff.bins.bin_s)}; colours {lo:.0f}–{hi:.0f}"
                   f"{esc(unit)}; grey = no samples; the blue strip marks the steady state. "
                   "Stragglers marked on the right.</p>")
        out.append(_heatmap(values, title, lo or 0.0, 100.0 if hi is None else hi, eff.nodes,
                            marked, times, steady))
    return out


def _distributions(eff: Efficiency) -> list[str]:
    """Histograms of the per-GPU and per-node steady figures, the stragglers' bars red."""
    import numpy as np

    out = ["<h2>Distributions over the job (steady state)</h2>"]
    gpu_names = [f"{nd} GPU {j}" for nd in eff.nodes for j in range(eff.n_gpus)]
    for values, metrics, title, unit in (
            (eff.bins.gpu_util, ("util_pct",), "GPU utilisation per GPU", "%"),
            (eff.bins.gpu_power, ("power_w", "hw_power_brake"), "GPU power per GPU", " W")):
        if values is None or not np.isfinite(values).any():
            continue
        marks: dict[str, str] = {}
        for s in eff.stragglers:
            if s.flags(metrics):
                gpus = [s.gpu] if s.gpu is not None else range(eff.n_gpus)
                marks.update({f"{s.node} GPU {j}": s.label for j in gpus})
        out.append(_histogram(np.asarray(values, float).ravel(), gpu_names, title, unit,
                              marks))
    names = [p["node"] for p in eff.per_node]
    for key, metrics, title, unit in (
            ("cpu_busy_pct", ("cpu_busy_pct",), "CPU busy per node", "%"),
            ("cpu_throttled_pct", ("cpu_throttled",), "CPU throttled per node (share of time)",
             "%")):
        vals = np.array([np.nan if p[key] is None else p[key] for p in eff.per_node], float)
        if np.isfinite(vals).any():
            marks = {s.node: s.node for s in eff.stragglers if s.flags(metrics)}
            out.append(_histogram(vals, names, title, unit, marks,
                                  from_zero=key == "cpu_throttled_pct"))
    return out


def _how_decided(th: Thresholds) -> str:
    return ("<h2>How stragglers are decided</h2><p class='note'>Over the steady state, "
            "per GPU and per node: below the job's median by more than "
            f"{th.mad_k:g} × MAD (scaled) and by at least {th.util_min_drop_pct:g} "
            f"utilisation points / {th.power_min_drop_rel:.0%} power / "
            f"{th.clock_min_drop_rel:.0%} SM clock / {th.cpu_busy_min_drop_pct:g} CPU "
            f"busy points; or a HW throttle reason in ≥ {th.throttle_min_share:.0%} of "
            f"samples while the job's median is ≤ {th.throttle_max_median_share:.0%}; or "
            f"CPU throttled (> {th.cpu_throttled_sample_pct:g} % of an interval) in ≥ "
            f"{th.cpu_throttled_min_share:.0%} of samples. Idle GPUs (util ≤ "
            f"{th.idle_util_pct:g} % in ≥ {th.idle_min_share:.0%} of samples) are "
            "listed, not compared.</p>")


def _tail(eff: Efficiency) -> list[str]:
    """Idle GPUs, restart gaps, how stragglers are decided, the analysis's notes."""
    out = []
    if eff.idle_gpus:
        out.append(f"<h2>Idle GPUs ({len(eff.idle_gpus)})</h2><p>" + ", ".join(
            f"{esc(x['node'])} GPU {x['gpu']}" for x in eff.idle_gpus[:100])
            + (" …" if len(eff.idle_gpus) > 100 else "") + "</p>")
    rs = eff.restarts
    out.append("<h2>Restarts</h2><p>" + (
        ", ".join(f"{_dur(x['duration_s'])} at +{_dur(x['start_unix_s'] - (eff.t0_unix_s or 0))}"
                  for x in rs["gaps"]) or "no gap") + f". <span class='note'>{esc(rs['source'])}"
        "</span></p>")
    out.append(_how_decided(eff.thresholds))
    out.extend(f"<p class='note'>{esc(note)}</p>" for note in eff.notes)
    return out


def render_html(eff: Efficiency, goodput: dict[str, Any] | None = None) -> str:
    """The page for one job's efficiency analysis; with `goodput` (a `Ledger.to_dict()`),
    the goodput ledger's time line of attempts and phases first."""
    import numpy as np

    times = np.asarray(eff.bins.time if eff.bins.time is not None else np.zeros(0))
    steady = np.asarray(eff.bins.steady if eff.bins.steady is not None else np.zeros(0, bool))
    marked: dict[str, str] = {}
    for s in eff.stragglers:
        marked.setdefault(s.node, s.evidence)
    out = _header(eff)
    if goodput is not None and goodput.get("pieces"):
        out += _ledger_section(goodput)
    out.append(_tiles(eff))
    out += _straggler_table(eff)
    out += _heatmaps(eff, marked, times, steady)
    out += _distributions(eff)
    if eff.bins.lines:
        out.append("<h2>Stragglers over time</h2>")
        out.extend(_line_chart(line, times) for line in eff.bins.lines)
    out += _tail(eff)
    return page.document(f"Job {eff.job_id} efficiency", out)
