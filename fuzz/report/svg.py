"""The SVG plots of fuzz.report.render (bars, horizontal bars, histograms of error/tolerance by
decade), drawn with the standard library only: a CI job that has not installed torch renders the
report too.

Every plot is laid out on a `_Canvas` that measures what it draws (`text_box`: an estimate of a
label's extent, rotation included) and sizes the viewBox to it, so no label is cut off; the
layouts size margins and legends from the same measure so that labels do not overlap. The
`<svg>` scales down to its container (max-width:100%) instead of making the page scroll.
"""
from __future__ import annotations

import html
import math

MODE_COLORS = {"eager": "#3b6ea8", "graph": "#e08a2c"}
OTHER_COLORS = ("#5a9e5a", "#8c6bb1", "#c4566b", "#6b8e9e")
FAIL, OK, PASS_BAR = "#c0392b", "#2e8b57", "#3b6ea8"
# Average advance of a glyph of the default sans-serif (DejaVu Sans on Linux, the widest of the
# usual ones) in font sizes: an over-estimate for most text, so laid-out labels keep apart.
CHAR_W = 0.62

# error/tolerance by decade: "0" (bitwise equal), then decades 1e-6 .. 1e3 by their lower edge.
# Smaller ratios fold into the first decade and larger (inf too) into the last; a ratio >= 1
# violates. The summary stores a cell's ratios as counts under these keys (compact for long runs).
DECADES = tuple(range(-6, 4))
DECADE_KEYS = ("0",) + tuple(f"1e{e}" for e in DECADES)


