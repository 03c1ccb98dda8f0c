"""`llmfuzz run --target vllm` (alias `llmfuzz vllm run`): what a vLLM campaign visits, and
the campaign, minimizer and writer of fuzz.campaign / fuzz.shrink / fuzz.reproduce pointed
at the vLLM target (`fuzz.targets.vllm_fuzz.VLLMFuzzTarget`).

The configs are a covering array over the config dimensions (fuzz.targets.vllm_covering:
layout, compile mode, n-gram k, token budget, block size, prefix caching, async scheduling,
dtype, max_model_len, KV-cache size): every pair of values within the first few configs,
cheapest first, then triples; as many as the budget affords (each its estimated start-up
plus a stretch of examples). Each is visited once with one engine (a *cell*). The plan and
the pairs it covers are printed before the campaign and kept in the summary. The commands
are in `fuzz.targets.vllm_cli`. Nothing here imports torch or vLLM at import time.
"""
from __future__ import annotations


from fuzz.cli_common import BadInput



def auto_config_count(budget_s: float, seed: int = 0) -> int:
    """How many covering-plan configs `budget_s` affords (fuzz.targets.vllm_covering.budget_plan)."""
    from fuzz.targets.vllm_configs import plan_rows
    from fuzz.targets.vllm_covering import budget_plan

    rows, k = plan_rows(seed)
    return len(budget_plan(rows, k, budget_s))


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse_modes(text: str | None) -> tuple[str, ...]:
    """'eager,graph' -> ('eager', 'compiled'): `graph` (the reference engine's word) and
    `compiled` both mean vLLM without enforce_eager (torch.compile on CPU)."""
    out = []
    for m in _split(text):
        m = {"graph": "compiled"}.get(m, m)
        if m not in ("eager", "compiled"):
            raise BadInput(f"--modes: {m!r} is not one of eager, compiled (or graph)")
        if m not in out:
            out.append(m)
    return tuple(out)


def parse_layouts(text: str | None) -> tuple[str, ...]:
    """The reference engine's --layouts parser (fuzz.cli), checked against the vLLM model."""
    from fuzz.cli_common import parse_layouts as _parse_layouts
    from fuzz.targets.vllm_target import VLLM_MODEL

    if not _split(text):
        return ()
    try:
        return tuple(dict.fromkeys(_parse_layouts(text, VLLM_MODEL)))
    except BadInput as e:
        raise BadInput(f"--layouts: {e}") from None


def campaign_configs(*, budget_s: float, seed: int = 0, count: int | None = None, layouts: str | None = None,
                     modes: str | None = None, cells: str | None = None, exclude: str | None = None) -> list:
    """The (EngineConfig, VLLMOptions) a campaign visits, in order: the named `cells`, else
    the first `count` (default: as many as the budget affords, `fit_budget`) of the covering
    plan over the layouts and modes given, minus names starting with an `exclude` prefix."""
    from fuzz.targets.vllm_configs import VLLM_LAYOUTS, VLLM_MODES
    from fuzz.targets.vllm_target import parse_cell_name

    if cells:
        chosen = []
        for n in _split(cells):
            try:
                chosen.append(parse_cell_name(n))
            except ValueError as e:
                raise BadInput(f"--cells: {e}") from None
    else:
        lay = parse_layouts(layouts) or VLLM_LAYOUTS
        mod = parse_modes(modes) or VLLM_MODES
        from fuzz.targets.vllm_configs import plan_rows, row_config
        from fuzz.targets.vllm_covering import budget_plan

        rows, k = plan_rows(seed, lay, mod, tuple(_split(exclude)))
        if count is not None and count < 1:
            raise BadInput(f"--configs: {count} is not a positive number of configs")
        chosen = [row_config(r) for r in (rows[:count] if count is not None else budget_plan(rows, k, budget_s))]
    if not chosen:
        raise BadInput("no vLLM config left to visit (check --cells / --exclude)")
    return chosen


def plan_report(configs: list, seed: int = 0, layouts: str | None = None, modes: str | None = None) -> dict:
    """What a campaign's plan covers: its configs with their estimated start-up, and the
    pairs and triples of dimension values covered (of those a valid config can have)."""
    from fuzz.targets.vllm_configs import VLLM_LAYOUTS, VLLM_MODES, cell_name, config_row, plan_dimensions
    from fuzz.targets.vllm_covering import coverage, required, startup_cost, valid

    dims = plan_dimensions(parse_layouts(layouts) or VLLM_LAYOUTS, parse_modes(modes) or VLLM_MODES)
    rows = [config_row(c, o) for c, o in configs]
    rows = [r for r in rows if r is not None and all(r[d] in dims[d] for d in dims) and valid(r, known=False)]
    pairs, pairs_all = coverage(rows, dims, 2)
    triples, triples_all = coverage(rows, dims, 3)
    first = next((i + 1 for i in range(len(rows)) if coverage(rows[:i + 1], dims, 2)[0] == pairs_all), None)
    missing = sorted(f"{a[0]}={a[1]} x {b[0]}={b[1]}" for a, b in required(dims, 2)
                     - {p for r in rows for p in _pairs(r)})
    return {"configs": [{"name": cell_name(c, o), "est_startup_s": startup_cost(r) if r else None}
                        for (c, o), r in zip(configs, [config_row(c, o) for c, o in configs])],
            "dimensions": {k: list(v) for k, v in dims.items()}, "pairs_covered": pairs, "pairs_total": pairs_all,
            "all_pairs_within_first": first, "triples_covered": triples, "triples_total": triples_all,
            "pairs_missing": missing[:50]}


def _pairs(row: dict) -> set:
    import itertools

    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(list(row), 2)}


