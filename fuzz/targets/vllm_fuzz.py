"""vLLM as a fuzz.target.Target: what fuzz.campaign, fuzz.shrink and fuzz.reproduce need to
fuzz a real vLLM (docs/vllm.md).

- cells: one per planned config (`fuzz.targets.vllm_campaign.campaign_configs`), visited
  in order (`sequential`), one engine each; Hypothesis draws workloads
  (`fuzz.strategies.workloads` on the config) as Cases with target "vllm" and the config's
  options. An engine start costs ~40-120 s here, so Hypothesis's own shrinker is off (a
  crash would cost a restart per step): the minimizer shrinks within its deadline.
- check: `VLLMChecker` (crash/hang, greedy, vs reference, vs transformers, batch invariance).
- simpler: straight to one request with a one-token prompt and max_tokens=1 (each request in
  turn), then fuzz.shrink's candidates on the same config, then the config one knob at a time
  toward the defaults (`simpler_configs`; each costs an engine start).
- a crash or hang ends its cell; a crash whose signature is known (`--known`) is counted, not
  written; a second failure of a property the cell already reported is counted as a repeat;
  a config vLLM refuses at start-up by its own config checks is *unsupported*, not a failure.
"""
from __future__ import annotations

from dataclasses import replace

from fuzz.case import RequestSpec, Workload
from fuzz.target import Cell, Target, Unsupported


def reproducer_meta(case, violation, vllm_version: str | None) -> dict:
    """What a vLLM reproducer records beside the Case: the version, the LLM arguments and
    environment it ran with, the crash signature; `target` and `vllm_options` as well, as
    llmfuzz wrote them before Cases carried their target."""
    from fuzz.targets.vllm_target import VLLMOptions, llm_kwargs, worker_env

    opts, env = VLLMOptions.of(case), worker_env(case.config)
    meta = {"target": "vllm", "vllm_version": vllm_version, "vllm_options": opts.to_dict(),
            "llm_kwargs": llm_kwargs(case.config, opts),
            "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND") if k in env}}
    if getattr(violation, "signature", None):
        meta["signature"] = violation.signature
    return meta


def _on(template):
    """Workload -> the template Case with it (a function per cell: Hypothesis maps draws with it)."""
    return lambda wl: replace(template, workload=wl)


