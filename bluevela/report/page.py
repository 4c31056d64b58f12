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
svg{max-width:100%;height:auto}svg *{stroke-linejoin:round;stroke-linecap:butt}
svg text{font-family:"DejaVu Sans",sans-serif}
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
    """A whole self-contained page: no script, no external resource. A marker definition that
    an earlier chart of the page already holds, byte for byte, is said once: matplotlib names
    a marker by a hash of its path and style, and one page's inline SVGs share one id space."""
    head = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>")
    seen: set[str] = set()

    def once(m: re.Match[str]) -> str:
        if m[0] in seen:
            return ""
        seen.add(m[0])
        return m[0]

    parts = [_MARKER_DEFS.sub(once, part) for part in body]
    return "\n".join([head, *parts, "</body></html>"]) + "\n"


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
    """A new figure of this size in CSS pixels (no pyplot state: nothing to close), drawn
    without a background of its own: the page's is white."""
    mpl()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / 72, height_px / 72), dpi=72)
    fig.patch.set_visible(False)
    return fig


def dot() -> Any:
    """A round marker (`marker=page.dot()`) drawn with 4 curves: matplotlib's "o" has 8, and
    a page of small trend charts repeats its definition in each."""
    mpl()
    from matplotlib.path import Path as MPath

    k = 0.5523  # a cubic Bezier's control distance for a quarter circle
    v = [(1, 0), (1, k), (k, 1), (0, 1), (-k, 1), (-1, k), (-1, 0), (-1, -k), (-k, -1), (0, -1),
         (k, -1), (1, -k), (1, 0), (0, 0)]
    return MPath(v, [MPath.MOVETO, *[MPath.CURVE4] * 12, MPath.CLOSEPOLY])


