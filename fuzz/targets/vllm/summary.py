"""The summary of a vLLM campaign (`--json` and the table): per config, with the covering
plan and the pairs it covered, the pairs actually exercised, every engine start and
start-up's share of the wall time, duplicate signatures, per-config n-gram draft counts,
slow steps and compile waits (stalls that were not hangs: fuzz.targets.vllm.runner).

Honest coverage: a config counts as visited, and its pairs as exercised, only by passing
examples that reached what the config is about (`needs`): drafts proposed where n-gram
speculation is on, a prefix-cache hit where caching is on, and for every config more than
the one-request, one-token minimum (`work`). Each example's features are counted per config
(`reached`: "drafts+hits+work": 3, ...); the pairs not exercised are listed, every one.
"""
from __future__ import annotations

import itertools


def _failure_json(f) -> dict:
    return {"property": f.property, "message": f.message[:500], "signature": f.meta.get("signature"),
            "config": f.meta.get("row"), "case": f.case_desc, "path": f.path, "size": f.size,
            "shrink_checks": f.meta.get("shrink_checks", 0)}


# What each row's notes hold (Target.record, cell_done), as a cell with no examples has them.
NOTES = {"engine_starts": 0, "startup_s": 0.0, "max_lp_error_vs_reference": 0.0, "near_tie_divergences": 0,
         "max_lp_error_vs_transformers": 0.0, "prompt_logprob_positions_checked": 0, "llm_kwargs": {},
         "slow_steps": 0, "compile_waits": 0}


def needs(dim: str, value) -> frozenset:
    """What an example must reach to exercise a dimension's value (fuzz.targets.vllm.checker.reached)."""
    if dim == "spec" and value:
        return frozenset({"work", "drafts"})
    if dim == "prefix" and value:
        return frozenset({"work", "hits"})
    return frozenset({"work"})


def _row(name: str) -> dict | None:
    from fuzz.targets.vllm.configs import config_row, parse_cell_name

    try:
        return config_row(*parse_cell_name(name))
    except ValueError:
        return None


def config_needs(name: str) -> frozenset:
    """Everything a config's examples must reach for it to count as visited."""
    row = _row(name)
    return frozenset().union(*(needs(d, v) for d, v in row.items())) if row else frozenset({"work"})


def _reached(c) -> list[frozenset] | None:
    """The feature sets a cell's passing examples reached (None: a cell known by counts only)."""
    notes = getattr(c, "notes", None)
    if notes is None:
        return None
    return [frozenset(k.split("+")) - {"none"} for k, n in (notes.get("reached") or {}).items() if n]


def config_reach(name: str, c) -> dict:
    """Per config: passing examples with each feature, what it needs, whether it was reached."""
    counts: dict[str, int] = {}
    for key, n in (c.notes.get("reached") or {}).items():
        for f in key.split("+"):
            if f != "none":
                counts[f] = counts.get(f, 0) + n
    need = config_needs(name)
    ok = any(need <= got for got in _reached(c) or [])
    # Missing: features no example reached, or, each reached apart, all of them in one example.
    missing = [] if ok else sorted(need - set(counts)) or ["+".join(sorted(need)) + " in one example"]
    return {"examples_passing": sum((c.notes.get("reached") or {}).values()), **counts, "needs": sorted(need),
            "reached": ok, "missing": missing}


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
             "configs_visited": sum(1 for n, c in cells.items() if config_reach(n, c)["reached"]),
             "configs_started": sum(1 for c in cells.values() if c.examples or c.notes.get("engine_starts")),
             "config_reach": {n: config_reach(n, c) for n, c in cells.items()},
             "slow_steps": list(getattr(t, "slow_steps", [])), "compile_waits": list(getattr(t, "compile_waits", [])),
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
    """The plan's pairs exercised: by a passing example of a config with both values that
    reached both values' features (`needs`), with every pair not exercised listed. Cells known
    only by their counts (no notes: a merge of shards' summaries) count by a passing example,
    as before features were kept, and list nothing."""
    if not plan or "dimensions" not in plan:
        return None
    dims = plan["dimensions"]
    need = {((a, v), (b, w)) for a, b in itertools.combinations(list(dims), 2) for v in dims[a] for w in dims[b]}
    def pairs_of(row: dict) -> set:
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(list(dims), 2)}

    got, by_counts = set(), False
    # What the plan covers on paper: its configs', and those of the cells that ran.
    planned = set().union(*(pairs_of(r) for r in (_row(c["name"]) for c in plan.get("configs") or []) if r))
    for name, c in cells.items():
        row = _row(name)
        if row is None:
            continue
        pairs = pairs_of(row)
        planned |= pairs
        reached = _reached(c)
        if reached is None:
            by_counts = True
            if c.examples - c.failures - len(c.known) > 0:
                got |= pairs
            continue
        got |= {p for p in pairs if any(needs(*p[0]) | needs(*p[1]) <= r for r in reached)}
    out = {"covered": len(got & need), "of_planned": plan["pairs_covered"]}
    if not by_counts:
        missing = sorted(f"{a}={v} x {b}={w}" for (a, v), (b, w) in (planned & need) - got)
        out.update(not_exercised=len(missing), pairs_not_exercised=missing)
    return out


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
    if notes.get("slow_steps") or notes.get("compile_waits"):
        out.append(f"slow steps {notes.get('slow_steps', 0)}, compile waits {notes.get('compile_waits', 0)}")
    if notes.get("llm_kwargs", {}).get("enable_prefix_caching"):
        out.append(f"hit {mix.get('hit_rate', 0.0):.2f}")
        if mix.get("cache_judged"):
            out.append(f"hits judged {mix['cache_judged']} ({mix.get('cache_exact', 0)} exact)")
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
    if target is not None and target.plan:
        reach_of = {k[0]: config_reach(k[0], c) for k, c in s.cells.items()}
        short = [f"{n} ({', '.join(r['missing']) or 'no passing example'})" for n, r in reach_of.items()
                 if not r["reached"]]
        rows.append(f"configs visited (an example reached their features): {len(reach_of) - len(short)} of "
                    f"{len(s.planned) or len(reach_of)} planned" + (f"; started, not: {'; '.join(short)}" if short else ""))
        pairs = _pairs_exercised({k[0]: c for k, c in s.cells.items()}, target.plan)
        if pairs:
            rows.append(f"pairs exercised: {pairs['covered']} of {pairs['of_planned']} planned"
                        + (f"; not exercised ({pairs['not_exercised']}): " + "; ".join(pairs["pairs_not_exercised"])
                           if pairs.get("not_exercised") else ""))
    plan = (target.plan if target is not None else None) or {}
    if plan.get("pairs_excluded"):
        rows.append(f"pairs excluded: {len(plan['pairs_excluded'])} of {plan['pairs_total']} (not covered): "
                    + "; ".join(f"{p} ({why})" for p, why in list(plan["pairs_excluded"].items())[:6])
                    + (" ..." if len(plan["pairs_excluded"]) > 6 else ""))
    for k in (target.known_crashes if target is not None else []):
        rows.append(f"known crash {k['reproducer']}: {k['state']}" + (f" ({k['detail']})" if k.get("detail") else "")
                    + f"  [{k['signature']}]" + (f"; not drawn: {k['excluded']}" if k.get("excluded") else ""))
    return "\n".join(rows)