class VLLMFuzzTarget(Target):
    name = "vllm"
    sequential = True
    hypothesis_shrinks = False
    confirm_before_shrink = False  # a crash re-run costs an engine start; the first candidate re-runs anyway
    max_shrink_checks = 60
    unit = "configs"

    def __init__(self, configs, *, checker=None, known=None, max_requests: int = 8,
                 shrink_configs: bool = True) -> None:
        self.configs, self.known = list(configs), set(known or ())
        self.max_requests, self.shrink_configs = max_requests, shrink_configs
        self._checker, self._own = checker, checker is None
        self._starts: dict[str, tuple[int, float]] = {}  # engine starts before each cell

    @property
    def checker(self):
        if self._checker is None:  # made when first needed: VLLMTarget() looks for vLLM
            from fuzz.targets.vllm_checker import VLLMChecker

            self._checker = VLLMChecker()
        return self._checker

    def cells(self) -> list[Cell]:
        from fuzz.case import Case
        from fuzz.strategies import workloads
        from fuzz.targets.vllm_target import cell_name

        out = []
        for cfg, opts in self.configs:
            template = opts.on(Case(cfg, Workload((RequestSpec((1,), 1),))))
            out.append(Cell(cell_name(cfg, opts), workloads(cfg, self.max_requests).map(_on(template)), template))
        return out

    def check(self, case):
        return self.checker.check(case)

    def simpler(self, case):
        from engine.config import ConfigError
        from fuzz.shrink import candidates
        from fuzz.targets.vllm_target import VLLMOptions

        for r in case.workload.requests:
            tiny = replace(r, prompt_token_ids=r.prompt_token_ids[:1], max_tokens=1, arrival_step=0)
            yield replace(case, workload=Workload((tiny,)))
        # Our engine's candidates that keep the config: a config change is an engine start.
        yield from (c for c in candidates(case) if c is not None and c.config == case.config)
        if self.shrink_configs:
            for cfg, opts in simpler_configs(case.config, VLLMOptions.of(case)):
                try:
                    yield opts.on(replace(case, config=cfg))
                except ConfigError:
                    continue

    def reproducer_meta(self, case, violation) -> dict:
        return reproducer_meta(case, violation, self.vllm_version)

    def stats_key(self, case) -> tuple:
        from fuzz.targets.vllm_target import VLLMOptions, cell_name

        return cell_name(case.config, VLLMOptions.of(case)), ""

    def start(self, cell: Cell) -> None:
        from fuzz.targets import TargetFailure
        from fuzz.targets.vllm_checker import violation_for
        from fuzz.targets.vllm_target import VLLMOptions

        t = self.checker.target
        st = t.stats.get(cell.name)
        self._starts[cell.name] = (st.starts, st.startup_s) if st else (0, 0.0)
        try:
            t.ensure(cell.data.config, VLLMOptions.of(cell.data))
        except TargetFailure as f:
            if unsupported(f):
                raise Unsupported(f"unsupported by vLLM: {f.signature}: {f.detail}") from None
            raise violation_for(f, cell.data) from None

    def triage(self, violation, earlier: list) -> str:
        from fuzz.targets.vllm_checker import VLLMCrash

        crash = isinstance(violation, VLLMCrash)
        if crash and violation.signature in self.known:
            return "known"
        if not crash and any(f.property == violation.property for f in earlier):
            return "repeat"  # the same disagreement again: every further example would repeat it
        return "new"

    def ends_cell(self, violation) -> bool:
        from fuzz.targets.vllm_checker import VLLMCrash

        return isinstance(violation, VLLMCrash)  # the engine is gone; each example would restart it

    def record(self, stats, verdict) -> None:
        n = stats.notes
        for k in NOTES:
            n.setdefault(k, NOTES[k])
        ref, hf = verdict.vs_reference, verdict.vs_transformers
        n["max_lp_error_vs_reference"] = max(n["max_lp_error_vs_reference"], ref.max_lp_error)
        n["near_tie_divergences"] += len(ref.divergences)
        if hf is not None:
            n["max_lp_error_vs_transformers"] = max(n["max_lp_error_vs_transformers"], hf.max_lp_error)
            n["prompt_logprob_positions_checked"] += hf.prompt_positions

    def cell_done(self, cell: Cell, stats) -> None:
        from fuzz.targets.vllm_target import VLLMOptions, llm_kwargs

        st = self.checker.target.stats.get(cell.name)
        s0, ss0 = self._starts.get(cell.name, (0, 0.0))
        stats.notes["engine_starts"] = st.starts - s0 if st else 0
        stats.notes["startup_s"] = round(st.startup_s - ss0, 1) if st else 0.0
        stats.notes["llm_kwargs"] = llm_kwargs(cell.data.config, VLLMOptions.of(cell.data))

    def describe(self) -> str:
        return f"vLLM, {len(self.configs)} config(s)"

    def summary_json(self, summary) -> dict:
        return summary_json(summary, self)

    def summary_table(self, summary) -> str:
        return summary_table(summary)

    @property
    def vllm_version(self) -> str | None:
        return self._checker.target.vllm_version if self._checker is not None else None

    def oracles(self) -> list[str]:
        hf = self._checker is not None and self._checker.hf is not None
        return ["reference", "vllm-solo"] + (["transformers"] if hf else [])

    def close(self) -> None:
        if self._own and self._checker is not None:
            self._checker.close()


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


def summary_json(s, target: VLLMFuzzTarget) -> dict:
    """fuzz.campaign.Summary of a vLLM campaign, per config (docs/vllm.md, `--json`)."""
    cells = {k[0]: c for k, c in s.cells.items()}
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


UNSUPPORTED_TYPES = ("ValueError", "NotImplementedError")


def unsupported(f) -> bool:
    """A start-up refused by vLLM's own config checks (a ValueError / NotImplementedError raised
    in vllm/config, vllm/engine/arg_utils.py or vllm/platforms) is an unsupported
    configuration, not a crash."""
    if f.kind != "startup":
        return False
    typ, _, where = f.signature.partition("@")
    return typ in UNSUPPORTED_TYPES and where.startswith(("vllm/config/", "vllm/engine/arg_utils.py",
                                                          "vllm/platforms/"))


def simpler_configs(cfg, opts):
    """One knob of (cfg, opts) back toward the default per candidate, cheapest-to-test first:
    options, speculation, block size, budget and sequences, then eager, then tp1pp1."""
    from fuzz.targets.vllm_target import VLLM_MODEL

    base = VLLM_MODEL
    out = []
    if opts.enable_prefix_caching:
        out.append((cfg, replace(opts, enable_prefix_caching=False)))
    if opts.async_scheduling:
        out.append((cfg, replace(opts, async_scheduling=False)))
    if cfg.speculative_method != "none":
        out.append((cfg.replace(speculative_method="none", num_speculative_tokens=0), opts))
    for f in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(cfg, f) != getattr(base, f):
            out.append((cfg.replace(**{f: getattr(base, f)}), opts))
    if cfg.cudagraph_mode != "NONE":
        out.append((cfg.replace(cudagraph_mode="NONE", capture_sizes=()), opts))
    if cfg.world_size > 1:
        out.append((cfg.replace(layout="tp1pp1"), opts))
    return out
