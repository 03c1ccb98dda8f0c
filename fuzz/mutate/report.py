"""`llmfuzz mutate`'s report: counts, score, and each silent survivor with its diff and Case.

The JSON (`REPORT_VERSION`) is the stable form: `counts`, `score` (caught / observable, None
when nothing was observable), `score_outputs` (the same with the survivors that differ in FA
records alone left out), the baseline, and one entry per mutant. It and each survivor's
reproducer are written atomically under the output directory.
"""
from __future__ import annotations

import difflib
import hashlib
import os

from fuzz.mutate.points import Mutant, apply

REPORT_VERSION = 1
STATUSES = ("caught", "silent", "unobserved", "stillborn", "error")


def line_diff(source: str, m: Mutant) -> str:
    """The unified diff of the mutant against the original file (one line of context)."""
    new = apply(source, m)
    return "".join(difflib.unified_diff(source.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"a/{m.file}", f"b/{m.file}", n=1))


def counts(rows: list[dict]) -> dict:
    c = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    c["caught_by_timeout"] = sum(r["status"] == "caught" and str(r["caught_by"]).startswith("timeout") for r in rows)
    # Survivors seen only in the second digest: FA records (reference engine) or schedule (vLLM).
    c["silent_fa_only"] = sum(r["status"] == "silent" and r["observed_by"] not in (None, "outputs") for r in rows)
    c["observable"] = c["caught"] + c["silent"]
    c["mutants"] = len(rows)
    return c


def _survivor(plan, base: dict, m: Mutant, row: dict, diff: str) -> dict:
    """The first Case the silent mutant changed, as a reproducer (`llmfuzz replay` runs it)."""
    from fuzz.cases.case import Case
    from fuzz.campaign.reproduce import write_reproducer

    i = (row["differing_cases"] or row["fa_only_cases"])[0]
    case = Case.from_dict(base["cases"][i])
    what = {"outputs": "outputs", "schedule": "schedule (engine steps; not its outputs)"}.get(
        row["observed_by"], "FA call records (not its outputs)")
    msg = (f"mutant {m.file}:{m.line} {m.operator} ({m.original} -> {m.mutated}) changes this Case's "
           f"{what} bitwise, and the campaign passed it")
    # A directory per mutant: two survivors may differ first on the same Case (same file name).
    where = os.path.join(plan.out_dir, "survivors", hashlib.sha256(m.id.encode()).hexdigest()[:12])
    path = write_reproducer(where, case, "mutation_survivor", msg,
                            meta={"mutant": m.to_dict(), "mutant_diff": diff})
    # The engine raised on that Case (an invariant, a crash): a check that sees the mutant
    # once a Case like this is drawn; None: no check of the engine's own saw it.
    return {"case_index": i, "case": base["cases"][i], "reproducer": path,
            "seen_by_engine_check": row["raised_on_cases"]}


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def build(plan, base: dict, rows: list[tuple[Mutant, dict]], wall_s: float) -> dict:
    entries = []
    for m, row in rows:
        diff = line_diff(plan.source.read(m.file), m)
        e = {**m.to_dict(), "id": m.id, "diff": diff, **row}
        if row["status"] == "silent":
            e["survivor"] = _survivor(plan, base, m, row, diff)
        entries.append(e)
    c = counts([r for _, r in rows])
    camp = base["campaign"]
    return {
        "version": REPORT_VERSION, "target": plan.source.target, "source_root": plan.source.root,
        "paths": plan.files, "seed": plan.seed, "n": plan.n, "budget_per_mutant_s": plan.budget_s,
        "timeout_s": plan.timeout_s, "jobs": plan.jobs, "num_cases": len(base["cases"]),
        "points_total": plan.points_total, "points_by_operator": plan.by_operator,
        "baseline": {"green": not camp["failures"], "cases_seconds": base["cases_seconds"],
                     "campaign_examples": camp["examples"], "campaign_failures": camp["failures"],
                     # vLLM's only: the first engine start, the campaign's configs
                     **{k: v for k, v in (("startup_seconds", base.get("startup_seconds")),
                                          ("campaign_configs", camp.get("configs"))) if v is not None}},
        "counts": c, "score": _ratio(c["caught"], c["observable"]),
        "score_outputs": _ratio(c["caught"], c["observable"] - c["silent_fa_only"]),
        "wall_s": round(wall_s, 1), "mutants": entries,
    }


def text(doc: dict) -> str:
    c = doc["counts"]
    def fmt(x):
        return "n/a" if x is None else f"{x:.2f}"
    lines = [f"mutation score {fmt(doc['score'])} = caught {c['caught']} / observable {c['observable']} "
             f"(outputs only: {fmt(doc['score_outputs'])}, {c['silent_fa_only']} survivor(s) differ in "
             f"{'the schedule' if doc['target'] == 'vllm' else 'FA records'} alone)",
             f"  mutants {c['mutants']} (of {doc['points_total']} points in {len(doc['paths'])} files, seed "
             f"{doc['seed']}): caught {c['caught']} (by timeout {c['caught_by_timeout']}), silent {c['silent']}, "
             f"unobserved {c['unobserved']}, stillborn {c['stillborn']}, error {c['error']}",
             f"  campaign {doc['budget_per_mutant_s']:g}s per mutant, {doc['num_cases']} fixed Cases compared "
             f"bitwise; wall {doc['wall_s']:.0f}s"]
    if not doc["baseline"]["green"]:
        lines.append("  WARNING: the unmutated engine's campaign failed too: every mutant counts as caught "
                     "by that failure; fix it first")
    for e in doc["mutants"]:
        how = f" ({e['caught_by']})" if e.get("caught_by") else ""
        lines.append(f"{e['status']:>10}  {e['file']}:{e['line']} {e['operator']}: {e['original']} -> "
                     f"{e['mutated']}{how}")
        if e["status"] == "silent":
            s = e["survivor"]
            lines.append(f"            {e['observed_by']} differ on Case {s['case_index']}: {s['reproducer']}")
            if s["seen_by_engine_check"]:
                lines.append(f"            the engine raised on it: {s['seen_by_engine_check'][:150]}")
            lines += ["            " + d for d in e["diff"].rstrip("\n").splitlines()]
    return "\n".join(lines)
