"""vLLM as a fuzz.targets.base.Target: what fuzz.campaign.loop, fuzz.campaign.shrink and
fuzz.campaign.reproduce need to fuzz a real vLLM (docs/vllm.md).

- cells: one per planned config (`fuzz.targets.vllm.plan.campaign_configs`), visited
  in order (`sequential`), one engine each; Hypothesis draws workloads
  (`fuzz.cases.strategies.workloads` on the config) as Cases with target "vllm" and the config's
  options. An engine start costs ~40-120 s here, so Hypothesis's own shrinker is off (a
  crash would cost a restart per step): the minimizer shrinks within its deadline.
- check: `VLLMChecker` (crash/hang, greedy, vs reference, vs transformers, batch invariance),
  which drives the engine through `fuzz.targets.vllm.runner.VLLMRunner`.
- simpler: straight to one request with a one-token prompt and max_tokens=1 (each request in
  turn), then fuzz.targets.simpler's candidates on the same config, then the config one knob
  at a time toward the defaults (`simpler_configs`; each costs an engine start).
- a crash or hang ends its cell; a crash whose signature is known (`--known`, by default the
  committed reproducers': fuzz.targets.vllm.known) or was already written in an earlier cell
  is counted, not written again (one reproducer per signature); a second failure of a
  property the cell already reported is counted as a repeat; a config vLLM refuses at
  start-up by its own config checks is *unsupported*, not a failure.
- a start-up crash or hang is the cell's first example's failure (`start` keeps it, `check`
  raises it), so it is shrunk like any other: straight to the config candidates, one knob
  at a time (a workload cannot matter before the engine is up).
- time: shrinking happens within the budget (min(300 s, budget/5) a failure; the shrink
  phase after it gets 2 % of the budget); a cell runs for an equal share of the examples'
  time (the time left less the start-ups still to come, `start_estimate_s`), however long its
  first example took, and at least `min_cell_s` once started. When the
  campaign's clock starts (`begin`) the target sets `deadline`, the budget's hard end
  (budget x (1 + HARD_SLACK)): no engine start or run goes past it, and a shrink candidate
  whose engine start would not fit before it is skipped (not a failure).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

from fuzz.cases.case import RequestSpec, Workload
from fuzz.targets.base import Cell, Target, Unsupported
from fuzz.targets.vllm.configs import VLLMOptions, cell_name
from fuzz.targets.vllm.launch import engine_env, llm_kwargs, worker_env
from fuzz.targets.vllm.summary import NOTES, summary_json, summary_table

SLOWDOWN_CAP = 2.0  # the most an unseen kind's start is expected to exceed the plan's figure (startup_estimate)
HARD_SLACK = 0.03  # no engine start or run goes past budget x (1 + this): the 5 % promise, with shut-down


def reproducer_meta(case, violation, vllm_version: str | None) -> dict:
    """What a vLLM reproducer records beside the Case: the version, the LLM arguments and
    environment it ran with, the crash signature; `target` and `vllm_options` at the top
    level too (the reproducer format's vLLM fields, which fuzz.campaign.reproduce reads)."""
    opts = VLLMOptions.of(case)
    env = {**worker_env(case.config), **engine_env(case.config, opts)}
    meta = {"target": "vllm", "vllm_version": vllm_version, "vllm_options": opts.to_dict(),
            "llm_kwargs": llm_kwargs(case.config, opts),
            "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                        "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS",
                                        "LLMFUZZ_VLLM_SPIN_S") if k in env}}
    if getattr(violation, "signature", None):
        meta["signature"] = violation.signature
    return meta


def _planned_s(kind) -> float:
    """The plan's estimate of a start of this kind (fuzz.targets.vllm.runner.start_kind)."""
    from fuzz.targets.vllm.covering import startup_cost

    workers, compiled, core_process = kind
    return startup_cost({"mode": "compiled" if compiled else "eager", "layout": "tp1pp1" if workers == 1 else "tp2pp1",
                         "core": "process" if core_process else "inproc"})


class Unchecked:
    """What `check` returns for a Case it could not afford to run before the campaign's hard
    deadline: nothing was violated (a shrink candidate is not taken), and the campaign loop
    sees an error ratio of 0. `record` counts it, as `unchecked`, not as a verdict."""

    __slots__ = ("case",)

    def __init__(self, case) -> None:
        self.case = case

    @property
    def logits(self):
        from fuzz.verdict.properties import LogitsReport

        return LogitsReport("none", 0.0, 1.0, 0)


