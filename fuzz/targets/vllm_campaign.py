"""`llmfuzz run --target vllm` (alias `llmfuzz vllm run`): what a vLLM campaign visits, and
the campaign, minimizer and writer of fuzz.campaign / fuzz.shrink / fuzz.reproduce pointed
at the vLLM target (`fuzz.targets.vllm_fuzz.VLLMFuzzTarget`).

A vLLM config (layout, eager/compiled, token budget, max_num_seqs, block size, n-gram
speculation, prefix caching, async scheduling) is drawn by the Hypothesis strategy
`fuzz.targets.vllm_configs.vllm_configs` (shrinks open: tp1pp1 eager, defaults). Starting an
engine costs ~40-100 s here, so a campaign draws a handful of configs up front with its
seed (`plan_configs`: plain tp1pp1 eager first, every layout x mode, simplest first) and
visits them in order with one engine each (a *cell*). The commands are in
`fuzz.targets.vllm_cli`. Nothing here imports torch or vLLM at import time.
"""
from __future__ import annotations


from fuzz.cli_common import BadInput

SECONDS_PER_CONFIG = 150.0  # an engine start (~40-100 s here) plus a useful stretch of examples
MAX_CONFIGS = 12


def auto_config_count(budget_s: float) -> int:
    return max(1, min(MAX_CONFIGS, round(budget_s / SECONDS_PER_CONFIG)))


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
    `count` (default: one per ~150 s of budget) drawn by `plan_configs` over the layouts and
    modes given; minus names starting with an `exclude` prefix."""
    from fuzz.targets.vllm_configs import VLLM_LAYOUTS, VLLM_MODES, plan_configs
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
        n = count if count is not None else auto_config_count(budget_s)
        if n < 1:
            raise BadInput(f"--configs: {n} is not a positive number of configs")
        chosen = plan_configs(n, seed, lay, mod, exclude=tuple(_split(exclude)))
    if not chosen:
        raise BadInput("no vLLM config left to visit (check --cells / --exclude)")
    return chosen


def load_known(path: str | None) -> set[str]:
    if not path:
        return set()
    with open(path) as f:
        return {ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()}


# -- the shared campaign, minimizer and writer, on vLLM -------------------------------------------

def VLLMCampaign(cells, *, budget_s: float, out_dir: str = "reproducers/vllm", seed: int = 0,  # noqa: N802
                 known: set[str] | None = None, max_requests: int = 8, chunk: int = 10, shrink_s: float = 300.0,
                 min_cell_s: float = 60.0, progress: bool = True, checker=None, shrink_configs: bool = True):
    """fuzz.campaign.Campaign over the vLLM target: `cells` are (EngineConfig, VLLMOptions)
    pairs, each visited once with one engine. Shrinking may run past the budget by up to
    `shrink_s` per failure, and a cell by `min_cell_s`: the hard deadline allows both. The
    campaign closes the vLLM engine it starts unless `checker` (the caller's) was given."""
    from fuzz.campaign import Campaign
    from fuzz.targets.vllm_fuzz import VLLMFuzzTarget

    target = VLLMFuzzTarget(cells, checker=checker, known=known, max_requests=max_requests,
                            shrink_configs=shrink_configs)
    camp = Campaign(target=target, budget_s=budget_s, out_dir=out_dir, seed=seed, chunk=chunk, progress=progress,
                    shrink_s=shrink_s, min_cell_s=min_cell_s, shrink_grace_s=shrink_s + min_cell_s)
    camp.owns_target = checker is None
    return camp


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
