"""The summary of a vLLM campaign (`--json` and the table): per config, as vLLM campaigns
have reported it, plus what issue 25 added: the covering plan and the pairs it covered, the
pairs actually exercised (by configs that ran a passing example), every engine start and
start-up's share of the wall time, duplicate signatures, per-config n-gram draft counts.
"""
from __future__ import annotations

import itertools

# -- the campaign's Summary, as vLLM campaigns have reported it ---------------------------------

def _failure_json(f) -> dict:
    return {"property": f.property, "message": f.message[:500], "signature": f.meta.get("signature"),
            "config": f.meta.get("row"), "case": f.case_desc, "path": f.path,
            "shrink_checks": f.meta.get("shrink_checks", 0)}


# What each row's notes hold (Target.record, cell_done), as a cell with no examples has them.
NOTES = {"engine_starts": 0, "startup_s": 0.0, "max_lp_error_vs_reference": 0.0, "near_tie_divergences": 0,
         "max_lp_error_vs_transformers": 0.0, "prompt_logprob_positions_checked": 0, "llm_kwargs": {}}


def _cell_json(name: str, c, failures: list) -> dict:
    return {"examples": c.examples, "seconds": round(c.seconds, 2),
            "examples_per_s": round(c.examples / c.seconds, 3) if c.seconds else None,
            "failures": [_failure_json(f) for f in failures if f.cell == name], "known": c.known,
            "unsupported": c.unsupported, "stopped": c.stopped, "repeats": c.repeats, **NOTES, **c.notes}


def summary_json(s, target) -> dict:
    """fuzz.campaign.Summary of a vLLM campaign, per config (docs/vllm.md, `--json`), with the
    plan and what it covers, every engine start and start-up's share of the wall time."""
    cells = {k[0]: c for k, c in s.cells.items()}
    t = target._checker.target if target._checker is not None else None
    starts = list(t.starts) if t is not None else []
    startup = sum(x["seconds"] for x in starts)
    extra = {"plan": getattr(target, "plan", None), "engine_starts": starts,
             "startup_s_total": round(startup, 1),
             "startup_fraction": round(startup / s.seconds, 3) if s.seconds else None,
             "configs_visited": sum(1 for c in cells.values() if c.examples or c.notes.get("engine_starts")),
             "duplicate_signatures": list(target.duplicates), "known_signatures": sorted(target.known),
             "unchecked_for_time": target.unchecked,
             "pairs_exercised": _pairs_exercised(cells, target.plan)}
    return {**_summary_core(s, target, cells), **extra}


def _pairs_exercised(cells: dict, plan: dict | None) -> dict | None:
    """The plan's pairs covered by cells that actually ran a passing example (a cell that
    crashed on its first example, or never started, covers its pairs on paper only)."""
    if not plan:
        return None
    from fuzz.targets.vllm_configs import config_row
    from fuzz.targets.vllm_configs import parse_cell_name

    dims = plan["dimensions"]
    need = {((a, v), (b, w)) for a, b in itertools.combinations(list(dims), 2) for v in dims[a] for w in dims[b]}
    got = set()
    for name, c in cells.items():
        if c.examples - c.failures - len(c.known) - c.notes.get("unchecked", 0) <= 0:
            continue
        try:
            row = config_row(*parse_cell_name(name))
        except ValueError:
            continue
        if row is not None:
            got |= {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(list(dims), 2)}
    return {"covered": len(got & need), "of_planned": plan["pairs_covered"]}


def _summary_core(s, target, cells) -> dict:
    return {"target": "vllm", "vllm_version": target.vllm_version, "budget_s": s.budget_s,
            "seed": s.seed, "seconds": round(s.seconds, 1), "oracles": target.oracles(), "planned_configs": s.planned,
            "examples": s.examples, "failures": [_failure_json(f) for f in s.failures],
            "known": [k for c in cells.values() for k in c.known],
            "unsupported": {n: c.unsupported for n, c in cells.items() if c.unsupported},
            "per_cell": {n: _cell_json(n, c, s.failures) for n, c in cells.items()},
            "interrupted": s.interrupted, "write_errors": s.write_errors}


def summary_table(s) -> str:
    rows = [f"{'cell':<44}{'examples':>9}{'ex/s':>7}{'starts':>7}{'start s':>8}{'fail':>5}{'known':>6}  note"]
    for (name, _), c in s.cells.items():
        rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
        rows.append(f"{name:<44}{c.examples:>9}{rate:>7}{c.notes.get('engine_starts', 0):>7}"
                    f"{c.notes.get('startup_s', 0.0):>8.1f}{c.failures:>5}{len(c.known):>6}  {c.stopped}")
    return "\n".join(rows)
