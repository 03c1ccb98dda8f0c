"""What a campaign says about each failure it found: when (seconds and examples before it),
what (property, oracle), how small its reproducer is (requests, tokens, layout, mode) and
whether the minimizer got it to a minimum. One place, for the reproducer's JSON, the
`run --json` summary, the printed table and selftest.

Plain data only (no torch): fuzz.report.render renders the same fields from JSON.
"""
from __future__ import annotations

FIELDS = ("seconds_to_find", "examples_before", "property", "oracle", "requests", "tokens", "layout", "mode",
          "minimal")


def case_size(case) -> dict:
    """The shrunk size a finding reports: requests, prompt tokens, layout, mode."""
    return {"requests": len(case.workload.requests), "tokens": case.workload.num_prompt_tokens,
            "layout": case.layout, "mode": case.mode}


def finding(failure) -> dict:
    """One Failure (fuzz.targets.base) as the flat row the summary table and the report show."""
    size = failure.size or {}
    return {"seconds_to_find": failure.seconds_to_find, "examples_before": failure.examples_before,
            "property": failure.property, "oracle": failure.oracle, **{k: size.get(k) for k in FIELDS[4:8]},
            "minimal": failure.minimal}


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def findings_table(rows: list[dict]) -> str:
    """The failures as a table: `rows` are `finding()` dicts (or the same keys from JSON)."""
    head = f"{'#':>2} {'found s':>8}{'ex.before':>10}  {'property':<18}{'oracle':<13}{'reqs':>5}{'toks':>5}" \
           f"  {'layout/mode':<14}{'minimal':>8}"
    out = [head]
    for i, r in enumerate(rows, 1):
        where = f"{r.get('layout') or '-'}/{r.get('mode') or '-'}"
        out.append(f"{i:>2} {_cell(r.get('seconds_to_find')):>8}{_cell(r.get('examples_before')):>10}  "
                   f"{_cell(r.get('property')):<18}{_cell(r.get('oracle')):<13}{_cell(r.get('requests')):>5}"
                   f"{_cell(r.get('tokens')):>5}  {where:<14}{_cell(r.get('minimal')):>8}")
    return "\n".join(out)


def run_json(summary, shrink_report: dict | None) -> dict:
    """`llmfuzz run --json`: the summary's JSON, each failure with its finding fields (already
    in `failure_details`), and what the shrink phase did (null: nothing was left to it)."""
    doc = summary.to_json()
    doc["shrink_phase"] = shrink_report
    if getattr(summary, "shard", None) is not None and "target" not in doc:  # vLLM's is merged as it is
        from fuzz.campaign.summary import summary_doc

        # What `llmfuzz merge` needs of a shard (fuzz.campaign.merge): its part, its Summary in full.
        doc["shard_report"] = {**summary.shard.part, "budget_s": summary.budget_s, "seed": summary.seed,
                               "report": summary_doc(summary, shrink_report)}
    return doc


def run_text(summary, shrink_report: dict | None) -> str:
    """`llmfuzz run`'s printed summary: the per-cell table, the findings table, then each
    failure with its replay command."""
    out = [summary.table()]
    if summary.failures:
        out += ["", "findings (seconds and examples before the first failing one; the reproducer's size):",
                findings_table([finding(f) for f in summary.failures])]
        if shrink_report:
            out.append(f"shrink phase: {shrink_report['minimal']} of {shrink_report['failures']} minimal "
                       f"in {shrink_report['seconds']:.1f}s (budget {shrink_report['budget_s']:.0f}s)"
                       + (", interrupted" if shrink_report.get("interrupted") else ""))
    for f in summary.failures:
        by = f" (against {f.oracle})" if f.oracle else ""
        how = (f"Reproduce with: llmfuzz replay {f.path}" if f.path else
               "no reproducer written (the output directory refused it): the failing Case was printed as JSON above")
        out.append(f"\nFAILED {f.property}{by}: {f.message}\n  case: {f.case_desc}\n  {how}")
        if getattr(f, "fresh_replay", None):  # a target that keeps state (fuzz.campaign.history)
            out.append(f"  fresh replay: {_fresh_words(f)}")
        rate = (f.meta or {}).get("replay_rate")
        if rate:  # found under contention (fuzz.campaign.replay_rate)
            out.append(f"  replayed: reproduces {rate['reproduced']}/{rate['runs']} under {rate['contention']}")
        if f.others:  # `llmfuzz merge`: the same failure in other shards, larger
            out.append(f"  also found as: {', '.join(f.others)}")
    needing = [f for f in summary.failures if (getattr(f, "fresh_replay", None) or "").startswith("fails with")]
    passing = [f for f in summary.failures if getattr(f, "fresh_replay", None) == "passes"]
    if needing or passing:
        out.append(f"\nfresh replay: {len(needing)} finding(s) needed earlier Cases (a history) to fail on a "
                   f"fresh engine; {len(passing)} did not fail on a fresh engine at all (reproducible: false)")
    if summary.jobs > 1:
        out.append(f"\n{summary.jobs} worker processes" + (f"; {summary.repeats} failure(s) found again by "
                   "another worker, written once" if summary.repeats else ""))
        for w in summary.workers:
            if w.get("status") != "ok":
                files = f"; its reproducers: {', '.join(w['reproducers'])}" if w.get("reproducers") else ""
                out.append(f"WORKER {w['worker']} ({','.join(w['layouts'])}) {w['status']}: "
                           f"{w.get('error', '')}{files}")
    if summary.shards:
        out.append(f"\nmerged {len(summary.shards)} shards: " + "; ".join(
            f"{r['shard']} missing" if r.get("status") == "missing"
            else f"{r['shard']} {','.join(r['layouts'])}{_chunks(r['stream'])} ({r['examples']} examples)"
            for r in summary.shards))
    if summary.interrupted:
        out.append("(interrupted: summary so far)")
    return "\n".join(out)


def _fresh_words(f) -> str:
    if f.fresh_replay == "passes":
        return "passes (did not fail on a fresh engine, not even after the Cases before it: not reproducible)"
    if f.fresh_replay.startswith("fails with"):
        return f"{f.fresh_replay} (the replay runs the earlier Cases first)"
    return f.fresh_replay


def _chunks(stream: str) -> str:
    """A shard's stream ("s/S") as `run --jobs` says it: nothing for a whole layout's chunks."""
    s, n = stream.split("/")
    return f" (chunks {s} mod {n})" if n != "1" else ""
