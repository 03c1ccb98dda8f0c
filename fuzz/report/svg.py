"""The SVG plots of fuzz.report.render (bars, horizontal bars, a histogram by decade), drawn with the
standard library only: a CI job that has not installed torch renders the report too.
"""
from __future__ import annotations

import html
import math

MODE_COLORS = {"eager": "#3b6ea8", "graph": "#e08a2c"}
OTHER_COLORS = ("#5a9e5a", "#8c6bb1", "#c4566b", "#6b8e9e")
FAIL, OK = "#c0392b", "#2e8b57"


def num(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _axis(vmax: float, ticks: int = 4) -> tuple[float, float]:
    """(top, step) of a value axis: step is 1, 2 or 5 × 10^k, about `ticks` steps up to vmax."""
    if not vmax > 0 or not math.isfinite(vmax):
        return 1.0, 0.25
    raw = vmax / ticks
    e = 10 ** math.floor(math.log10(raw))
    step = next(m * e for m in (1, 2, 5, 10) if m * e >= raw * (1 - 1e-9))
    return step * math.ceil(vmax / step - 1e-9), step


def _t(x: float, y: float, text: str, size: int = 11, anchor: str = "middle", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
            f"{html.escape(text)}</text>")


def _svg(w: int, h: int, title: str, body: list[str]) -> str:
    t = html.escape(title)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
            f'role="img" aria-label="{t}" font-family="sans-serif"><title>{t}</title>'
            + "".join(body) + "</svg>")


def grouped_bar_svg(title: str, groups: list[str], series: list[str], values: dict, unit: str = "",
                    flagged: set | None = None) -> str:
    """Vertical bars: one group per x label, one bar per series; values[(group, series)].
    Bars in `flagged` (cells with failures) get a red outline and a red ✗ above them."""
    flagged = flagged or set()
    gw = max(56, 20 + 24 * len(series))
    left, right, top, bottom = 56, 16, 52, 58
    w, h = max(480, left + right + gw * len(groups)), 320
    ph = h - top - bottom
    top_v, step = _axis(max([v for v in values.values() if v is not None] or [0]))
    body = [_t(8, 16, title, 13, "start", ' font-weight="bold"')]
    colors = {s: MODE_COLORS.get(s, OTHER_COLORS[i % len(OTHER_COLORS)]) for i, s in enumerate(series)}
    for si, s in enumerate(series):
        lx = left + 80 * si
        body.append(f'<rect x="{lx}" y="26" width="10" height="10" fill="{colors[s]}"/>')
        body.append(_t(lx + 14, 35, s, 11, "start"))
    if flagged:
        lx = left + 80 * len(series)
        body.append(_t(lx, 35, "✗ failures", 11, "start", f' fill="{FAIL}"'))
    for i in range(int(round(top_v / step)) + 1):
        v = step * i
        y = top + ph - ph * v / top_v
        body.append(f'<line x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        body.append(_t(left - 6, y + 4, f"{v:g}", 10, "end"))
    if unit:
        body.append(_t(14, top + ph / 2, unit, 10, "middle", f' transform="rotate(-90 14 {top + ph / 2:.1f})"'))
    bw = (gw - 12) / max(1, len(series))
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + 6
        for si, s in enumerate(series):
            v = values.get((g, s))
            x = x0 + si * bw
            bh = 0 if v is None else ph * v / top_v
            if v is None:
                body.append(_t(x + bw / 2, top + ph - 3, "–", 10, extra=' fill="#999"'))
            else:
                stroke = f' stroke="{FAIL}" stroke-width="2.5"' if (g, s) in flagged else ""
                tip = f"{g} {s}: {num(v)} {unit}" + (" (failures)" if (g, s) in flagged else "")
                body.append(f'<rect x="{x + 1:.1f}" y="{top + ph - bh:.1f}" width="{bw - 2:.1f}" '
                            f'height="{max(bh, 0.5):.1f}" fill="{colors[s]}"{stroke}>'
                            f"<title>{html.escape(tip)}</title></rect>")
            if (g, s) in flagged:
                body.append(_t(x + bw / 2, top + ph - bh - (16 if v is None else 4), "✗", 12, extra=f' fill="{FAIL}"'))
        gx = left + gi * gw + gw / 2
        body.append(_t(gx, top + ph + 14, g, 10, "end", f' transform="rotate(-35 {gx:.1f} {top + ph + 14:.1f})"'))
    return _svg(w, h, title, body)


def hbar_svg(title: str, rows: list[tuple[str, float | None, str, str]], unit: str = "") -> str:
    """Horizontal bars, one per (label, value, color, annotation): long labels stay readable."""
    left = min(300, 16 + 7 * max([len(r[0]) for r in rows] or [4]))
    right, top, rh = 70, 32, 20
    w, h = left + 360 + right, top + rh * max(1, len(rows)) + 24
    pw = w - left - right
    top_v, step = _axis(max([r[1] for r in rows if r[1] is not None] or [0]))
    body = [_t(8, 18, title, 13, "start", ' font-weight="bold"')]
    n = int(round(top_v / step))
    for i in range(n + 1):
        x = left + pw * i / n
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{h - 20}" stroke="#ddd"/>')
        body.append(_t(x, h - 6, f"{step * i:g}" + (f" {unit}" if i == n and unit else ""), 10))
    for i, (label, v, color, note) in enumerate(rows):
        y = top + i * rh
        body.append(_t(left - 6, y + 13, label, 11, "end"))
        bw = 0 if v is None else pw * v / top_v
        tip = f"{label}: {note or num(v)}"
        body.append(f'<rect x="{left}" y="{y + 3}" width="{max(bw, 1):.1f}" height="{rh - 6}" fill="{color}">'
                    f"<title>{html.escape(tip)}</title></rect>")
        body.append(_t(left + bw + 4, y + 13, note or num(v), 10, "start"))
    return _svg(w, h, title, body)


def histogram_svg(title: str, ratios: list[float]) -> str:
    """error/tolerance on a log scale, one bar per decade; ratio ≥ 1 is a violation."""
    edges = list(range(-6, 4))  # decades 1e-6 .. 1e3; outside ones fold into the ends
    counts = {e: 0 for e in edges}
    zero = 0
    for r in ratios:
        if r is None or (isinstance(r, float) and math.isnan(r)):
            continue
        if r <= 0:
            zero += 1
            continue
        d = math.floor(math.log10(r)) if math.isfinite(r) else edges[-1]
        counts[min(max(d, edges[0]), edges[-1])] += 1
    rows = [("0 (bitwise)", float(zero), OK, str(zero))]
    rows += [(f"[1e{e}, 1e{e + 1})", float(n), FAIL if e >= 0 else "#3b6ea8", str(n)) for e, n in counts.items()]
    return hbar_svg(title, rows, "examples")
