"""What a vLLM campaign visits: its configs (`campaign_configs`) and what they cover
(`plan_report`, printed by `format_plan`).

The configs are a covering array over the config dimensions (fuzz.targets.vllm.covering:
layout, compile mode, n-gram k, token budget, block size, prefix caching, async scheduling,
dtype, max_model_len, KV-cache size): every pair of values within the first few configs,
cheapest first, then triples; as many as the budget affords (each its estimated start-up
plus a stretch of examples). Each is visited once with one engine (a *cell*). The plan and
the pairs it covers are printed before the campaign and kept in the summary. Nothing here
imports torch or vLLM at import time.
"""
from __future__ import annotations

import itertools

from fuzz.errors import BadInput


def campaign_configs(*, budget_s: float, seed: int = 0, count: int | None = None, layouts: tuple[str, ...] = (),
                     modes: tuple[str, ...] = (), cells: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                     include_known: bool = False) -> list:
    """The (EngineConfig, VLLMOptions) a campaign visits, in order: the named `cells`, else
    the first `count` (default: as many as the budget affords, `fit_budget`) of the covering
    plan over the layouts and modes given (none: all), minus names starting with an `exclude`
    prefix, and, unless `include_known`, the rows a known crash kills. BadInput names the
    option at fault."""
    from fuzz.targets.vllm.configs import VLLM_LAYOUTS, VLLM_MODES, parse_cell_name, plan_rows, row_config
    from fuzz.targets.vllm.covering import budget_plan

    if cells:
        chosen = []
        for n in cells:
            try:
                chosen.append(parse_cell_name(n))
            except ValueError as e:
                raise BadInput(f"--cells: {e}") from None
    else:
        rows, k = plan_rows(seed, layouts or VLLM_LAYOUTS, modes or VLLM_MODES, tuple(exclude),
                            include_known=include_known)
        if count is not None and count < 1:
            raise BadInput(f"--configs: {count} is not a positive number of configs")
        chosen = [row_config(r) for r in (rows[:count] if count is not None else budget_plan(rows, k, budget_s))]
    if not chosen:
        raise BadInput("no vLLM config left to visit (check --cells / --exclude)")
    return chosen


def plan_report(configs: list, layouts: tuple[str, ...] = (), modes: tuple[str, ...] = (),
                include_known: bool = False) -> dict:
    """What a campaign's plan covers: its configs with their estimated start-up, and the
    pairs and triples of dimension values covered, of those a config valid by design can have,
    over the layouts and modes given (none: all). The pairs not covered are listed; those only
    configs killed by a known crash have (unless `include_known`) are `pairs_excluded`, each
    with the crash's reproducer: they count as not covered."""
    from fuzz.targets.vllm.configs import VLLM_LAYOUTS, VLLM_MODES, cell_name, config_row, plan_dimensions
    from fuzz.targets.vllm.covering import coverage, required, startup_cost, valid
    from fuzz.targets.vllm.known import KNOWN_CRASHES

    dims = plan_dimensions(layouts or VLLM_LAYOUTS, modes or VLLM_MODES)
    rows = [config_row(c, o) for c, o in configs]
    rows = [r for r in rows if r is not None and all(r[d] in dims[d] for d in dims) and valid(r)]
    pairs, pairs_all = coverage(rows, dims, 2)
    triples, triples_all = coverage(rows, dims, 3)
    first = next((i + 1 for i in range(len(rows)) if coverage(rows[:i + 1], dims, 2)[0] == pairs_all), None)
    missing = required(dims, 2) - {p for r in rows for p in _pairs(r)}
    excluded = {} if include_known else _excluded_pairs(missing, dims, KNOWN_CRASHES)
    return {"configs": [{"name": cell_name(c, o), "est_startup_s": startup_cost(r) if r else None}
                        for (c, o), r in zip(configs, [config_row(c, o) for c, o in configs])],
            "dimensions": {k: list(v) for k, v in dims.items()}, "pairs_covered": pairs, "pairs_total": pairs_all,
            "all_pairs_within_first": first, "triples_covered": triples, "triples_total": triples_all,
            "pairs_missing": sorted(_pair_name(p) for p in missing - set(excluded)),  # every one: none hidden
            "pairs_excluded": {_pair_name(p): why for p, why in sorted(excluded.items())}}


def _excluded_pairs(missing: set, dims: dict, crashes) -> dict:
    """The missing pairs every config valid by design having them is killed by a known crash,
    each with the crash that kills them all (else every crash that kills some)."""
    from fuzz.targets.vllm.covering import _all_rows

    out = {}
    for p in missing:
        (a, v), (b, w) = p
        killers = [{k.short for k in crashes if k.kills(r)} for r in _all_rows(dims) if r[a] == v and r[b] == w]
        if killers and all(killers):
            out[p] = "known crash " + ", ".join(sorted(set.intersection(*killers) or set.union(*killers)))
    return out


def _pair_name(p) -> str:
    (a, v), (b, w) = p
    return f"{a}={v} x {b}={w}"


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(list(row), 2)}


def format_plan(report: dict) -> str:
    excluded = report.get("pairs_excluded") or {}
    why = {r: sum(1 for v in excluded.values() if v == r) for r in sorted(set(excluded.values()))}
    lines = [f"plan: {len(report['configs'])} configs; pairs covered {report['pairs_covered']}/{report['pairs_total']}"
             + (f", {len(excluded)} excluded: " + "; ".join(f"{r} ({n})" for r, n in why.items()) if excluded else "")
             + (f" (all within the first {report['all_pairs_within_first']})" if report["all_pairs_within_first"] else "")
             + f"; triples {report['triples_covered']}/{report['triples_total']}"]
    lines += [f"  {i + 1:2d}. {c['name']}  (start-up ~{c['est_startup_s']:.0f}s)" if c["est_startup_s"] is not None
              else f"  {i + 1:2d}. {c['name']}" for i, c in enumerate(report["configs"])]
    if excluded:
        lines.append("  pairs excluded (--include-known plans them): "
                     + "; ".join(f"{p} ({why})" for p, why in list(excluded.items())[:12])
                     + (" ..." if len(excluded) > 12 else ""))
    if report["pairs_missing"]:
        lines.append("  pairs not covered: " + "; ".join(report["pairs_missing"][:12])
                     + (" ..." if len(report["pairs_missing"]) > 12 else ""))
    return "\n".join(lines)