def readable_range(lo: float, hi: float, min_span: float, *, lower: float | None = None,
                   upper: float | None = None, from_zero: bool = False) -> tuple[float, float]:
    """An axis (or colour) range over the values `lo`..`hi` that a person reads at a glance:
    at least `min_span` wide, centred on the values (a spread of 0.2 points on a 10-point
    axis looks as small as it is), shifted inside `lower`..`upper`, from 0 with `from_zero`,
    and widened to round numbers."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return (0.0, 1.0)
    lo, hi = min(lo, hi), max(lo, hi)
    min_span = min_span if min_span > 0 else (max(abs(lo), abs(hi)) or 1.0)
    if from_zero:
        lo = min(lo, 0.0)
    span = max(hi - lo, min_span)
    # round numbers at about a twentieth of the span: the values keep most of it
    step = 10 ** math.floor(math.log10(span / 20))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= span / 20)
    if hi - lo < min_span:
        if from_zero:
            hi = lo + min_span
        else:
            mid = round((lo + hi) / 2 / step) * step
            lo, hi = mid - min_span / 2, mid + min_span / 2
    if lower is not None and lo < lower:
        lo, hi = lower, hi + (lower - lo)
    if upper is not None and hi > upper:
        lo, hi = lo - (hi - upper), upper
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    if lower is not None:
        lo = max(lo, lower)
    if upper is not None:
        hi = min(hi, upper)
    return (float(lo), float(hi))


_SVG = "http://www.w3.org/2000/svg"
_XLINK = "{http://www.w3.org/1999/xlink}href"
# matplotlib's own ids ("figure_1", "xtick_3", "matplotlib.axis_2"): none is referenced; the
# ids a page gives (gid="series", "cell-1-2") and the defs' hashed ids are kept
# a marker's definition as page.svg writes it: matplotlib's id is a hash of path and style
_MARKER_DEFS = re.compile(r'<defs><path id="m[0-9a-f]{10}" d="[^"]*"(?: style="[^"]*")?/></defs>')
_AUTO_ID = re.compile(r"^[A-Za-z][A-Za-z0-9.]*_\d+$")
_NUMERIC = ("x", "y", "width", "height", "x1", "x2", "y1", "y2", "cx", "cy", "r")
_FRACTION = re.compile(r"(\.\d)\d+")


def svg(fig: Figure, label: str, cls: str = "", tight: bool = False,
        titles: dict[str, list[str]] | None = None) -> str:
    """`fig` as an inline `<svg>` element with an accessible label (and a class for the
    page's layout and its tests).

    Args:
        titles: gid -> texts: the k-th marker (`<use>`) drawn by the artist with that gid
            gets the k-th text as its `<title>`, which a browser shows on hover; an artist
            without markers (a patch) gets the first text.
    """
    import xml.etree.ElementTree as ET

    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None},
                bbox_inches="tight" if tight else None)
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"data:image/png;base64,\s*([A-Za-z0-9+/=\s]+)", _palette_png, text)
    root = ET.fromstring(text)
    for el in root.iter():
        _tidy(el)
    _unwrap(root)
    _share_marker_styles(root)
    if titles:
        for group in [el for el in root.iter() if el.get("id") in titles]:
            texts = titles[group.get("id", "")]
            marks = list(group.iter(f"{{{_SVG}}}use")) or [group]
            for el, t in zip(marks, texts, strict=False):
                ET.SubElement(el, f"{{{_SVG}}}title").text = t
    attrs = {"role": "img", "aria-label": label, **({"class": cls} if cls else {})}
    for k in ("version",):
        root.attrib.pop(k, None)
    for k in ("width", "height"):
        # the figure was sized in CSS pixels (72 dpi: one point is one pixel), not in points
        root.set(k, root.get(k, "").removesuffix("pt"))
    root.attrib = {**attrs, **root.attrib}
    ET.register_namespace("", _SVG)
    # inline in HTML an <svg> is in the SVG namespace without saying so
    return ET.tostring(root, encoding="unicode").replace(" />", "/>").replace(
        f' xmlns="{_SVG}"', "", 1)


def _tidy(el: Any) -> None:
    """One element of matplotlib's SVG, smaller and the same to the eye: no automatic id, no
    identity rotation, coordinates to 0.1 px, compact styles (the page's CSS names the font
    and the line joins once), SVG 2's plain `href`."""
    a = el.attrib
    tag = el.tag.rpartition("}")[2]
    el.tail = None  # matplotlib's indentation
    if el.text is not None and not el.text.strip() and tag != "text":
        el.text = None
    if tag == "metadata" or (tag == "style" and "stroke-linejoin" in (el.text or "")):
        el.text, el.tag = None, "_drop"
        return
    if _AUTO_ID.match(a.get("id", "")):
        del a["id"]
    if re.fullmatch(r"rotate\(-?0 [^)]*\)", a.get("transform", "")):
        del a["transform"]
    for k in _NUMERIC:
        if k in a:
            a[k] = _FRACTION.sub(r"\1", a[k]).removesuffix(".0")
    if "d" in a:  # "M 1.25 2 L 3 -4" -> "M1.2 2L3-4"
        d = " ".join(_FRACTION.sub(r"\1", a["d"]).split())
        a["d"] = re.sub(r" ?([A-Za-z]) ?", r"\1", d).replace(" -", "-")
    if "style" in a:
        style = re.sub(r"\s*([:;])\s*", r"\1", a["style"].strip())
        style = re.sub(r"#([0-9a-f])\1([0-9a-f])\2([0-9a-f])\3\b", r"#\1\2\3", style)
        style = re.sub(r"font-family:'DejaVu Sans', ?sans-serif;?", "", style)
        # initial values, the same pixels unsaid
        style = re.sub(r"(?:^|(?<=;))(?:stroke-dashoffset:0|text-anchor:start)(?:;|$)", "",
                       style)
        if style.rstrip(";"):
            a["style"] = style.rstrip(";")
        else:
            del a["style"]
    if _XLINK in a:
        a["href"] = a.pop(_XLINK)


def _share_marker_styles(root: Any) -> None:
    """matplotlib styles each marker (`<use>`) alike: where every use of a definition has the
    same style, it moves onto the definition, said once (a property a use sets is inherited
    by its copy of the definition, whose own properties win: the same pixels)."""
    defs = {el.get("id"): el for el in root.iter() if el.get("id")}
    uses: dict[str, list[Any]] = {}
    for el in root.iter(f"{{{_SVG}}}use"):
        uses.setdefault(el.get("href", "").removeprefix("#"), []).append(el)
    for ref, group in uses.items():
        styles = {el.get("style") for el in group}
        target = defs.get(ref)
        if target is None or len(styles) != 1 or None in styles:
            continue
        props = dict(kv.split(":", 1) for kv in f"{styles.pop()};{target.get('style', '')}"
                     .split(";") if ":" in kv)
        target.set("style", ";".join(f"{k}:{v}" for k, v in props.items()))
        for el in group:
            del el.attrib["style"]


def _unwrap(el: Any) -> None:
    """Hoist the children of attribute-less `<g>` groups and drop emptied `<defs>` (what
    is left of matplotlib's nesting once its ids are gone)."""
    out: list[Any] = []
    for child in list(el):
        _unwrap(child)
        tag = child.tag.rpartition("}")[2]
        if tag == "_drop":
            continue
        if (tag == "g" and not child.attrib) or (tag == "defs" and not len(child)):
            out.extend(child)
        else:
            out.append(child)
    el[:] = out


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
