"""Reports from the JSON that `llmfuzz run --json` and `llmfuzz selftest --json` print.

`write_report` writes one self-contained HTML page (inline CSS and SVG, no scripts, no
external assets) and `job_summary_md` the Markdown for a CI job summary. Plots are SVG
drawn by fuzz.report.svg, so the report needs nothing beyond the standard library: it runs in a CI job
that has not installed torch (`python -m fuzz.report ...`) as well as `llmfuzz report`.
"""
from __future__ import annotations

import argparse
import datetime
import html
import json
import re
import sys

from fuzz.report import green_html, tables
from fuzz.report.green_html import campaign_ratio_html, classes_html, limits_html, mutate_html, ratio_cards
from fuzz.report.svg import FAIL, OK, grouped_bar_svg, hbar_svg, histogram_svg  # noqa: F401 (re-exported)
from fuzz.report.svg import num as _num, ratio_text
from fuzz.report.tables import Cell as _Cell, table as _table
from fuzz.report.vllm_html import others_html, shards_html, vllm_html


# -- reading the JSON ---------------------------------------------------------------------

def _layout_key(name: str) -> tuple:
    """tp1pp1 first, then by world size: the order a reader scans layouts in."""
    m = re.fullmatch(r"tp(\d+)pp(\d+)", name)
    tp, pp = (int(m.group(1)), int(m.group(2))) if m else (1 << 30, 0)
    return (tp * pp, pp, tp, name)


# What a row's Cases reached (fuzz.campaign.summary.reach_row), as (JSON key, column head):
# shares in percent, the number of config limits reached as a count.
REACH = (("prefix_hit_rate", "prefix hit %"), ("sampling_share", "sampling %"),
         ("random_sampling_share", "random %"), ("penalties_share", "penalties %"),
         ("abort_share", "abort %"), ("limits_reached", "limits reached"))


# What a row's passing examples measured (fuzz.campaign.summary.measured_row; None where not recorded).
MEASURED = ("error_ratio_max", "error_ratio_hist", "events")


def cells(summary: dict) -> list[dict]:
    """`per_cell` as rows {layout, mode, dtype, examples, examples_per_s, failures, limits, the
    MEASURED and REACH keys (None where not recorded)}, layouts in scan order."""
    rows = []
    for key, c in (summary.get("per_cell") or {}).items():
        layout, _, mode = key.partition("/")
        rows.append({"layout": layout, "mode": mode, "dtype": c.get("dtype") or summary.get("dtype"),
                     "examples": c.get("examples", 0), "examples_per_s": c.get("examples_per_s"),
                     "failures": c.get("failures", 0), "limits": c.get("limits") or {},
                     **{k: c.get(k) for k in MEASURED}, **{k: c.get(k) for k, _ in REACH}})
    return sorted(rows, key=lambda r: (_layout_key(r["layout"]), r["mode"]))


def _reach(r: dict) -> list[str]:
    """A row's REACH cells: shares as percent, the limit count as is, "–" where not recorded."""
    return [("–" if r[k] is None else str(r[k]) if k == "limits_reached" else f"{100 * r[k]:.0f}") for k, _ in REACH]


def replay_command(path: str) -> str:
    return f"llmfuzz replay {path}"


def _rate(summary: dict) -> float | None:
    s = summary.get("seconds") or 0
    return summary.get("examples", 0) / s if s else None


# -- HTML ---------------------------------------------------------------------------------

CSS = """body{font-family:sans-serif;margin:24px;max-width:1100px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child,td.l{text-align:left}.bad{color:#c0392b;font-weight:bold}.good{color:#2e8b57}
.banner{padding:8px 12px;border-radius:4px;font-weight:bold}.banner.bad{background:#fdecea}
.banner.good{background:#e8f5e9}code,pre{background:#f4f4f4;padding:2px 4px}pre{padding:8px;white-space:pre-wrap}
.failure{border-left:4px solid #c0392b;padding:4px 12px;margin:12px 0}.plot{margin:12px 0}
svg{max-width:100%;height:auto;display:block}
.note{color:#666}.path{font-family:monospace;font-size:11px;word-break:break-all;max-width:280px}
""" + tables.CSS + green_html.CSS


