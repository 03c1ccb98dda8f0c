"""The report of a green campaign says how green: per cell (layout × mode, its dtype) the
largest error/tolerance and its distribution by decade, the case classes reached, the mutation
score when given; and its plots fit the page: every label inside its SVG's viewBox, no two
labels on top of each other, SVGs that scale down instead of scrolling."""
from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET

from fuzz.campaign.summary import CellStats, Summary, note_example
from fuzz.campaign.selftest import FaultResult, summary_json
from fuzz.report.render import CSS, job_summary_md, main, render_html
from fuzz.report.svg import decade_counts, grouped_bar_svg, hbar_svg, text_box
from tests.fuzz.report.test_report import campaign_json, check_html

NS = "{http://www.w3.org/2000/svg}"
# One cell's ratios: 2 bitwise, 1e-7 folds into the first decade, 3e-3 and 4e-3 share one.
RATIOS = {("tp1pp1", "eager"): [0.0, 0.0, 1e-7, 3e-3, 4e-3, 0.4],
          ("tp2pp4", "graph"): [0.0, 0.02],
          ("tp1pp2", "eager"): []}


def green_json() -> dict:
    s = Summary(examples=9, seconds=9.0)
    for (lay, mode), ratios in RATIOS.items():
        c = s.cells[(lay, mode)] = CellStats(examples=len(ratios), seconds=1.0)
        for i, r in enumerate(ratios):
            note_example(c, r, "bfloat16" if mode == "graph" else "float32",
                         [f"layout={lay}", "limit: budget 1", "sampling"] + (["abort"] if i % 2 else []))
    return json.loads(json.dumps(s.to_json()))


def svgs(text: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", text, re.S)


def card(text: str, cell: str) -> str:
    lay, mode = cell.split("/")
    return text.split(f"<b>{lay} / {mode}</b>")[1].split('<div class="card">')[0]


def test_summary_rows_carry_counts_per_decade_max_and_dtype() -> None:
    doc = green_json()
    row = doc["per_cell"]["tp1pp1/eager"]
    assert row["error_ratio_hist"] == {"0": 2, "1e-6": 1, "1e-3": 2, "1e-1": 1}
    assert row["error_ratio_max"] == 0.4 and row["dtype"] == "float32"
    assert row["events"] == {"abort": 3, "sampling": 6}  # the cell's key and the limits are not classes
    assert doc["per_cell"]["tp2pp4/graph"]["dtype"] == "bfloat16"
    assert "error_ratio_hist" not in doc["per_cell"]["tp1pp2/eager"]  # nothing measured: nothing said
    assert doc["error_ratio_hist"] == {"0": 3, "1e-6": 1, "1e-3": 2, "1e-2": 1, "1e-1": 1}
    assert doc["error_ratio_max"] == 0.4 and doc["events"]["sampling"] == 8
    md = job_summary_md(doc)  # the CI job summary's table says it too
    assert "| max error/tolerance |" in md and "| tp1pp1 | eager | 6 |" in md and "| 4.0e-01 |" in md
    assert "| tp1pp2 | eager | 0 | 0.00 | 0 |" in md and md.count(" | – |") >= 1


def test_report_draws_each_cells_histogram_max_dtype_and_classes() -> None:
    text = render_html(green_json())
    check_html(text)
    assert "Error / tolerance per cell" in text
    one = card(text, "tp1pp1/eager")
    assert "float32" in one and "max error/tolerance <b>4.0e-01</b>" in one
    # A bar per non-empty decade, its count in its tooltip.
    bars = dict(re.findall(r"<title>([^<]*): (\d+) example\(s\)</title>", one))
    assert bars == {"0 (bitwise)": "2", "(0, 1e-5)": "1", "[1e-3, 1e-2)": "2", "[0.1, 1)": "1"}, bars
    assert "6 passing; case classes: 2" in one
    other = card(text, "tp2pp4/graph")
    assert "bfloat16" in other and "2.0e-02" in other
    assert dict(re.findall(r"<title>([^<]*): (\d+) example\(s\)</title>", other)) == {"0 (bitwise)": "1",
                                                                                     "[1e-2, 0.1)": "1"}
    # The cell that measured nothing says so rather than drawing an empty plot.
    assert "<svg" not in card(text, "tp1pp2/eager") and "0 passing" in card(text, "tp1pp2/eager")
    # Case classes per cell, in percent of the cell's passing examples.
    matrix = text.split("Case classes reached per cell")[1].split("</table>")[0]
    assert re.search(r"<td>tp1pp1/eager</td>.*?<td>50</td>", matrix)  # abort: 3 of 6


def test_a_violating_maximum_is_marked() -> None:
    doc = green_json()
    doc["per_cell"]["tp2pp4/graph"]["error_ratio_max"] = 2.5
    assert 'max error/tolerance <b class="bad">2.5e+00</b>' in render_html(doc)


def test_old_summaries_render_without_the_per_cell_fields() -> None:
    text = render_html(campaign_json())  # rows with no dtype, hist, max or classes
    check_html(text)
    assert "Error / tolerance per cell" not in text and "are not recorded in this summary" in text
    doc = green_json()
    for row in doc["per_cell"].values():
        for k in ("error_ratio_hist", "error_ratio_max", "events", "dtype"):
            row.pop(k, None)
    check_html(render_html(doc))  # campaign-wide fields, none per cell


def test_mutation_score_is_shown_when_given(tmp_path, capsys) -> None:
    mutate = {"version": 1, "score": 0.875, "score_outputs": 1.0, "seed": 101, "n": 40, "target": "reference",
              "budget_per_mutant_s": 120.0, "baseline": {"green": True},
              "counts": {"mutants": 40, "caught": 28, "silent": 4, "observable": 32, "stillborn": 1}}
    assert "Mutation score" not in render_html(green_json())
    text = render_html(green_json(), mutate=mutate)
    check_html(text)
    assert "score 0.875 (28 caught of 32 observable mutants)" in text and "--seed 101 --n 40" in text
    s, m, out = tmp_path / "s.json", tmp_path / "mutate.json", tmp_path / "r.html"
    s.write_text(json.dumps(green_json()))
    m.write_text(json.dumps({**mutate, "baseline": {"green": False}}))
    assert main([str(s), "--mutate", str(m), "--html", str(out)]) == 0
    page = out.read_text()
    assert "score 0.875" in page and "campaign failed: the score means little" in page
    m.write_text("[1]")
    assert main([str(s), "--mutate", str(m), "--html", str(out)]) == 2
    assert capsys.readouterr().err.startswith("llmfuzz report: mutate report")


# -- the plots fit -------------------------------------------------------------------------

def _boxes(svg: str) -> tuple[tuple[float, ...], list[tuple[str, float, tuple]]]:
    """The viewBox and, per <text>, (text, angle, the box it covers) as the layout measured it."""
    root = ET.fromstring(svg)
    view = tuple(float(v) for v in root.get("viewBox").split())
    out = []
    for t in root.iter(f"{NS}text"):
        m = re.fullmatch(r"rotate\(([-\d.]+) [-\d.]+ [-\d.]+\)", t.get("transform") or "rotate(0 0 0)")
        angle = float(m.group(1))
        text = "".join(t.itertext())
        out.append((text, angle, text_box(float(t.get("x")), float(t.get("y")), text, float(t.get("font-size")),
                                          t.get("text-anchor"), angle, t.get("font-weight") == "bold")))
    return view, out


def _check_fits(svg: str) -> None:
    (vx, vy, vw, vh), texts = _boxes(svg)
    for text, _, (x0, y0, x1, y1) in texts:
        assert vx <= x0 and x1 <= vx + vw and vy <= y0 and y1 <= vy + vh, (text, (x0, y0, x1, y1), (vx, vy, vw, vh))
    flat = [(text, b) for text, angle, b in texts if not angle]
    for i, (a, (ax0, ay0, ax1, ay1)) in enumerate(flat):
        for b, (bx0, by0, bx1, by1) in flat[i + 1:]:
            apart = ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0
            assert apart, f"{a!r} overlaps {b!r}"


def long_labels_report() -> str:
    """A report with many cells, long case-class and fault names, large counts."""
    s = Summary(examples=0, seconds=10.0)
    layouts = [f"tp{t}pp{p}" for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)][:14]
    for lay in layouts:
        for mode in ("eager", "graph"):
            c = s.cells[(lay, mode)] = CellStats(examples=3000, seconds=2.0)
            for r in [0.0] * 1500 + [1e-7] * 1400 + [0.9] * 99 + [1e9]:
                note_example(c, r, "float32", ["prefix hit on the block a chunk ends in, twice over, long " * 2,
                                               "parallel sampling (n > 1)"])
            s.examples += 3000
    selftest = summary_json([FaultResult("a_fault_name_long_enough_to_wrap_in_any_reasonable_layout" * 2, False,
                                         None, None, None, None, None, None, None, None, 600.0)])
    return render_html(json.loads(json.dumps(s.to_json())), json.loads(json.dumps(selftest)))


