"""The summary of a vLLM campaign (`--json` and the table): per config, with the covering
plan and the pairs it covered, the pairs actually exercised (by configs that ran a passing
example), every engine start and start-up's share of the wall time, duplicate signatures,
per-config n-gram draft counts.
"""
from __future__ import annotations

import itertools


def _failure_json(f) -> dict:
    return {"property": f.property, "message": f.message[:500], "signature": f.meta.get("signature"),
            "config": f.meta.get("row"), "case": f.case_desc, "path": f.path, "size": f.size,
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
    """fuzz.campaign.summary.Summary of a vLLM campaign, per config (docs/vllm.md, `--json`), with the
    plan and what it covers, every engine start and start-up's share of the wall time."""
    cells = {k[0]: c for k, c in s.cells.items()}
    t = target._checker.runner if target._checker is not None else None
    starts = list(t.starts) if t is not None else []
    startup = sum(x["seconds"] for x in starts)
    extra = {"plan": target.plan, "engine_starts": starts,
             "startup_s_total": round(startup, 1),
             "startup_fraction": round(startup / s.seconds, 3) if s.seconds else None,
             "configs_visited": sum(1 for c in cells.values() if c.examples or c.notes.get("engine_starts")),
             "duplicate_signatures": list(target.duplicates), "known_signatures": sorted(target.known),
             "unchecked_for_time": target.unchecked,
             "pairs_exercised": _pairs_exercised(cells, target.plan),
             "pairs_excluded": (target.plan or {}).get("pairs_excluded", {}),
             "known_crashes": target.known_crashes, "known_crash_replay_s": target.known_crash_replay_s,
             "startup_ahead_s_total": round(sum(x.get("ahead_s", 0.0) for x in starts), 1),
             "configs_not_reached": not_reached(s),
             **({"shard": str(s.shard)} if s.shard is not None else {})}
    return {**_summary_core(s, target, cells), **extra}


def _pairs_exercised(cells: dict, plan: dict | None) -> dict | None:
    """The plan's pairs covered by cells that actually ran a passing example (a cell that
    crashed on its first example, or never started, covers its pairs on paper only)."""
    if not plan:
        return None
    from fuzz.targets.vllm.configs import config_row, parse_cell_name

    dims = plan["dimensions"]
    need = {((a, v), (b, w)) for a, b in itertools.combinations(list(dims), 2) for v in dims[a] for w in dims[b]}
    got = set()
    for name, c in cells.items():
        if c.examples - c.failures - len(c.known) <= 0:
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


def not_reached(s) -> list[str]:
    """The planned configs the campaign never started an engine for nor ran an example on."""
    ran = {k[0] for k, c in s.cells.items() if c.examples or c.notes.get("engine_starts")}
    return [n for n in s.planned if n not in ran]


def reach(notes: dict) -> str:
    """What a cell's Cases exercised, in a few words: the prefix cache's hit rate (with caching
    on), the Cases whose drafts were accepted 2 or more in a step (with n-gram drafting), the
    requests sampled and aborted, and the seeded random tokens checked against vLLM's draw."""
    mix, drafts, out = notes.get("mix") or {}, notes.get("drafts") or {}, []
    if notes.get("llm_kwargs", {}).get("enable_prefix_caching"):
        out.append(f"hit {mix.get('hit_rate', 0.0):.2f}")
    if drafts:
        out.append(f"accept>=2 {drafts.get('cases_accepting_2plus', 0)}/{drafts.get('cases', 0)}")
    if mix:
        out.append(f"sampled {mix.get('sampled', 0)}/{mix.get('requests', 0)}, aborted {mix.get('aborted', 0)}")
    if mix.get("draws_checked") or mix.get("draws_near_tie"):
        out.append(f"seeded draws {mix.get('draws_checked', 0)} checked, {mix.get('draws_near_tie', 0)} near ties")
    return ", ".join(out)


def summary_table(s, target=None) -> str:
    rows = [f"{'cell':<44}{'examples':>9}{'ex/s':>7}{'starts':>7}{'start s':>8}{'fail':>5}{'known':>6}  note"]
    for (name, _), c in s.cells.items():
        rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
        rows.append(f"{name:<44}{c.examples:>9}{rate:>7}{c.notes.get('engine_starts', 0):>7}"
                    f"{c.notes.get('startup_s', 0.0):>8.1f}{c.failures:>5}{len(c.known):>6}  "
                    + " · ".join(x for x in (reach(c.notes), c.stopped) if x))
    rows += [f"not reached: {n} (planned; the budget ran out first)" for n in not_reached(s)]
    plan = (target.plan if target is not None else None) or {}
    if plan.get("pairs_excluded"):
        rows.append(f"pairs excluded: {len(plan['pairs_excluded'])} of {plan['pairs_total']} (not covered): "
                    + "; ".join(f"{p} ({why})" for p, why in list(plan["pairs_excluded"].items())[:6])
                    + (" ..." if len(plan["pairs_excluded"]) > 6 else ""))
    for k in (target.known_crashes if target is not None else []):
        rows.append(f"known crash {k['reproducer']}: {k['state']}" + (f" ({k['detail']})" if k.get("detail") else "")
                    + f"  [{k['signature']}]" + (f"; not drawn: {k['excluded']}" if k.get("excluded") else ""))
    return "\n".join(rows)
