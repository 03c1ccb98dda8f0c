"""fuzz/report/render.py: the HTML page and the Markdown job summary, from the JSON that
`llmfuzz run --json` and `llmfuzz selftest --json` print (built here with the real
Summary / FaultResult classes, so a renamed key breaks this test, not the nightly)."""
from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from fuzz.campaign.summary import CellStats, Failure, Summary
from fuzz.report.render import add_report_parser, job_summary_md, main, render_html, write_report
from fuzz.campaign.selftest import FaultResult, summary_json

VOID = {"meta", "br", "hr", "img", "input", "link", "rect", "line", "path", "circle"}


def campaign_json() -> dict:
    s = Summary(examples=40, seconds=20.0)
    for (lay, mode), (n, secs) in {("tp1pp1", "eager"): (12, 4.0), ("tp1pp1", "graph"): (10, 5.0),
                                   ("tp2pp4", "eager"): (8, 6.0), ("tp1pp8", "graph"): (10, 5.0)}.items():
        s.cells[(lay, mode)] = CellStats(examples=n, seconds=secs)
    s.cells[("tp2pp4", "eager")].failures = 1
    s.cells[("tp1pp8", "graph")].failures = 1
    s.failures = [
        Failure("logits", "step 2 req r0: max |Δ| 3.1e-2 > tol 1e-5 <b>", "tp1pp2 eager | 1 request(s)",
                "nightly/reproducers/logits/aaaa11112222.json", float("inf"), "reference",
                seconds_to_find=17.25, examples_before=31, minimal=True, shrink_seconds=4.5,
                size={"requests": 1, "tokens": 5, "layout": "tp1pp2", "mode": "eager"}),
        Failure("fa_invariants", "cu_seqlens_q padded tail must repeat", "tp1pp8 graph | 2 request(s)",
                "nightly/reproducers/fa_invariants/bbbb33334444.json", None,
                seconds_to_find=19.5, examples_before=39, minimal=False, shrink_seconds=60.0,
                size={"requests": 2, "tokens": 9, "layout": "tp1pp8", "mode": "graph"}),
    ]
    from fuzz.campaign.findings import run_json

    shrink = {"budget_s": 60.0, "seconds": 58.2, "failures": 1, "minimal": 0, "interrupted": False}
    return json.loads(json.dumps(run_json(s, shrink)))  # as read back from summary.json


def selftest_json() -> dict:
    return json.loads(json.dumps(summary_json([
        FaultResult("stale_query_start_loc_tail", True, 3.5, 7, "fa_invariants", 1, 1, "tp1pp1", "graph",
                    "r/fa_invariants/x.json", 9.0),
        FaultResult("pp_uneven_partition", True, 12.25, 30, "logits", 1, 2, "tp1pp3", "eager",
                    "r/logits/y.json", 20.0),
        FaultResult("capture_metadata_baked", False, None, None, None, None, None, None, None, None, 60.0),
        FaultResult("<td>x</td>", True, 1.0, 1, "logits", 1, 1, "tp1pp1", "eager", "r/z.json", 2.0),
    ])))


class TagChecker(HTMLParser):
    """Every non-void element closes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


def check_html(text: str) -> TagChecker:
    assert text.startswith("<!DOCTYPE html>")
    p = TagChecker()
    p.feed(text)
    p.close()
    assert p.stack == [], p.stack
    # Self-contained: no scripts, no external assets.
    assert "<script" not in text.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "external reference"
    assert "<link" not in text
    for svg in re.findall(r"<svg.*?</svg>", text, re.S):
        ET.fromstring(svg)  # inline SVG must be well-formed XML
    return p


def test_report_html_has_layouts_failures_and_plots(tmp_path) -> None:
    summary, st = campaign_json(), selftest_json()
    path = write_report(summary, st, str(tmp_path / "report.html"))
    text = open(path, encoding="utf-8").read()
    check_html(text)
    for layout in ("tp1pp1", "tp2pp4", "tp1pp8"):
        assert layout in text
    for f in summary["failure_details"]:
        assert f["property"] in text
        assert f"llmfuzz replay {f['path']}" in text
        assert f"llmfuzz minimize {f['path']}" in text
    assert "&lt;b&gt;" in text and "<b>" not in text.split("step 2 req r0")[1][:60]  # messages escaped
    assert "inf" in text  # a non-finite error ratio prints, it does not crash
    svgs = re.findall(r"<svg.*?</svg>", text, re.S)
    # examples/s and examples per layout × mode, selftest seconds to detection
    assert len(svgs) == 3, len(svgs)
    assert "Examples per second" in svgs[0] and "tp2pp4" in svgs[0]
    assert "Seconds to detection" in svgs[2]
    assert "<td>&lt;td&gt;x&lt;/td&gt;</td>" in text  # a name that looks like HTML stays text
    for fault in ("stale_query_start_loc_tail", "pp_uneven_partition", "capture_metadata_baked"):
        assert fault in svgs[2]
    assert "not detected" in svgs[2]
    assert "3/4 faults detected" in text
    # Cells with failures are outlined in the plot.
    assert svgs[0].count('stroke="#c0392b"') == 2


def test_report_times_and_sizes_every_finding() -> None:
    """Each failure: seconds to first detection, examples before it, property and oracle, the
    reproducer's size and whether it is minimal, in the HTML page and the job summary."""
    summary = campaign_json()
    text = render_html(summary, None)
    check_html(text)
    table = text[text.index("<h2>Failures</h2>"):].split("</table>")[0]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", table)
    assert cells[:10] == ["1", "logits", "reference", "17.2", "31", "1", "5", "tp1pp2/eager", "yes", "4.5"], cells
    assert cells[10:20] == ["2", "fa_invariants", "–", "19.5", "39", "2", "9", "tp1pp8/graph", "no", "60.0"], cells
    assert "0 of 1 failure(s) minimal in 58.2 s (budget 60 s)" in text
    md = job_summary_md(summary)
    assert ("found after 17.2 s (31 examples before); reproducer 1 request(s), 5 tokens, tp1pp2/eager, "
            "minimal: yes") in md
    assert "minimal: no" in md


