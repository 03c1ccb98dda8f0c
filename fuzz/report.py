"""Reports from the JSON that `llmfuzz run --json` and `llmfuzz selftest --json` print.

`write_report` writes one self-contained HTML page (inline CSS and SVG, no scripts, no
external assets) and `job_summary_md` the Markdown for a CI job summary. Plots are SVG
drawn here, so the report needs nothing beyond the standard library: it runs in a CI job
that has not installed torch (`python -m fuzz.report ...`) as well as `llmfuzz report`.
"""
from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import re
import sys

MODE_COLORS = {"eager": "#3b6ea8", "graph": "#e08a2c"}
OTHER_COLORS = ("#5a9e5a", "#8c6bb1", "#c4566b", "#6b8e9e")
FAIL, OK = "#c0392b", "#2e8b57"


# -- reading the JSON ---------------------------------------------------------------------

def _layout_key(name: str) -> tuple:
    """tp1pp1 first, then by world size: the order a reader scans layouts in."""
    m = re.fullmatch(r"tp(\d+)pp(\d+)", name)
    tp, pp = (int(m.group(1)), int(m.group(2))) if m else (1 << 30, 0)
    return (tp * pp, pp, tp, name)


def cells(summary: dict) -> list[dict]:
    """`per_cell` as rows {layout, mode, examples, examples_per_s, failures}, layouts in scan order."""
    rows = []
    for key, c in (summary.get("per_cell") or {}).items():
        layout, _, mode = key.partition("/")
        rows.append({"layout": layout, "mode": mode, "examples": c.get("examples", 0),
                     "examples_per_s": c.get("examples_per_s"), "failures": c.get("failures", 0)})
    return sorted(rows, key=lambda r: (_layout_key(r["layout"]), r["mode"]))


def replay_command(path: str) -> str:
    return f"llmfuzz replay {path}"