def num(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def ratio_text(x) -> str:
    """An error/tolerance as a reader compares them: 0, 3.1e-03, inf; "–" when not measured."""
    if x is None:
        return "–"
    if isinstance(x, str) or not math.isfinite(x):
        return num(x)
    return "0" if x == 0 else f"{x:.1e}"


def decade_key(r) -> str | None:
    """The DECADE_KEYS bin of one error/tolerance; None for a ratio not measured (None, NaN)."""
    if r is None or r != r:
        return None
    if r <= 0:
        return "0"
    d = math.floor(math.log10(r)) if math.isfinite(r) else DECADES[-1]
    return f"1e{min(max(d, DECADES[0]), DECADES[-1])}"


def decade_counts(ratios) -> dict[str, int]:
    """Counts per DECADE_KEYS bin (every bin, zeros included) of a list of ratios, or of counts
    already binned (a summary's `error_ratio_hist`; unknown keys are dropped)."""
    out = {k: 0 for k in DECADE_KEYS}
    if isinstance(ratios, dict):
        for k, n in ratios.items():
            if k in out:
                out[k] += int(n)
        return out
    for r in ratios:
        k = decade_key(r)
        if k is not None:
            out[k] += 1
    return out


def decade_label(key: str) -> str:
    if key == "0":
        return "0 (bitwise)"
    e = int(key[2:])
    edge = lambda p: {0: "1", 1: "10", 2: "100", -1: "0.1"}.get(p, f"1e{p}")  # noqa: E731
    if e == DECADES[0]:
        return f"(0, {edge(e + 1)})"
    if e == DECADES[-1]:
        return f"≥ {edge(e)}"
    return f"[{edge(e)}, {edge(e + 1)})"


def violates(key: str) -> bool:
    return key != "0" and int(key[2:]) >= 0


# -- measuring and drawing ------------------------------------------------------------------

def text_width(text: str, size: float, bold: bool = False) -> float:
    return CHAR_W * (1.12 if bold else 1.0) * size * len(text)


def text_box(x: float, y: float, text: str, size: float, anchor: str = "middle",
             angle: float = 0.0, bold: bool = False) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) a `<text>` covers: its baseline at (x, y), `anchor` as SVG's
    text-anchor, rotated by `angle` degrees about (x, y) as `rotate(angle x y)` does."""
    w = text_width(text, size, bold)
    x0 = x - {"start": 0.0, "middle": w / 2, "end": w}[anchor]
    corners = [(cx, cy) for cx in (x0, x0 + w) for cy in (y - 0.8 * size, y + 0.25 * size)]
    if angle:
        a = math.radians(angle)
        corners = [(x + (cx - x) * math.cos(a) - (cy - y) * math.sin(a),
                    y + (cx - x) * math.sin(a) + (cy - y) * math.cos(a)) for cx, cy in corners]
    xs, ys = [c[0] for c in corners], [c[1] for c in corners]
    return min(xs), min(ys), max(xs), max(ys)


class _Canvas:
    """SVG elements and the box they cover, for a viewBox that fits them."""

    def __init__(self) -> None:
        self.body: list[str] = []
        self.x0 = self.y0 = math.inf
        self.x1 = self.y1 = 0.0

    def _cover(self, x0: float, y0: float, x1: float, y1: float) -> None:
        self.x0, self.y0 = min(self.x0, x0), min(self.y0, y0)
        self.x1, self.y1 = max(self.x1, x1), max(self.y1, y1)

    def text(self, x: float, y: float, text: str, size: int = 11, anchor: str = "middle", angle: float = 0.0,
             extra: str = "", bold: bool = False) -> None:
        self._cover(*text_box(x, y, text, size, anchor, angle, bold))
        rot = f' transform="rotate({angle:g} {x:.1f} {y:.1f})"' if angle else ""
        extra += ' font-weight="bold"' if bold else ""
        self.body.append(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{rot}{extra}>'
                         f"{html.escape(text)}</text>")

    def rect(self, x: float, y: float, w: float, h: float, fill: str, tip: str = "", extra: str = "") -> None:
        self._cover(x, y, x + w, y + h)
        t = f"<title>{html.escape(tip)}</title>" if tip else ""
        self.body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}>'
                         f"{t}</rect>")

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#ddd", extra: str = "") -> None:
        self._cover(min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))
        self.body.append(f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" stroke="{stroke}"{extra}/>')

    def svg(self, title: str, pad: float = 6.0) -> str:
        # From the origin (or whatever reaches left of or above it) to what was drawn, and `pad`.
        vx, vy = math.floor(min(0.0, self.x0 - pad)), math.floor(min(0.0, self.y0 - pad))
        w, h = math.ceil(self.x1 + pad) - vx, math.ceil(self.y1 + pad) - vy
        t = html.escape(title)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="{vx} {vy} {w} {h}" width="{w}" height="{h}" '
                f'style="max-width:100%;height:auto" role="img" aria-label="{t}" font-family="sans-serif">'
                f"<title>{t}</title>" + "".join(self.body) + "</svg>")


def _axis(vmax: float, ticks: int = 4) -> tuple[float, float]:
    """(top, step) of a value axis: step is 1, 2 or 5 × 10^k, about `ticks` steps up to vmax."""
    if not vmax > 0 or not math.isfinite(vmax):
        return 1.0, 0.25
    raw = vmax / ticks
    e = 10 ** math.floor(math.log10(raw))
    step = next(m * e for m in (1, 2, 5, 10) if m * e >= raw * (1 - 1e-9))
    return step * math.ceil(vmax / step - 1e-9), step


def _legend(c: _Canvas, x: float, y: float, right: float, items: list[tuple[str, str | None]]) -> float:
    """Swatch-and-label items left to right from (x, y), wrapping at `right`; the y below them.
    An item without a color is drawn as its label alone, in red (a marker's meaning)."""
    cx = x
    for label, color in items:
        w = (14 if color else 0) + text_width(label, 11) + 18
        if cx > x and cx + w > right:
            cx, y = x, y + 16
        if color:
            c.rect(cx, y - 9, 10, 10, color)
            c.text(cx + 14, y, label, 11, "start")
        else:
            c.text(cx, y, label, 11, "start", extra=f' fill="{FAIL}"')
        cx += w
    return y + 8


def grouped_bar_svg(title: str, groups: list[str], series: list[str], values: dict, unit: str = "",
                    flagged: set | None = None) -> str:
    """Vertical bars: one group per x label, one bar per series; values[(group, series)].
    Bars in `flagged` (cells with failures) get a red outline and a red ✗ above them. Group
    labels are turned when they are wider than their group; the legend sits above the plot."""
    flagged = flagged or set()
    gw = max(44, 12 + 20 * len(series))
    left, right = 56, 16
    w = max(480, left + right + gw * len(groups))
    c = _Canvas()
    c.text(8, 16, title, 13, "start", bold=True)
    colors = {s: MODE_COLORS.get(s, OTHER_COLORS[i % len(OTHER_COLORS)]) for i, s in enumerate(series)}
    items = [(s, colors[s]) for s in series] + ([("✗ failures", None)] if flagged else [])
    top = _legend(c, left, 35, w - right, items) + 10
    widest = max([text_width(g, 10) for g in groups] or [0])
    angle = -35 if widest > gw - 6 else 0  # turned only when they would run into each other
    ph = 220
    top_v, step = _axis(max([v for v in values.values() if v is not None] or [0]))
    for i in range(int(round(top_v / step)) + 1):
        v = step * i
        y = top + ph - ph * v / top_v
        c.line(left, y, w - right, y)
        c.text(left - 6, y + 4, f"{v:g}", 10, "end")
    if unit:
        c.text(14, top + ph / 2, unit, 10, "middle", angle=-90)
    bw = (gw - 12) / max(1, len(series))
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + 6
        for si, s in enumerate(series):
            v = values.get((g, s))
            x = x0 + si * bw
            bh = 0 if v is None else ph * v / top_v
            if v is None:
                c.text(x + bw / 2, top + ph - 3, "–", 10, extra=' fill="#999"')
            else:
                stroke = f' stroke="{FAIL}" stroke-width="2.5"' if (g, s) in flagged else ""
                tip = f"{g} {s}: {num(v)} {unit}" + (" (failures)" if (g, s) in flagged else "")
                c.rect(x + 1, top + ph - bh, bw - 2, max(bh, 0.5), colors[s], tip, stroke)
            if (g, s) in flagged:
                c.text(x + bw / 2, top + ph - bh - (16 if v is None else 4), "✗", 12, extra=f' fill="{FAIL}"')
        gx = left + gi * gw + gw / 2
        c.text(gx + (4 if angle else 0), top + ph + 14, g, 10, "end" if angle else "middle", angle)
    return c.svg(title)


def _wrap(label: str, width: float, size: int) -> list[str]:
    """`label` in lines of at most `width` px, broken at spaces (a word longer than a line is cut)."""
    per_line = max(4, int(width / (CHAR_W * size)))
    lines, cur = [], ""
    for word in label.split(" "):
        while len(word) > per_line:
            if cur:
                lines.append(cur)
                cur = ""
            lines.append(word[:per_line - 1] + "…")
            word = ""
        if not word:
            continue
        if cur and len(cur) + 1 + len(word) > per_line:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return lines + ([cur] if cur else [])


def hbar_svg(title: str, rows: list[tuple[str, float | None, str, str]], unit: str = "",
             label_width: float = 300) -> str:
    """Horizontal bars, one per (label, value, color, annotation): labels wrap to lines of at
    most `label_width` px; the annotation right of the bar is part of the plot's width."""
    wrapped = [_wrap(r[0], label_width, 11) for r in rows]
    left = 12 + max([text_width(ln, 11) for lines in wrapped for ln in lines] or [30])
    pw, top = 360, 32
    top_v, step = _axis(max([r[1] for r in rows if r[1] is not None] or [0]))
    c = _Canvas()
    c.text(8, 18, title, 13, "start", bold=True)
    y = top
    for (label, v, color, note), lines in zip(rows, wrapped):
        rh = 20 + 13 * (len(lines) - 1)
        for j, ln in enumerate(lines):
            c.text(left - 6, y + 13 + 13 * j, ln, 11, "end")
        bw = 0 if v is None else pw * v / top_v
        c.rect(left, y + 3, max(bw, 1), 14, color, f"{label}: {note or num(v)}")
        c.text(left + bw + 4, y + 14, note or num(v), 10, "start")
        y += rh
    n = int(round(top_v / step))
    for i in range(n + 1):
        x = left + pw * i / n
        c.body.insert(1, f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{y + 2:.1f}" stroke="#ddd"/>')
        c.text(x, y + 16, f"{step * i:g}", 10)
    if unit:
        c.text(left + pw / 2, y + 32, unit, 10, extra=' fill="#555"')
    return c.svg(title)


def histogram_svg(title: str, ratios) -> str:
    """error/tolerance by decade (DECADE_KEYS), one bar each, red from 1 up (a violation).
    `ratios`: the ratios, or their counts per decade (a summary's `error_ratio_hist`)."""
    counts = decade_counts(ratios)
    rows = [(decade_label(k), float(n), FAIL if violates(k) else (OK if k == "0" else PASS_BAR), str(n))
            for k, n in counts.items()]
    return hbar_svg(title, rows, "examples")


def count_text(n: int) -> str:
    """A bar's count in at most three characters (12k): the exact one is in its tooltip."""
    return str(n) if n < 1000 else f"{n // 1000}k"


def mini_histogram_svg(counts: dict, title: str, pitch: int = 18) -> str:
    """One cell's error/tolerance by decade, small enough for a card of the page's width / 4: a
    bar per DECADE_KEYS bin (`pitch` px) with its count above it (count_text: narrower than the
    bar), ticks at 0, 1e-5, 1e-3 and 1, the violating side shaded."""
    counts = decade_counts(counts)
    bar_h, base = 28, 40  # the tallest bar; its baseline (counts above it, ticks below)
    peak = max(counts.values()) or 1
    c = _Canvas()
    first_bad = next(i for i, k in enumerate(DECADE_KEYS) if violates(k))
    c.rect(pitch * first_bad, base - bar_h - 10, pitch * (len(DECADE_KEYS) - first_bad), bar_h + 10, "#fdecea")
    for i, (k, n) in enumerate(counts.items()):
        x = pitch * i
        if n:
            h = max(2.0, bar_h * n / peak)
            color = FAIL if violates(k) else (OK if k == "0" else PASS_BAR)
            c.rect(x + 2, base - h, pitch - 4, h, color, f"{decade_label(k)}: {n} example(s)")
            c.text(x + pitch / 2, base - h - 2, count_text(n), 8)
    c.line(0, base, pitch * len(DECADE_KEYS), base, "#999")
    for k, label in (("0", "0"), ("1e-5", "1e-5"), ("1e-3", "1e-3"), ("1e0", "1")):
        i = DECADE_KEYS.index(k)
        x = pitch * i + (pitch / 2 if k == "0" else 0)
        c.line(x, base, x, base + 3, "#999")
        c.text(x, base + 12, label, 9, extra=' fill="#555"')
    return c.svg(title, pad=1)
