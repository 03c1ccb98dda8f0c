"""The HTML report's sections on how green a campaign is: per cell (layout × mode, in its dtype)
the error/tolerance of its passing examples by decade and the largest, the case classes its
examples reached (the strategies' event() labels) and the config limits; and the latest
mutation score (`llmfuzz mutate --json`, docs/mutate.md). A summary written before the per-cell
fields existed renders with what it has (campaign-wide plots, or a note).
The standard library only, as fuzz.report.render."""
from __future__ import annotations

import html

from fuzz.report.svg import histogram_svg, hbar_svg, mini_histogram_svg, num, ratio_text
from fuzz.report.tables import matrix_table, table


def _name(r: dict) -> str:
    return f"{r['layout']}/{r['mode']}"


def _noted(r: dict) -> int:
    """Examples whose error/tolerance the row counted: its passing ones."""
    return sum((r.get("error_ratio_hist") or {}).values())


# A card per cell, four to a row at the page's width (fuzz.report.render.CSS: 1100 px at most).
CSS = (".cards{display:flex;flex-wrap:wrap;gap:8px;margin:8px 0}.card{border:1px solid #ccc;border-radius:4px;"
       "padding:6px 8px;width:206px;font-size:13px;line-height:1.5}.card svg{margin:4px 0}")


def ratio_cards(rows: list[dict]) -> str:
    """Per cell: its dtype, the largest error/tolerance of its passing examples and their
    distribution by decade, how many case classes they reached ("" for a summary without them)."""
    if not any(r.get("error_ratio_hist") for r in rows):
        return ""
    cards = []
    for r in rows:
        worst, hist, classes = r.get("error_ratio_max"), r.get("error_ratio_hist"), r.get("events")
        bad = ' class="bad"' if worst is not None and worst >= 1 else ""
        plot = mini_histogram_svg(hist, f"{_name(r)}: passing examples by error/tolerance") if hist else ""
        n_classes = "–" if classes is None else str(len(classes))
        cards.append(f'<div class="card"><b>{html.escape(r["layout"])} / {html.escape(r["mode"])}</b> '
                     f'<span class="note">{html.escape(r.get("dtype") or "dtype –")}</span><br>'
                     f"max error/tolerance <b{bad}>{html.escape(ratio_text(worst))}</b>"
                     f'{" (bitwise)" if worst == 0 else ""}{plot}'
                     f'<span class="note">{_noted(r)} passing; case classes: {n_classes}</span></div>')
    return ("<h2>Error / tolerance per cell</h2>"
            '<p class="note">How far each cell\'s passing examples were from failing: the largest '
            "error/tolerance (1 violates) and how many fell in each decade (0: bitwise equal to the "
            "oracle; shaded: violating).</p>" + f'<div class="cards">{"".join(cards)}</div>')


def classes_html(summary: dict, rows: list[dict]) -> list[str]:
    """The case classes reached: per cell (share of its passing examples) where the summary
    has them, and the campaign's counts; only the campaign's in a summary without rows' ones."""
    per_cell = [r for r in rows if r.get("events") is not None]
    total = summary.get("events") or {}
    out = []
    if per_cell:
        counts: dict[str, int] = {}
        for r in per_cell:
            for k, n in r["events"].items():
                counts[k] = counts.get(k, 0) + n
        names = sorted(counts, key=lambda k: (-counts[k], k))
        out.append("<h2>Case classes reached per cell (% of passing examples)</h2>"
                   + matrix_table("layout/mode", [(_name(r), {k: n / max(1, _noted(r)) for k, n in r["events"].items()})
                                                  for r in per_cell], names))
        total = total or counts
    if total:
        where = "" if per_cell else " (campaign-wide: this summary records no case classes per cell)"
        erows = sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))
        out.append(f"<h2>Case classes covered{where}</h2>" + '<div class="plot">' + hbar_svg(
            "Examples per case class (event() labels), whole campaign",
            [(k, float(v), "#5a9e5a", str(v)) for k, v in erows], "examples") + "</div>")
    return out


def campaign_ratio_html(summary: dict) -> str:
    """The campaign's error/tolerance by decade: from the summary's counts, or the list of
    ratios an older summary carried."""
    ratios = summary.get("error_ratio_hist") or summary.get("error_ratios")
    if not ratios:
        return ""
    worst = summary.get("error_ratio_max")
    return ("<h2>Error / tolerance, whole campaign</h2>" + '<div class="plot">'
            + histogram_svg("Examples by error/tolerance (≥ 1 violates)"
                            + (f", largest {ratio_text(worst)}" if worst is not None else ""), ratios) + "</div>")


def limits_html(rows: list[dict]) -> str:
    """Per cell (rows) and config limit (columns): the share of Cases that reached it."""
    names = sorted({n for r in rows for n in r["limits"]})
    if not names:
        return ""
    return ("<h2>Config limits reached per cell (% of Cases)</h2>"
            + matrix_table("layout/mode", [(_name(r), r["limits"]) for r in rows], names))


MUTATE_COUNTS = ("mutants", "caught", "caught_by_timeout", "silent", "silent_fa_only", "unobserved",
                 "stillborn", "error", "observable")


def mutate_html(doc: dict | None) -> list[str]:
    """The mutation score of `llmfuzz mutate --json` (fuzz.mutate.report): caught / observable,
    the counts, and the settings a score is compared at ([] without one)."""
    if not doc:
        return []
    c, base = doc.get("counts") or {}, doc.get("baseline") or {}
    score = doc.get("score")
    line = (f"score {num(score, 3)} ({c.get('caught', '–')} caught of {c.get('observable', '–')} observable "
            f"mutants); outputs only {num(doc.get('score_outputs'), 3)}" if score is not None
            else "no score: no mutant was observable")
    out = ["<h2>Mutation score</h2>", f'<p class="banner info">{html.escape(line)}</p>',
           table(list(MUTATE_COUNTS), [[num(c.get(k)) for k in MUTATE_COUNTS]])]
    settings = (f"llmfuzz mutate --seed {doc.get('seed', '–')} --n {doc.get('n', '–')} --budget-per-mutant "
                f"{num(doc.get('budget_per_mutant_s'), 0)} on {doc.get('target', '–')}, "
                f"{num(doc.get('points_total'))} mutation points, {num(doc.get('wall_s'), 0)} s")
    out.append(f'<p class="note">{html.escape(settings)}. Scores compare at the same seed, --n, '
               "budget and machine load (docs/mutate.md).</p>")
    if base.get("green") is False:
        out.append('<p class="bad">The unmutated engine\'s campaign failed: the score means little.</p>')
    return out