class VLLMTarget(Target):
    """`configs`: the (EngineConfig, VLLMOptions) to visit; `known`: crash signatures counted,
    not written; `include_known`: draw what known workload crashes reach too; `plan`: what the
    configs cover (fuzz.targets.vllm.plan.plan_report), kept in the summary; `checker`: a VLLMChecker of the caller's (closed by the caller), else one of
    this target's, made when first needed."""

    name = "vllm"
    sequential = True
    prestarts = True
    hypothesis_shrinks = False
    confirm_before_shrink = False  # a crash re-run costs an engine start; the first candidate re-runs anyway
    max_shrink_checks = 60
    unit = "configs"
    chunk = 10
    min_cell_s = 10.0
    min_cell_examples = 30  # equal time gave a config of slow examples 26 beside configs of 50-87

    def __init__(self, configs, *, checker=None, known=None, max_requests: int = 8,
                 shrink_configs: bool = True, plan: dict | None = None, include_known: bool = False) -> None:
        self.configs, self.known, self.plan = list(configs), set(known or ()), plan
        # Unless set, the cells draw around the known crashes some workloads reach (known.py).
        self.include_known = include_known
        self.max_requests, self.shrink_configs = max_requests, shrink_configs
        self._checker, self._own = checker, checker is None
        self._starts: dict[str, tuple[int, float]] = {}  # engine starts before each cell
        self._start_failed: dict[str, object] = {}  # engine key -> its start-up TargetFailure, not yet raised
        self._failed_keys: set[str] = set()  # engine keys whose start failed: shrink their config only
        self.written: dict[str, str] = {}  # signature -> cell that first reported it
        self.duplicates: list[dict] = []  # the same signature found again in another cell
        self.deadline: float | None = None  # time.monotonic(): the campaign's hard end (`begin`)
        # Cases `check` could not afford before the deadline (each `Unchecked`): in all, and
        # since the last reproducer was written (a shrink that skipped candidates may call
        # itself minimal: the reproducer says how many it skipped).
        self.unchecked, self._unchecked_since_write = 0, 0
        # The known crashes the plan left out, each replayed once: its state (fuzz.cli.vllm).
        self.known_crashes: list[dict] = []
        self.known_crash_replay_s: float | None = None  # their wall time, beside the campaign

    @property
    def checker(self):
        if self._checker is None:  # made when first needed: VLLMRunner() looks for vLLM
            from fuzz.targets.vllm.checker import VLLMChecker

            self._checker = VLLMChecker()
        return self._checker

    # -- the campaign's policies (fuzz.targets.base.Target) -----------------------------------
    def shrink_per_failure_s(self, budget_s: float) -> float:
        return min(300.0, budget_s / 5)

    def shrink_phase_s(self, budget_s: float) -> float:
        return 0.02 * budget_s

    def begin(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s * (1 + HARD_SLACK)

    def cells(self) -> list[Cell]:
        from fuzz.targets.blackbox_target import config_cells
        from fuzz.targets.vllm.known import KNOWN_WORKLOAD_CRASHES, spare_known

        crashes = () if self.include_known else KNOWN_WORKLOAD_CRASHES
        return config_cells(self.configs, cell_name, self.max_requests, sampling=True, with_aborts=True,
                            adapt=lambda cfg, wl: spare_known(cfg, vllm_workload(cfg, wl), crashes))

    def check(self, case):
        """The checker's verdict; a start-up failure kept by `start` is raised as this
        Case's. A Case whose engine would have to start and cannot before `deadline` is not
        checked (`Unchecked`: a shrink candidate that does not fail)."""
        from fuzz.targets.runs import TargetFailure
        from fuzz.targets.vllm.checker import VLLMCrash, violation_for

        t, opts = self.checker.runner, VLLMOptions.of(case)
        key = t.config_key(case.config, opts)
        if key in self._start_failed:
            raise violation_for(self._start_failed.pop(key), case)
        if self.deadline is not None and not t.is_live(case.config, opts):
            if time.monotonic() + self.startup_estimate(case.config, opts) + 5.0 > self.deadline:
                return self._unchecked(case)
        t.deadline = self.deadline
        try:
            return self.checker.check(case)
        except TargetFailure as f:  # "deadline": the campaign's time ran out mid-check
            if f.kind != "deadline":
                raise
            return self._unchecked(case)
        except VLLMCrash as v:
            if v.kind == "startup":  # shrink this config's knobs, not its workload
                self._failed_keys.add(key)
            raise

    def fresh_check(self, case, history=()):
        """`history` then `case` on a brand-new engine: the live one is shut down, and the
        next run starts another in a new worker process (VLLMRunner.ensure)."""
        from fuzz.targets.fresh import RESTARTED, run_sequence

        self.fresh = RESTARTED
        self.checker.runner.shutdown(wait=True)  # one engine on the device at a time
        return run_sequence(self.check, history, case, self.checked)

    def _unchecked(self, case) -> "Unchecked":
        self.unchecked += 1
        self._unchecked_since_write += 1
        return Unchecked(case)

    def startup_estimate(self, cfg, opts: VLLMOptions = VLLMOptions()) -> float:
        """Seconds an engine start for `cfg` will take: the longest measured so far for its
        kind (workers x compiled x the core's process), else the plan's estimate (measured
        on a quiet machine) scaled by how much slower than theirs the starts so far have been:
        the median over the starts of pre-imported workers, within [1, SLOWDOWN_CAP]. Under
        load the plan's figures were 1.4-2.3x short for the multi-process kinds, and a start
        longer than planned is taken out of the last config's time; but an estimate too long
        starves every config (the starts left seem not to fit, and each gets its least time):
        a fresh machine's first start, vLLM's imports compiled on the way, ran 10x the plan."""
        from fuzz.targets.vllm.runner import start_kind

        kind = start_kind(cfg, opts)
        starts = self._checker.runner.starts if self._checker is not None else ()  # none made yet: none measured
        seen = [s["full_s"] for s in starts if s.get("kind") == list(kind)]
        if seen:
            return max(seen)
        # init_s: the start less vLLM's import, which is what the plan's figures count.
        slower = [s["init_s"] / _planned_s(s["kind"]) for s in starts if s.get("ok") and s.get("warm") and s.get("init_s")]
        return _planned_s(kind) * min(SLOWDOWN_CAP, max(1.0, statistics.median(slower) if slower else 1.0))

    def start_estimate_s(self, cell) -> float:
        """What the campaign will still wait for `cell`'s engine: nothing when it is live, the
        estimate less what has run ahead when it is being pre-started."""
        cfg, opts = cell.data.config, VLLMOptions.of(cell.data)
        runner = self._checker.runner if self._checker is not None else None
        if runner is not None and runner.is_live(cfg, opts):
            return 0.0
        ahead = runner.prestarted_s(cfg, opts) if runner is not None else None
        return max(0.0, self.startup_estimate(cfg, opts) - (ahead or 0.0))

    def prestart(self, cell) -> None:
        """Start the next cell's engine while this one is fuzzed (VLLMRunner.prestart), if it
        can be up before the deadline: its start-up then runs beside the examples rather than
        before them. Both engines share the cores meanwhile."""
        cfg, opts = cell.data.config, VLLMOptions.of(cell.data)
        if self.deadline is not None and time.monotonic() + self.startup_estimate(cfg, opts) > self.deadline:
            return
        self.checker.runner.prestart(cfg, opts)

    def starting(self, cell) -> bool:
        return self._checker is not None and self._checker.runner.still_starting(cell.data.config,
                                                                                  VLLMOptions.of(cell.data))

    def simpler(self, case):
        from engine.config import ConfigError
        from fuzz.targets.simpler import candidates

        if self.checker.runner.config_key(case.config, VLLMOptions.of(case)) in self._failed_keys:
            # Failed at start-up: only the config can matter. One knob toward the defaults at a
            # time, then the one-request workload.
            for cfg, opts in (simpler_configs(case.config, VLLMOptions.of(case), eager_first=True)
                              if self.shrink_configs else ()):
                try:
                    yield opts.on(replace(case, config=cfg))
                except ConfigError:
                    continue
            tiny = case.workload.requests[0]
            yield replace(case, workload=Workload((replace(tiny, prompt_token_ids=tiny.prompt_token_ids[:1],
                                                           max_tokens=1, arrival_step=0),)))
            return
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
        meta = reproducer_meta(case, violation, self.vllm_version)
        meta["shrink_candidates_skipped_for_time"], self._unchecked_since_write = self._unchecked_since_write, 0
        return meta

    def stats_key(self, case) -> tuple:
        return cell_name(case.config, VLLMOptions.of(case)), ""

    def start(self, cell: Cell) -> None:
        from fuzz.targets.runs import TargetFailure, adapter_error
        from fuzz.targets.vllm.checker import violation_for

        t = self.checker.runner
        st = t.stats.get(cell.name)
        self._starts[cell.name] = (st.starts, st.startup_s) if st else (0, 0.0)
        cfg, opts = cell.data.config, VLLMOptions.of(cell.data)
        t.deadline = self.deadline
        try:
            t.ensure(cfg, opts)
        except TargetFailure as f:
            if unsupported(f):
                raise Unsupported(f"unsupported by vLLM: {f.signature}: {f.detail}") from None
            if (why := adapter_error(f, "vllm")) is not None:
                raise Unsupported(why) from None
            if f.kind == "deadline":
                raise Unsupported("not started: the campaign's time ran out") from None
            if f.signature in self.known or f.signature in self.written:
                raise violation_for(f, cell.data) from None  # counted, not shrunk: one start-up was enough
            # The cell's first example raises it (`check`), so the campaign shrinks it.
            key = t.config_key(cfg, opts)
            self._start_failed[key] = f
            self._failed_keys.add(key)

    def triage(self, violation, earlier: list) -> str:
        from fuzz.targets.vllm.checker import VLLMCrash

        crash = isinstance(violation, VLLMCrash)
        if crash and violation.signature in self.known:
            return "known"
        if getattr(violation, "signature", None):  # a crash, or a drafter bug: one reproducer per signature
            c = violation.case
            here = cell_name(c.config, VLLMOptions.of(c)) if c is not None else "?"
            first = self.written.setdefault(violation.signature, here)
            if first != here:
                # One reproducer per signature: found again in another cell, counted, not written.
                if not any(d["cell"] == here and d["signature"] == violation.signature for d in self.duplicates):
                    self.duplicates.append({"signature": violation.signature, "first_cell": first, "cell": here})
                return "known"
        if not crash and any(f.property == violation.property for f in earlier):
            return "repeat"  # the same disagreement again: every further example would repeat it
        return "new"

    def ends_cell(self, violation) -> bool:
        from fuzz.targets.vllm.checker import VLLMCrash

        return isinstance(violation, VLLMCrash)  # the engine is gone; each example would restart it

    def checked(self, verdict) -> bool:
        return not isinstance(verdict, Unchecked)

    def record(self, stats, verdict) -> None:
        if isinstance(verdict, Unchecked):
            stats.notes["unchecked"] = stats.notes.get("unchecked", 0) + 1
            return
        n = stats.notes
        for k in NOTES:
            n.setdefault(k, NOTES[k])
        # What this example reached (fuzz.targets.vllm.checker.reached): coverage counts only those.
        case, feats = self._checker.last_reach if self._checker is not None else (None, frozenset())
        if case is not None:
            key = "+".join(sorted(feats)) or "none"
            n.setdefault("reached", {})[key] = n.setdefault("reached", {}).get(key, 0) + 1
            self._checker.last_reach = (None, frozenset())
        ref, hf = verdict.vs_reference, verdict.vs_transformers
        n["max_lp_error_vs_reference"] = max(n["max_lp_error_vs_reference"], ref.max_lp_error)
        n["near_tie_divergences"] += len(ref.divergences)
        if hf is not None:
            n["max_lp_error_vs_transformers"] = max(n["max_lp_error_vs_transformers"], hf.max_lp_error)
            n["prompt_logprob_positions_checked"] += hf.prompt_positions

    def cell_done(self, cell: Cell, stats) -> None:
        st = self.checker.runner.stats.get(cell.name)
        s0, ss0 = self._starts.get(cell.name, (0, 0.0))
        stats.notes["engine_starts"] = st.starts - s0 if st else 0
        stats.notes["startup_s"] = round(st.startup_s - ss0, 1) if st else 0.0
        stats.notes["llm_kwargs"] = llm_kwargs(cell.data.config, VLLMOptions.of(cell.data))
        # Stalls that were not hangs (fuzz.targets.vllm.runner): counted, not findings.
        runner = self.checker.runner
        stats.notes["slow_steps"] = sum(1 for x in getattr(runner, "slow_steps", ()) if x["cell"] == cell.name)
        stats.notes["compile_waits"] = sum(1 for x in getattr(runner, "compile_waits", ()) if x["cell"] == cell.name)
        ds = self._checker.draft_stats.get(cell.name) if self._checker is not None else None
        if ds is not None:
            stats.notes["drafts"] = ds.to_json()
        mix = self._checker.mix_stats.get(cell.name) if self._checker is not None else None
        if mix:  # the prefix cache's hit rate over the cell's prompt tokens, and the sampling mix
            stats.notes["mix"] = {**mix, "hit_rate": round(mix["cached_tokens"] / max(1, mix["prompt_tokens"]), 3)}

    def describe(self) -> str:
        return f"vLLM, {len(self.configs)} config(s)"

    def summary_json(self, summary) -> dict:
        return summary_json(summary, self)

    def summary_table(self, summary) -> str:
        return summary_table(summary, self)

    @property
    def vllm_version(self) -> str | None:
        return self._checker.runner.vllm_version if self._checker is not None else None

    def oracles(self) -> list[str]:
        hf = self._checker is not None and self._checker.hf is not None
        return ["reference", "vllm-solo"] + (["transformers"] if hf else [])

    def close(self) -> None:
        if self._own and self._checker is not None:
            self._checker.close()


def vllm_workload(cfg, wl: Workload) -> Workload:
    """The workload as vLLM takes it: stop sequences of token ids dropped (vLLM without a
    tokenizer has no counterpart: launch.request_payload; stop token ids stay), and with
    speculative decoding no logit bias or min_p (vLLM refuses them there:
    SamplingParams._validate_spec_decode)."""
    spec = cfg.speculative_method != "none"

    def fit(r: RequestSpec) -> RequestSpec:
        p = r.sampling
        if p is None:
            return r
        q = replace(p, stop_sequences=(), **({"logit_bias": (), "min_p": 0.0} if spec else {}))
        return r if q == p else replace(r, sampling=q)
    return replace(wl, requests=tuple(fit(r) for r in wl.requests))


# The exception types vLLM's config checks raise to refuse a combination: such a start-up is an
# unsupported config, counted and skipped, not a crash (`unsupported` also requires the frame).
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


def simpler_configs(cfg, opts, eager_first: bool = False):
    """One knob of (cfg, opts) back toward the default per candidate, cheapest-to-test first:
    options (prefix caching, async, KV size, the core's process), speculation, block size,
    budget, sequences, dtype, max_model_len, then eager, then tp1pp1. `eager_first` (a start-up failure):
    compiled -> eager first, since every later candidate is an engine start and an eager
    start costs a fraction of a compiled one."""
    from fuzz.targets.vllm.configs import VLLM_MODEL, _fit

    base = VLLM_MODEL
    out = []
    eager = [(cfg.replace(cudagraph_mode="NONE", capture_sizes=()), opts)] if cfg.cudagraph_mode != "NONE" else []
    if eager_first:
        out += eager
    if opts.enable_prefix_caching:
        out.append((cfg, replace(opts, enable_prefix_caching=False)))
    if opts.async_scheduling:
        out.append((cfg, replace(opts, async_scheduling=False)))
    if opts.kv_blocks:
        out.append((cfg, replace(opts, kv_blocks=0)))
    if opts.engine_core_process:
        out.append((cfg, replace(opts, engine_core_process=False)))
    if cfg.speculative_method != "none":
        out.append((cfg.replace(speculative_method="none", num_speculative_tokens=0), opts))
    for f in ("block_size", "max_num_batched_tokens", "max_num_seqs", "dtype", "max_model_len"):
        if getattr(cfg, f) != getattr(base, f):
            out.append((_fit(cfg.replace(**{f: getattr(base, f)})), opts))
    if not eager_first:
        out += eager
    if cfg.world_size > 1:
        out.append((cfg.replace(layout="tp1pp1"), opts))
    return out
