"""The HTML report's sections for a vLLM campaign's summary (fuzz.targets.vllm.summary's form:
per config, with the covering plan's pairs and the known crashes) and for the shards a merged
summary came from (`llmfuzz merge`). The standard library only, as fuzz.report.render."""
from __future__ import annotations

import html

from fuzz.report.svg import num as _num


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def shards_html(summary: dict) -> list[str]:
    """The shards merged into this summary, and those missing ({} without shards)."""
    shards = summary.get("shards") or []
    if not shards:
        return []
    rows = [[s["shard"], "missing" if s.get("status") == "missing" else "ok",
             ", ".join(s.get("layouts") or s.get("configs") or []), _num(s.get("examples")), _num(s.get("seconds"))]
            for s in shards]
    return ["<h2>Shards</h2>" + _table(["shard", "status", "cells", "examples", "seconds"], rows)]


def others_html(f: dict) -> str:
    """The other reproducers of one failure (a merged summary: the same failure in other shards)."""
    others = f.get("others") or []
    if not others:
        return ""
    return "<p>also found as: " + ", ".join(f"<code>{html.escape(p)}</code>" for p in others) + "</p>"


def vllm_html(summary: dict) -> list[str]:
    """A vLLM campaign: totals, per config, the pairs exercised, known crashes, failures."""
    fails = summary.get("failures") or []
    out = [f'<p class="banner {"bad" if fails else "good"}">'
           + (f"{len(fails)} failure(s) found" if fails else "No failures") + "</p>",
           f"<p>vLLM {html.escape(str(summary.get('vllm_version')))}, {summary.get('examples', 0)} examples in "
           f"{_num(summary.get('seconds'))} s; oracles: {html.escape(', '.join(summary.get('oracles') or []))}</p>"]
    out += shards_html(summary)
    out.append("<h2>Per config</h2>" + _table(
        ["config", "examples", "examples/s", "engine starts", "start-up s", "failures", "known", "note"],
        [[n, c.get("examples", 0), _num(c.get("examples_per_s")), c.get("engine_starts", 0),
          _num(c.get("startup_s"), 1), len(c.get("failures") or []), len(c.get("known") or []), c.get("stopped", "")]
         for n, c in (summary.get("per_cell") or {}).items()]))
    pairs = summary.get("pairs_exercised")
    if pairs:
        out.append(f"<p>Pairs of config values exercised: {pairs['covered']} (the plan covers "
                   f"{pairs['of_planned']}); not reached: {len(summary.get('configs_not_reached') or [])} "
                   "config(s).</p>")
    crashes = summary.get("known_crashes") or []
    if crashes:
        out.append("<h2>Known crashes</h2>" + _table(
            ["reproducer", "state", "detail", "signature"],
            [[k.get("reproducer"), k.get("state"), k.get("detail") or "", k.get("signature")] for k in crashes]))
    out.append("<h2>Failures</h2>" + ("<p>None.</p>" if not fails else ""))
    for i, f in enumerate(fails, 1):
        path = str(f.get("path", ""))
        out.append(f'<div class="failure"><p><b>{i}. {html.escape(str(f.get("property")))}</b> on '
                   f'<code>{html.escape(str(f.get("config")))}</code>: {html.escape(str(f.get("message"))[:500])}</p>'
                   f'<p>case: <code>{html.escape(str(f.get("case")))}</code></p>'
                   f"<pre>llmfuzz replay {html.escape(path)}</pre>{others_html(f)}</div>")
    return out
