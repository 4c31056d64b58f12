"""The one page module: what every bluevela HTML page (nightly, efficiency, fleet) is built from.

One stylesheet (`CSS`), one escaping function (`esc`), one number and one duration formatter
(`fmt_num`, `fmt_duration`), one document shell (`document`), one atomic writer that follows no
symlink (`write_page`), one size budget (`BUDGET_BYTES`), and one way to draw: matplotlib
(`figure`, then `svg`), text kept as text so names and numbers can be searched and read by a
screen reader, a node x time heatmap as one `imshow` image inside its SVG.

matplotlib is imported only when a chart is drawn (`figure`): this module, and the analyses
that use its formatters, import without it (pip extra `report`).
"""

from __future__ import annotations

import base64
import html
import io
import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bluevela.errors import ArchiveError
from bluevela.util.fs import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

#: A page larger than this is logged as over budget (each page keeps its large-cluster layout
#: under it: distributions and the worst nodes, never one chart per node).
BUDGET_BYTES = 2_000_000

#: The palette shared by the pages.
OK, WARN, BAD, MUTED, LINE, BAR = "#2e7d32", "#e65100", "#c62828", "#757575", "#1565c0", "#90a4ae"

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff;max-width:1200px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}td,th{border:1px solid #ddd;
padding:3px 8px;text-align:left;vertical-align:top}th{background:#f5f5f5}
.ok{color:#2e7d32}.bad{color:#c62828}.warn{color:#b26a00}.muted,.sub,.note{color:#666}
.note{font-size:12px}.sub{margin-bottom:12px}
.grid{display:flex;flex-wrap:wrap;gap:8px}.card{border:1px solid #eee;padding:4px}
.tiles{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}.tile{border:1px solid #ccc;
border-radius:6px;padding:8px 12px;min-width:140px}.tile b{display:block;font-size:20px}
.tile>span{color:#666;font-size:12px}
.badge{display:inline-block;padding:2px 8px;border-radius:4px;color:#fff;font-weight:bold}
svg{max-width:100%;height:auto}
"""


class ReportError(ArchiveError):
    """A page cannot be written (no plotting library, unwritable file)."""


def esc(value: object) -> str:
    """`value` as HTML text or attribute value (quotes escaped too)."""
    return html.escape(str(value), quote=True)


def fmt_num(value: float | None, digits: int | None = None, unit: str = "") -> str:
    """A number for a page: `–` when missing or not finite; 3 significant digits (whole
    numbers from 1,000 up) by default, else `digits` decimals with thousands separators."""
    if value is None or not math.isfinite(value):
        return "–"
    if digits is None:
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    else:
        text = f"{value:,.{digits}f}"
    return text + unit


def fmt_duration(s: float | None, missing: str = "–") -> str:
    """`12 s`, `7 min`, `3.5 h`."""
    if s is None:
        return missing
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.0f} min"
    return f"{s:.0f} s"


def document(title: str, body: Iterable[str]) -> str:
    """A whole self-contained page: no script, no external resource."""
    head = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>")
    return "\n".join([head, *body, "</body></html>"]) + "\n"


def write_page(path: Path, text: str) -> Path:
    """Write a page atomically: a new temporary file (O_EXCL|O_NOFOLLOW) next to `path`,
    fsync, rename over `path`. A symlink planted at the temporary name or at `path` is
    replaced, never followed.

    Raises:
        ReportError: the file cannot be written (one line).
    """
    data = text.encode("utf-8")
    if len(data) > BUDGET_BYTES:
        logger.warning("%s: %.1f MB, over the %.1f MB page budget", path, len(data) / 1e6,
                       BUDGET_BYTES / 1e6)
    try:
        atomic_write(Path(path), data, 0o644)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return Path(path)


# -- drawing ---------------------------------------------------------------------------------

_RC: dict[str, Any] = {"svg.fonttype": "none", "svg.hashsalt": "bluevela", "font.size": 11,
       # one named font (matplotlib's own, for text metrics): each SVG text names only it
       "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans"],
       "axes.spines.top": False, "axes.spines.right": False, "axes.titlesize": 11,
       "axes.titlelocation": "left", "xtick.labelsize": 9, "ytick.labelsize": 9,
       "legend.fontsize": 9, "legend.frameon": False, "image.interpolation": "none"}


def mpl() -> Any:
    """The matplotlib module, configured for the pages (no display, text kept as text).

    Raises:
        ReportError: matplotlib is not installed.
    """
    try:
        import matplotlib as mpl
    except ImportError as exc:
        raise ReportError("the HTML pages need matplotlib: pip install 'bluevela[report]' "
                          "(or use --json)") from exc
    rc: Any = mpl.rcParams
    rc.update(_RC)
    return mpl


def figure(width_px: float, height_px: float) -> Figure:
    """A new figure of this size in CSS pixels (no pyplot state: nothing to close)."""
    mpl()
    from matplotlib.figure import Figure

    return Figure(figsize=(width_px / 72, height_px / 72), dpi=72)


def svg(fig: Figure, label: str, cls: str = "", tight: bool = False) -> str:
    """`fig` as an inline `<svg>` element with an accessible label (and a class for the
    page's layout and its tests)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None},
                bbox_inches="tight" if tight else None)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    text = re.sub(r"data:image/png;base64,\s*([A-Za-z0-9+/=\s]+)", _palette_png, text)
    # path coordinates to 0.1 px on one line (matplotlib writes 6 decimals and a newline per
    # point: half the bytes of a long line), and no indentation between elements
    text = re.sub(r' d="([^"]*)"', lambda m: ' d="' + " ".join(
        re.sub(r"(\.\d)\d+", r"\1", m.group(1)).split()) + '"', text)
    text = re.sub(r">\s+<", "><", text)
    # the figure was sized in CSS pixels (72 dpi: one point is one pixel), not in points
    text = re.sub(r'^(<svg [^>]*?width=")([\d.]+)pt(" height=")([\d.]+)pt"', r'\1\2\3\4"', text,
                  count=1)
    # inline in HTML, SVG 2's plain `href` needs no xlink namespace
    text = text.replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "", 1)
    text = text.replace("xlink:href=", "href=")
    attrs = f'role="img" aria-label="{esc(label)}" ' + (f'class="{esc(cls)}" ' if cls else "")
    return text.replace("<svg ", f"<svg {attrs}", 1)


def _palette_png(m: re.Match[str]) -> str:
    """An embedded RGBA image (an `imshow` heatmap) re-encoded losslessly as an 8-bit palette
    PNG when it has at most 256 colours: a quarter of the bytes before compression (a
    1,000-node heatmap: 90 kB instead of 210 kB)."""
    import numpy as np
    from PIL import Image

    raw = base64.b64decode(re.sub(r"\s", "", m.group(1)))
    with Image.open(io.BytesIO(raw)) as im:
        rgba = np.asarray(im.convert("RGBA"))
    packed = rgba.view(np.uint32).reshape(rgba.shape[:2])
    colors, index = np.unique(packed, return_inverse=True)
    if len(colors) > 256:
        return m.group(0)
    table = colors.view(np.uint8).reshape(-1, 4)
    # darkest first: with a sequential colormap (viridis) the index then grows with the value
    order = np.argsort(table[:, :3] @ np.array([299, 587, 114]), kind="stable")
    table, rank = table[order], np.argsort(order)
    out = Image.fromarray(rank[index.reshape(packed.shape)].astype(np.uint8), "P")
    out.putpalette(table[:, :3].tobytes())
    extra: dict[str, Any] = {}
    if (table[:, 3] != 255).any():
        extra["transparency"] = table[:, 3].tobytes()
    buf = io.BytesIO()
    out.save(buf, format="png", **extra)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