def test_report_optional_sections(tmp_path) -> None:
    """A summary with only campaign-wide case classes and a list of ratios (as older ones had)."""
    summary = campaign_json()
    summary["events"] = {"layout=tp1pp1": 22, "chunked prefill": 5, "non-default schedule": 9}
    summary["error_ratios"] = [0.0, 0.0, 1e-7, 3e-3, 0.4, 2.0, float("inf")]
    text = render_html(summary, None)
    check_html(text)
    svgs = re.findall(r"<svg.*?</svg>", text, re.S)
    assert len(svgs) == 4
    assert "error/tolerance" in svgs[0] and "chunked prefill" in svgs[1]
    assert "campaign-wide: this summary records no case classes per cell" in text
    assert "Error / tolerance per cell" not in text  # no per-cell counts to draw
    assert "Selftest" not in text
    only_selftest = render_html(None, selftest_json())
    check_html(only_selftest)
    assert only_selftest.count("<svg") == 1


def test_job_summary_lists_replay_commands() -> None:
    summary, st = campaign_json(), selftest_json()
    md = job_summary_md(summary, st, download_hint="Download: `gh run download 7 -n llmfuzz-reproducers`")
    assert "2 failure(s)" in md
    for f in summary["failure_details"]:
        assert f"llmfuzz replay {f['path']}" in md
    assert md.index("Download:") < md.index("llmfuzz replay")
    assert "| tp2pp4 | eager | 8 | 1.33 | 1 |" in md
    assert "| capture_metadata_baked | **NO** |" in md
    assert "3/4 faults detected" in md
    clean = job_summary_md({**summary, "failures": 0, "failure_details": [], "reproducers": []})
    assert "no failures" in clean and "llmfuzz replay" not in clean


def test_report_command_line(tmp_path, capsys) -> None:
    s, st = tmp_path / "summary.json", tmp_path / "selftest.json"
    s.write_text(json.dumps(campaign_json()))
    st.write_text(json.dumps(selftest_json()))
    html_out, md_out = tmp_path / "r.html", tmp_path / "s.md"
    assert main([str(s), "--selftest", str(st), "--html", str(html_out), "--markdown", str(md_out)]) == 0
    check_html(html_out.read_text())
    assert "llmfuzz replay" in md_out.read_text()
    assert main(["--selftest", str(st), "--markdown", "-"]) == 0
    assert "faults detected" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text('{"examples": ')
    for argv in ([str(bad), "--html", str(html_out)], [str(tmp_path / "missing.json"), "--html", str(html_out)],
                 [str(s)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("llmfuzz report: "), err


def test_add_report_parser_plugs_into_a_cli() -> None:
    parser = argparse.ArgumentParser(prog="llmfuzz")
    add_report_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["report", "s.json", "--html", "r.html"])
    assert args.summary == "s.json" and args.html == "r.html" and callable(args.fn)


@pytest.mark.parametrize("per_cell", [{}, {"tp1pp1/eager": {"examples": 0, "failures": 0, "examples_per_s": None}}])
def test_report_empty_campaign(per_cell) -> None:
    text = render_html({"examples": 0, "failures": 0, "layouts": [], "modes": [], "seconds": 0.0,
                        "reproducers": [], "failure_details": [], "per_cell": per_cell, "interrupted": True})
    check_html(text)
    assert "No failures" in text