def _num(x, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _rate(summary: dict) -> float | None:
    s = summary.get("seconds") or 0
    return summary.get("examples", 0) / s if s else None


# -- SVG plots --------------------------------------------------------------------------

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
                tip = f"{g} {s}: {_num(v)} {unit}" + (" (failures)" if (g, s) in flagged else "")
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
        tip = f"{label}: {note or _num(v)}"
        body.append(f'<rect x="{left}" y="{y + 3}" width="{max(bw, 1):.1f}" height="{rh - 6}" fill="{color}">'
                    f"<title>{html.escape(tip)}</title></rect>")
        body.append(_t(left + bw + 4, y + 13, note or _num(v), 10, "start"))
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


# -- HTML ---------------------------------------------------------------------------------

CSS = """body{font-family:sans-serif;margin:24px;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child,td.l{text-align:left}.bad{color:#c0392b;font-weight:bold}.good{color:#2e8b57}
.banner{padding:8px 12px;border-radius:4px;font-weight:bold}.banner.bad{background:#fdecea}
.banner.good{background:#e8f5e9}code,pre{background:#f4f4f4;padding:2px 4px}pre{padding:8px;white-space:pre-wrap}
.failure{border-left:4px solid #c0392b;padding:4px 12px;margin:12px 0}.plot{margin:12px 0;overflow-x:auto}
.note{color:#666}.path{font-family:monospace;font-size:11px;word-break:break-all;max-width:280px}"""


class _Cell(str):
    """A table cell that is already HTML (`<td ...>...</td>`); plain strings are escaped."""


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    trs = "".join("<tr>" + "".join(c if isinstance(c, _Cell) else f"<td>{html.escape(c)}</td>" for c in r)
                  + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _campaign_html(summary: dict) -> list[str]:
    fails = summary.get("failure_details") or []
    n_fail = summary.get("failures", len(fails))
    out = [f'<p class="banner {"bad" if n_fail else "good"}">'
           + (f"{n_fail} failure(s) found" if n_fail else "No failures")
           + (" (interrupted: the summary so far)" if summary.get("interrupted") else "") + "</p>"]
    rate = _rate(summary)
    out.append("<h2>Totals</h2>" + _table(
        ["examples", "seconds", "examples/s", "layouts", "modes", "failures", "interrupted"],
        [[str(summary.get("examples", 0)), _num(summary.get("seconds")), _num(rate),
          str(len(summary.get("layouts", []))), ", ".join(summary.get("modes", [])), str(n_fail),
          "yes" if summary.get("interrupted") else "no"]]))
    rows = cells(summary)
    out.append("<h2>Per layout × mode</h2>" + _table(
        ["layout", "mode", "examples", "examples/s", "failures"],
        [[r["layout"], r["mode"], str(r["examples"]), _num(r["examples_per_s"]),
          _Cell(f'<td class="bad">{r["failures"]}</td>') if r["failures"] else "0"] for r in rows]))
    groups = sorted({r["layout"] for r in rows}, key=_layout_key)
    series = sorted({r["mode"] for r in rows})
    flagged = {(r["layout"], r["mode"]) for r in rows if r["failures"]}
    for key, title, unit in (("examples_per_s", "Examples per second, layout × mode", "examples/s"),
                             ("examples", "Examples run, layout × mode", "examples")):
        vals = {(r["layout"], r["mode"]): r[key] for r in rows}
        out.append(f'<div class="plot">{grouped_bar_svg(title, groups, series, vals, unit, flagged)}</div>')
    events = summary.get("events")
    if events:
        erows = sorted(events.items(), key=lambda kv: (-kv[1], kv[0]))
        out.append('<h2>Case classes covered</h2><div class="plot">' + hbar_svg(
            "Examples per case class (event() labels)",
            [(k, float(v), "#5a9e5a", str(v)) for k, v in erows], "examples") + "</div>")
    ratios = summary.get("error_ratios")
    if ratios:
        out.append('<h2>Error / tolerance</h2><div class="plot">'
                   + histogram_svg("Examples by error/tolerance (≥ 1 violates)", ratios) + "</div>")
    if not events and not ratios:
        out.append('<p class="note">Case classes and the error/tolerance distribution are not recorded in '
                   "this summary.</p>")
    out.append("<h2>Failures</h2>")
    if not fails:
        out.append("<p>None.</p>")
    for i, f in enumerate(fails, 1):
        path = f.get("path", "")
        out.append(
            f'<div class="failure"><p><b>{i}. {html.escape(str(f.get("property")))}</b>: '
            f'{html.escape(str(f.get("message")))}</p>'
            f'<p>case: <code>{html.escape(str(f.get("case_desc")))}</code><br>'
            f'error/tolerance: {html.escape(_num(f.get("error_ratio")))}<br>'
            f'reproducer: <code>{html.escape(path)}</code></p>'
            f"<pre>{html.escape(replay_command(path))}\nllmfuzz minimize {html.escape(path)}</pre></div>")
    return out


def _selftest_html(st: dict) -> list[str]:
    faults = st.get("faults") or []
    det, tot = st.get("detected", 0), st.get("total", len(faults))
    out = ["<h2>Selftest</h2>",
           f'<p class="banner {"good" if det == tot else "bad"}">{det}/{tot} faults detected; median '
           f'seconds to detection {html.escape(_num(st.get("median_seconds_to_detection")))}</p>']
    out.append(_table(
        ["fault", "detected", "seconds", "examples", "property", "requests", "tokens", "layout/mode", "reproducer"],
        [[f["name"], _Cell('<td class="good">yes</td>' if f.get("detected") else '<td class="bad">NO</td>'),
          _num(f.get("seconds")), _num(f.get("examples")), f.get("property") or "–", _num(f.get("requests")),
          _num(f.get("tokens")), f"{f.get('layout')}/{f.get('mode')}" if f.get("detected") else "–",
          _Cell(f'<td class="l path">{html.escape(f.get("reproducer") or "–")}</td>')] for f in faults]))
    rows = [(f["name"], f.get("seconds"), OK, f"{_num(f.get('seconds'))} s") if f.get("detected")
            else (f["name"], f.get("total_seconds"), FAIL, f"not detected in {_num(f.get('total_seconds'), 0)} s")
            for f in faults]
    out.append('<div class="plot">' + hbar_svg("Seconds to detection per fault", rows, "s") + "</div>")
    return out


def render_html(summary: dict | None, selftest: dict | None = None, title: str = "llmfuzz report") -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="note">generated {now}</p>']
    if summary is not None:
        body += _campaign_html(summary)
    if selftest is not None:
        body += _selftest_html(selftest)
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report(summary_json: dict | None, selftest_json: dict | None, out_html: str,
                 title: str = "llmfuzz report") -> str:
    with open(out_html, "w", encoding="utf-8") as f:
        f.write(render_html(summary_json, selftest_json, title))
    return out_html


# -- Markdown (CI job summary) --------------------------------------------------------------

def _md(s) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return _line(s).replace("|", "\\|")


def _line(s) -> str:
    return str(s).replace("\n", " ")


def job_summary_md(summary: dict | None, selftest: dict | None = None, title: str = "llmfuzz nightly",
                   download_hint: str | None = None) -> str:
    """Markdown for $GITHUB_STEP_SUMMARY: verdict, per-cell table, failures with replay commands."""
    lines = [f"## {title}", ""]
    if summary is not None:
        fails = summary.get("failure_details") or []
        n = summary.get("failures", len(fails))
        lines += [f"**{'❌ ' + str(n) + ' failure(s)' if n else '✅ no failures'}** — "
                  f"{summary.get('examples', 0)} examples in {_num(summary.get('seconds'))} s "
                  f"({_num(_rate(summary))}/s), {len(summary.get('layouts', []))} layouts × "
                  f"{', '.join(summary.get('modes', []))}" + (" (interrupted)" if summary.get("interrupted") else ""),
                  "", "| layout | mode | examples | ex/s | failures |", "|---|---|--:|--:|--:|"]
        lines += [f"| {r['layout']} | {r['mode']} | {r['examples']} | {_num(r['examples_per_s'])} | "
                  f"{r['failures']} |" for r in cells(summary)]
        if fails:
            lines += ["", "### Failures", ""]
            if download_hint:
                lines += [download_hint, ""]
            for i, f in enumerate(fails, 1):
                lines += [f"{i}. **{_line(f.get('property'))}**: {_line(f.get('message'))}  ",
                          f"   case: `{_line(f.get('case_desc'))}`, error/tolerance {_num(f.get('error_ratio'))}",
                          "   ```", f"   {replay_command(f.get('path', ''))}", "   ```"]
    if selftest is not None:
        faults = selftest.get("faults") or []
        lines += ["", f"### Selftest: {selftest.get('detected', 0)}/{selftest.get('total', len(faults))} "
                  f"faults detected (median {_num(selftest.get('median_seconds_to_detection'))} s)", "",
                  "| fault | detected | seconds | property | layout/mode |", "|---|---|--:|---|---|"]
        for f in faults:
            where = f"{f.get('layout')}/{f.get('mode')}" if f.get("detected") else "–"
            lines.append(f"| {_md(f['name'])} | {'yes' if f.get('detected') else '**NO**'} | "
                         f"{_num(f.get('seconds'))} | {_md(f.get('property') or '–')} | {where} |")
    return "\n".join(lines) + "\n"


# -- command line -------------------------------------------------------------------------

def _load_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what} {path}: expected a JSON object")
    return doc


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """`llmfuzz report`: the HTML page and/or Markdown summary from run/selftest JSON."""
    p = subparsers.add_parser("report", help="HTML report and Markdown summary from `run --json` / `selftest --json`")
    p.add_argument("summary", nargs="?", help="JSON printed by `llmfuzz run --json`")
    p.add_argument("--selftest", help="JSON printed by `llmfuzz selftest --json`")
    p.add_argument("--html", help="write the self-contained HTML page here")
    p.add_argument("--markdown", help="write the Markdown job summary here ('-' for stdout)")
    p.add_argument("--title", default="llmfuzz nightly")
    p.add_argument("--download-hint", help="a Markdown line put before the replay commands")
    p.set_defaults(fn=cmd_report)
    return p


def cmd_report(args) -> int:
    """Exit 0 when written, 2 on bad input (one line on stderr)."""
    try:
        if not args.summary and not args.selftest:
            raise ValueError("give a run summary JSON, --selftest JSON, or both")
        if not args.html and not args.markdown:
            raise ValueError("give --html FILE and/or --markdown FILE")
        summary = _load_json(args.summary, "summary") if args.summary else None
        selftest = _load_json(args.selftest, "selftest") if args.selftest else None
    except ValueError as e:
        print(f"llmfuzz report: {e}", file=sys.stderr)
        return 2
    if args.html:
        write_report(summary, selftest, args.html, args.title)
    if args.markdown:
        md = job_summary_md(summary, selftest, args.title, args.download_hint)
        if args.markdown == "-":
            sys.stdout.write(md)
        else:
            with open(args.markdown, "w", encoding="utf-8") as f:
                f.write(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.report")
    add_report_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