def format_plan(report: dict) -> str:
    lines = [f"plan: {len(report['configs'])} configs; pairs covered {report['pairs_covered']}/{report['pairs_total']}"
             + (f" (all within the first {report['all_pairs_within_first']})" if report["all_pairs_within_first"] else "")
             + f"; triples {report['triples_covered']}/{report['triples_total']}"]
    lines += [f"  {i + 1:2d}. {c['name']}  (start-up ~{c['est_startup_s']:.0f}s)" if c["est_startup_s"] is not None
              else f"  {i + 1:2d}. {c['name']}" for i, c in enumerate(report["configs"])]
    if report["pairs_missing"]:
        lines.append("  pairs not covered: " + "; ".join(report["pairs_missing"][:12])
                     + (" ..." if len(report["pairs_missing"]) > 12 else ""))
    return "\n".join(lines)


KNOWN_FILE = "fuzz/targets/vllm_known_failures.txt"
REPRODUCERS = "reproducers/vllm"


def load_known(path: str | None) -> set[str]:
    if not path:
        return set()
    with open(path) as f:
        return {ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()}


def default_known(root: str | None = None) -> set[str]:
    """`--known`'s default: the signatures of the committed vLLM reproducers
    (reproducers/vllm/**/*.json, their "signature") and fuzz/targets/vllm_known_failures.txt,
    both relative to the repository (`root`, default this checkout). A known crash then costs
    one start-up and one example, not a shrink."""
    import glob
    import json
    import os

    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    known = load_known(os.path.join(root, KNOWN_FILE)) if os.path.exists(os.path.join(root, KNOWN_FILE)) else set()
    for p in sorted(glob.glob(os.path.join(root, REPRODUCERS, "**", "*.json"), recursive=True)):
        try:
            with open(p) as f:
                sig = json.load(f).get("signature")
        except (OSError, ValueError, AttributeError):
            continue
        if sig:
            known.add(sig)
    return known


# -- the shared campaign, minimizer and writer, on vLLM -------------------------------------------

HARD_SLACK = 0.03  # no engine start or run goes past budget x (1 + this): the 5 % promise, with shut-down


def VLLMCampaign(cells, *, budget_s: float, out_dir: str = "reproducers/vllm", seed: int = 0,  # noqa: N802
                 known: set[str] | None = None, max_requests: int = 8, chunk: int = 10, shrink_s: float | None = None,
                 min_cell_s: float = 10.0, progress: bool = True, checker=None, shrink_configs: bool = True,
                 plan: dict | None = None):
    """fuzz.campaign.Campaign over the vLLM target: `cells` are (EngineConfig, VLLMOptions)
    pairs, each visited once with one engine. Time: shrinking happens within the budget
    (`shrink_s` per failure, default min(300 s, budget/5)); the shrink phase after it gets
    2 % of the budget; and the target's hard deadline (budget x 1.03) cuts any start or run
    that would go past it. A cell runs for its share of the time left, however long its first
    example took, and at least `min_cell_s` once started. The campaign closes the vLLM engine
    it starts unless `checker` (the caller's) was given."""
    from fuzz.targets.vllm_fuzz import VLLMFuzzTarget

    target = VLLMFuzzTarget(cells, checker=checker, known=known, max_requests=max_requests,
                            shrink_configs=shrink_configs)
    target.plan = plan
    shrink_s = min(300.0, budget_s / 5) if shrink_s is None else shrink_s
    camp = _campaign_class()(target=target, budget_s=budget_s, out_dir=out_dir, seed=seed, chunk=chunk,
                             progress=progress, shrink_s=shrink_s, min_cell_s=min_cell_s,
                             shrink_budget_s=0.02 * budget_s)
    camp.owns_target = checker is None
    return camp


def _campaign_class():
    """fuzz.campaign.Campaign with the vLLM target's hard deadline set when the clock starts."""
    import time

    from fuzz.campaign import Campaign

    class VLLMCampaignRun(Campaign):
        def run(self):
            self.target.deadline = time.monotonic() + self.budget_s * (1 + HARD_SLACK)
            return super().run()

    return VLLMCampaignRun


def minimize_vllm(violation, checker, opts=None, deadline: float | None = None, max_checks: int = 60,
                  configs: bool = True):
    """fuzz.shrink.minimize with the vLLM target's candidates (`VLLMFuzzTarget.simpler`), a
    candidate kept when it fails the same way (fuzz.properties.same_failure). Returns (smallest
    violation, its VLLMOptions, checks run)."""
    from fuzz.shrink import Shrinker, minimize
    from fuzz.targets.vllm_fuzz import VLLMFuzzTarget
    from fuzz.targets.vllm_target import VLLMOptions

    target = VLLMFuzzTarget([], checker=checker, shrink_configs=configs)
    sh = Shrinker(violation, target.check)
    case = violation.case if opts is None else opts.on(violation.case)
    _, checks = minimize(case, sh.still_fails, max_checks, deadline, target.simpler)
    return sh.best, VLLMOptions.of(sh.best.case), checks


def write_vllm_reproducer(out_dir: str, violation, opts=None, target=None) -> str:
    """fuzz.reproduce.write_reproducer for a vLLM failure, with the vLLM target's metadata
    (`target`: the VLLMTarget whose version is recorded)."""
    from fuzz.reproduce import write_reproducer
    from fuzz.targets.vllm_fuzz import reproducer_meta

    v, case = violation, violation.case if opts is None else opts.on(violation.case)
    return write_reproducer(out_dir, case, v.property, v.message, v.error_ratio, v.oracle, v.second_opinion,
                            reproducer_meta(case, v, getattr(target, "vllm_version", None)))