def _campaign_html(summary: dict, mutate: dict | None = None) -> list[str]:
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
    out += mutate_html(mutate)
    rows = cells(summary)
    out.append("<h2>Per layout × mode</h2>" + _table(
        ["layout", "mode", "examples", "examples/s", "failures"] + [h for _, h in REACH],
        [[r["layout"], r["mode"], str(r["examples"]), _num(r["examples_per_s"]),
          _Cell(f'<td class="bad">{r["failures"]}</td>') if r["failures"] else "0"] + _reach(r) for r in rows]))
    # How green: each cell's distance from failing, the case classes and limits its Cases reached.
    ratios = campaign_ratio_html(summary)
    out += [ratio_cards(rows), ratios]
    out += classes_html(summary, rows)
    if not ratios and not summary.get("events") and not any(r["events"] for r in rows):
        out.append('<p class="note">Case classes and the error/tolerance distribution are not recorded in '
                   "this summary.</p>")
    out.append(limits_html(rows))
    groups = sorted({r["layout"] for r in rows}, key=_layout_key)
    series = sorted({r["mode"] for r in rows})
    flagged = {(r["layout"], r["mode"]) for r in rows if r["failures"]}
    for key, title, unit in (("examples_per_s", "Examples per second, layout × mode", "examples/s"),
                             ("examples", "Examples run, layout × mode", "examples")):
        vals = {(r["layout"], r["mode"]): r[key] for r in rows}
        out.append(f'<div class="plot">{grouped_bar_svg(title, groups, series, vals, unit, flagged)}</div>')
    out.append("<h2>Failures</h2>")
    if not fails:
        out.append("<p>None.</p>")
    else:
        out.append(_findings_table(fails, summary.get("shrink_phase")))
    for i, f in enumerate(fails, 1):
        path = f.get("path", "")
        out.append(
            f'<div class="failure"><p><b>{i}. {html.escape(str(f.get("property")))}</b>: '
            f'{html.escape(str(f.get("message")))}</p>'
            f'<p>case: <code>{html.escape(str(f.get("case_desc")))}</code><br>'
            f'error/tolerance: {html.escape(_num(f.get("error_ratio")))}<br>'
            f'reproducer: <code>{html.escape(path)}</code></p>'
            f"<pre>{html.escape(replay_command(path))}\nllmfuzz minimize {html.escape(path)}</pre>"
            f"{others_html(f)}</div>")
    return out + shards_html(summary)


def _yes_no(v) -> str:
    return "–" if v is None else ("yes" if v else "no")


def _findings_table(fails: list[dict], phase: dict | None) -> str:
    """When each failure was found and how small its reproducer is (fuzz.campaign.findings' fields)."""
    rows = []
    for i, f in enumerate(fails, 1):
        size = f.get("size") or {}
        minimal = f.get("minimal")
        rows.append([str(i), str(f.get("property")), f.get("oracle") or "–", _num(f.get("seconds_to_find"), 1),
                     _num(f.get("examples_before")), _num(size.get("requests")), _num(size.get("tokens")),
                     f"{size.get('layout', '–')}/{size.get('mode', '–')}",
                     _Cell(f'<td class="{"good" if minimal else "bad"}">{_yes_no(minimal)}</td>'),
                     _num(f.get("shrink_seconds"), 1)])
    note = ""
    if phase:
        note = (f'<p class="note">Shrink phase after the budget: {phase.get("minimal")} of {phase.get("failures")} '
                f'failure(s) minimal in {_num(phase.get("seconds"), 1)} s (budget {_num(phase.get("budget_s"), 0)} s)'
                + (", interrupted" if phase.get("interrupted") else "") + ".</p>")
    return _table(["#", "property", "oracle", "found after s", "examples before", "requests", "tokens",
                   "layout/mode", "minimal", "shrink s"], rows) + note