def test_every_label_fits_its_viewbox_and_none_overlap() -> None:
    text = long_labels_report()
    check_html(text)
    plots = svgs(text)
    assert len(plots) > 28 + 3  # a histogram per cell, the campaign's, classes, two bar plots, selftest
    for svg in plots:
        _check_fits(svg)
    legend = grouped_bar_svg("t", ["tp1pp1"], ["a_long_series_name_" * 3, "another_long_series_name"] * 2,
                             {("tp1pp1", "another_long_series_name"): 1.0}, "ex", {("tp1pp1", "x")})
    _check_fits(legend)
    _check_fits(hbar_svg("t", [("w" * 90, 5.0, "#000", "not detected in 600 s")], "s"))


def test_plots_scale_down_instead_of_scrolling() -> None:
    text = long_labels_report()
    assert "overflow-x:auto" not in CSS and re.search(r"svg\{[^}]*max-width:100%", CSS)
    for svg in svgs(text):
        assert 'style="max-width:100%;height:auto"' in svg.split(">")[0]
    # The widest plot, scaled to a ~1000 px page (952 px of content), keeps its labels legible.
    widest = max(float(ET.fromstring(svg).get("width")) for svg in svgs(text))
    assert 10 * min(1.0, 952 / widest) >= 7, widest


def test_decade_counts_of_ratios_and_of_counts_agree() -> None:
    ratios = [0.0, 1e-9, 1e-6, 5e-6, 1e-5, 0.999, 1.0, 1e3, math.inf, float("nan"), None]
    counts = decade_counts(ratios)
    assert (counts["0"], counts["1e-6"], counts["1e-5"], counts["1e-1"], counts["1e0"], counts["1e3"]) == \
        (1, 3, 1, 1, 1, 2)
    assert sum(counts.values()) == 9  # NaN and None are not measured
    assert decade_counts({k: n for k, n in counts.items() if n}) == counts