def _selftest_html(st: dict) -> list[str]:
    faults = st.get("faults") or []
    det, tot = st.get("detected", 0), st.get("total", len(faults))
    out = ["<h2>Selftest</h2>",
           f'<p class="banner {"good" if det == tot else "bad"}">{det}/{tot} faults detected; median '
           f'seconds to detection {html.escape(_num(st.get("median_seconds_to_detection")))}</p>']
    out.append(_table(
        ["fault", "detected", "seconds", "examples", "property", "oracle", "requests", "tokens", "layout/mode",
         "minimal", "reproducer"],
        [[f["name"], _Cell('<td class="good">yes</td>' if f.get("detected") else '<td class="bad">NO</td>'),
          _num(f.get("seconds")), _num(f.get("examples")), f.get("property") or "–", f.get("oracle") or "–",
          _num(f.get("requests")), _num(f.get("tokens")),
          f"{f.get('layout')}/{f.get('mode')}" if f.get("detected") else "–", _yes_no(f.get("minimal")),
          _Cell(f'<td class="l path">{html.escape(f.get("reproducer") or "–")}</td>')] for f in faults]))
    rows = [(f["name"], f.get("seconds"), OK, f"{_num(f.get('seconds'))} s") if f.get("detected")
            else (f["name"], f.get("total_seconds"), FAIL, f"not detected in {_num(f.get('total_seconds'), 0)} s")
            for f in faults]
    out.append('<div class="plot">' + hbar_svg("Seconds to detection per fault", rows, "s") + "</div>")
    return out


def render_html(summary: dict | None, selftest: dict | None = None, title: str = "llmfuzz report",
                mutate: dict | None = None) -> str:
    """The page; `mutate`: an `llmfuzz mutate --json` report, shown with a campaign's summary."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="note">generated {now}</p>']
    if summary is not None:
        body += vllm_html(summary) if summary.get("target") == "vllm" else _campaign_html(summary, mutate)
    if selftest is not None:
        body += _selftest_html(selftest)
    if summary is None:
        body += mutate_html(mutate)
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_report(summary_json: dict | None, selftest_json: dict | None, out_html: str,
                 title: str = "llmfuzz report", mutate_json: dict | None = None) -> str:
    with open(out_html, "w", encoding="utf-8") as f:
        f.write(render_html(summary_json, selftest_json, title, mutate_json))
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
                  "", "| layout | mode | examples | ex/s | failures | " + " | ".join(h for _, h in REACH)
                  + " | max error/tolerance |", "|---|---|--:|--:|--:|" + "--:|" * (len(REACH) + 1)]
        lines += [f"| {r['layout']} | {r['mode']} | {r['examples']} | {_num(r['examples_per_s'])} | "
                  f"{r['failures']} | " + " | ".join(_reach(r)) + f" | {ratio_text(r['error_ratio_max'])} |"
                  for r in cells(summary)]
        if fails:
            lines += ["", "### Failures", ""]
            if download_hint:
                lines += [download_hint, ""]
            for i, f in enumerate(fails, 1):
                size = f.get("size") or {}
                found = (f"   found after {_num(f.get('seconds_to_find'), 1)} s ({_num(f.get('examples_before'))} "
                         f"examples before); reproducer {_num(size.get('requests'))} request(s), "
                         f"{_num(size.get('tokens'))} tokens, {size.get('layout', '–')}/{size.get('mode', '–')}, "
                         f"minimal: {_yes_no(f.get('minimal'))}  ")
                lines += [f"{i}. **{_line(f.get('property'))}**: {_line(f.get('message'))}  ", found,
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
    p.add_argument("--mutate", help="JSON printed by `llmfuzz mutate --json` (its DIR/mutate.json): "
                   "the mutation score, shown with the campaign")
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
        mutate = _load_json(args.mutate, "mutate report") if args.mutate else None
    except ValueError as e:
        print(f"llmfuzz report: {e}", file=sys.stderr)
        return 2
    if args.html:
        write_report(summary, selftest, args.html, args.title, mutate)
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
