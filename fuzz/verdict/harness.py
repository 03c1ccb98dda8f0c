"""Harness: run a Case on a reused engine, run its reference, check every property.

The façade of the verdict package: `Harness.check(case) -> Verdict`. Engines come from the
pool (`engine_pool`), runs are driven by `runner`, the Cases its checks derive from the
Case under test are built by `derived`. Reference runs are cached by (reference config,
workload).
"""
from __future__ import annotations

import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.llm_engine import Trace
from fuzz.cases.case import Case, RequestSpec, reference_config
from fuzz.verdict.bitwise import (BATCH, TWIN, check_bitwise, first_difference, reference_bitwise_due,
                                  reference_bitwise_skip, twin_bitwise_due)
from fuzz.verdict.derived import (alone_case, caching_off, other_schedule, plain_twin, prefix_twin_due,
                                  reference_case, rescheduled, sampled_for_determinism)
from fuzz.verdict.engine_pool import EnginePool
from fuzz.verdict.oracles import ORACLES
from fuzz.verdict.oracles import hf
from fuzz.verdict.oracles.solo import SoloOracle
from fuzz.verdict.properties import (DeterminismViolation, LogitsMismatch, FAViolation, LogitsReport, Violation,
                                     aborted_ids, check_determinism, check_fa_records, check_logits, check_noise,
                                     check_ngram_drafts, check_prefix_cache_invariance, check_prompt_logprobs,
                                     check_sampling)
from fuzz.verdict.runner import run_on_pool
from fuzz.verdict.tolerance import Tolerance, is_half

# Share of the harness's time the transformers oracle may take on passing Cases.
TRANSFORMERS_SHARE = 0.25


@dataclass(slots=True)
class Verdict:
    case: Case
    logits: LogitsReport  # the comparison with the largest error/tolerance
    oracles: dict  # oracle name -> LogitsReport, or True for determinism
    fa_calls_checked: int
    num_steps: int
    num_preemptions: int
    max_in_flight: int
    seconds: float
    engine_seconds: float
    # Prefix caching (0 with it off): prompt tokens looked up at admission, and those found
    # cached (engine/kv_cache.py's counters, over the run under test).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Checks this Case did not get, with why (check -> reason): nothing is skipped silently.
    skipped: dict = field(default_factory=dict)
    # Async scheduling (0 with it off): microbatches in which a request ran ahead of its step
    # in flight, of all the run under test's steps.
    async_steps: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else None



# References are reused when the same workload runs again: in shrinking (the same workload
# on simpler layouts, modes and schedules) and Hypothesis's mutations within a chunk, both
# recent. A campaign rarely draws a workload twice, so a large cache only holds memory
# (~0.14 MB a reference: 256 of them grew a 30-minute campaign by ~35 MB).
REFERENCE_CACHE_SIZE = 64


class Harness:
    def __init__(self, pool_capacity: int = 16, oracles: frozenset[str] = frozenset()) -> None:
        import torch

        # CPU GEMMs round differently per thread count: one compute thread makes verdicts
        # and reproducers identical across machines and across the two worlds.
        torch.set_num_threads(1)
        self.pool = EnginePool(pool_capacity)
        self.ref_cache: OrderedDict[str, Trace] = OrderedDict()
        self.engine_seconds = 0.0
        self.check_seconds = 0.0
        self.always = frozenset(oracles)  # oracles asked for on every Case (--oracle)
        unknown = self.always - set(ORACLES)
        if unknown:
            raise ValueError(f"oracle: unknown oracle {sorted(unknown)[0]!r}")
        if "transformers" in self.always and not hf.available():
            raise ValueError("oracle: transformers is not installed (pip install transformers)")
        self.solo = SoloOracle()
        self.alone_cache: OrderedDict[str, Trace] = OrderedDict()  # alone runs, as ref_cache
        self.transformers = hf.TransformersOracle() if hf.available() else None
        if self.transformers is None:  # a core dependency; a hand-made environment may lack it
            sys.stderr.write("llmfuzz: transformers is not installed: the transformers oracle is off "
                             "(pip install transformers)\n")

    def reference(self, case: Case, forced: dict[str, list[int]] | None = None) -> Trace:
        """The reference run of `case`; `forced`: requests teacher-forced on these tokens (a
        black-box target's sampled requests, fuzz.targets.blackbox)."""
        return self._cached_run(reference_case(case), forced)

    def _cached_run(self, case: Case, forced: dict[str, list[int]] | None) -> Trace:
        """A run other Cases compare against (the reference, the plain twin), kept for the
        next Case with the same workload (shrinking, Hypothesis's mutations)."""
        key = repr(case.config.to_dict()) + case.to_json() + (repr(sorted(forced.items())) if forced else "")
        if key not in self.ref_cache:
            trace = self._run(case, forced)
            # Only the reference's tokens and logits are compared against. Its FA records
            # (hundreds per Case, each holding small tensors) made this cache the largest
            # memory user of a long campaign: keep them out of it.
            trace.fa_records = []
            self.ref_cache[key] = trace
            if len(self.ref_cache) > REFERENCE_CACHE_SIZE:
                self.ref_cache.popitem(last=False)
        return self.ref_cache[key]

    def _run(self, case: Case, forced: dict[str, list[int]] | None) -> Trace:
        t0 = time.perf_counter()
        try:
            return run_on_pool(self.pool, case, forced)
        finally:
            self.engine_seconds += time.perf_counter() - t0

    def run_case(self, case: Case) -> Trace:
        """The test run, teacher-forced with the reference's tokens."""
        ref = self.reference(case)
        return self._run(case, ref.output_token_ids())

    def check(self, case: Case) -> Verdict:
        """Run `case`, its reference and its oracles; raise the first Violation, else return a
        Verdict. Checks run cheapest first: FA invariants, reference, solo, transformers,
        n-gram drafts, sampling, bitwise invariance against the reference (where the engine promises it:
        fuzz/verdict/bitwise.py), the prefix-cache twin, determinism. A failure of the run's
        logits or FA calls carries the transformers oracle's verdict on the same run as its
        `second_opinion`."""
        case.validate()
        t0 = time.perf_counter()
        e0 = self.engine_seconds
        try:
            ref = self.reference(case)
            forced = ref.output_token_ids()
            test = self._run(case, forced)
            oracles, tol = self.oracle_traces(case, forced, transformers=self._transformers_due())
            try:
                n_fa = check_fa_records(case, test.fa_records)
                reports = {name: check_logits(case, trace, test, tol, name)
                           for name, trace in {"reference": ref, **oracles}.items()}
            except (FAViolation, LogitsMismatch) as v:
                v.second_opinion = self._second_opinion(case, test, forced, tol)
                raise
            skipped: dict[str, str] = {}
            if case.config.speculative_method == "ngram":
                check_ngram_drafts(case, test)
                reports["drafts"] = True
            if any(r.sampling is not None for r in case.workload.requests):
                self.check_sampling(case, test, ref, forced, reports, skipped)
            if reference_bitwise_due(case):
                check_bitwise(case, test, ref, BATCH)
                reports["bitwise_invariance"] = True
            elif twin_bitwise_due(case):
                check_bitwise(case, test, self._cached_run(plain_twin(case), forced), TWIN)
                reports["bitwise_invariance"] = True
            elif case.config.device == "cpu":
                skipped["bitwise_invariance"] = reference_bitwise_skip(case)
            if prefix_twin_due(case):
                check_prefix_cache_invariance(case, test, self._run(caching_off(case), forced))
                reports["prefix_cache_invariance"] = True
            # On the CPU the engine promises schedule invariance and a share of Cases is re-run
            # to check it; on CUDA only when asked (--oracle determinism: a second GPU run).
            if "determinism" in self.always or (case.config.device == "cpu" and sampled_for_determinism(case)):
                self.check_determinism(case, test, forced)
                reports["determinism"] = True
        finally:
            self.check_seconds += time.perf_counter() - t0
        worst = max((r for r in reports.values() if isinstance(r, LogitsReport)), key=lambda r: r.ratio)
        return Verdict(case, worst, reports, n_fa, test.num_steps, test.num_preemptions, test.max_in_flight,
                       time.perf_counter() - t0, self.engine_seconds - e0,
                       *getattr(test, "prefix_tokens", (0, 0)), skipped, test.num_async_steps)

    def check_determinism(self, case: Case, test: Trace, forced: dict) -> None:
        """The Case re-run under another Schedule (`other_schedule`: another rank order and
        copy landing) gives bitwise the test run: on the CPU the engine promises results that
        depend on neither (docs/oracles.md#bitwise-invariance). On a difference, a re-run under
        the Case's own Schedule says which guarantee broke: determinism (that run differs
        too) or schedule invariance."""
        try:
            other = self._run(rescheduled(case), forced)
        except Violation as v:  # the Case's failure: its reproducer is the Case, not this run
            v.case = case
            v.message = f"under another Schedule: {v.message}"
            v.args = (v.message,)
            raise
        where = first_difference(test, other, aborted_ids(case))
        if where is None:
            return
        check_determinism(case, test, self._run(case, forced))
        s = other_schedule(case.schedule)
        raise DeterminismViolation(
            f"{where}: the Case differs under another Schedule (rank_order={s.rank_order}, seed={s.seed}, "
            f"copy_delay={s.copy_delay}, prepare_ahead={s.prepare_ahead}) while a re-run under its own "
            f"agrees: schedule invariance broken (the order ranks arrive in or copies land changed a result)",
            case, oracle="another schedule")

    def check_sampling(self, case: Case, test: Trace, ref: Trace, forced: dict, reports: dict,
                       skipped: dict) -> None:
        """The run's sampling, for a Case with sampling params (raise a SamplingViolation):
        - "sampling": the independent sampler (fuzz/verdict/oracles/sampling.py) recomputes each
          recorded processed distribution from the raw logits row and the request's history,
          and checks the token drawn from it (greedy: the argmax; random: the exponential race
          over the recorded noise) and the top logprobs;
        - "noise": each random draw is bitwise the reference's (same seed, same draws);
        - "solo_noise": ... and that of the request run alone, unchunked (`alone_case`): the
          reference shares the Case's chunking, so a generator drawing on a step that samples
          nothing (a partial prefill) is seen here when the bug is in every run;
        - "prompt_logprobs": against the solo oracle's rows of the prompt (fp32 and fp64 only:
          in half precision the two differ by more than the sampler's tolerance; skipped)."""
        reqs = case.workload.engine_requests()
        prompts = {rid: list(r.prompt_token_ids) for rid, _, r, _ in reqs}
        check_sampling(case, test, prompts)
        reports["sampling"] = True
        check_noise(case, test, ref, "reference")
        random = [(rid, r, p) for rid, _, r, p in reqs if p is not None and not p.is_greedy and forced.get(rid)]
        if random:
            reports["noise"] = True
            for rid, r, p in random:
                check_noise(case, test, self.alone_noise(case, rid, r, p, forced[rid]), "solo", rid)
            reports["solo_noise"] = True
        asked = [(rid, r) for rid, _, r, p in reqs if p is not None and p.prompt_logprobs is not None]
        if asked and is_half(case.config.dtype):
            skipped["prompt_logprobs"] = (f"{case.config.dtype}: the run's prompt logprobs differ from the fp32 "
                                          f"solo oracle's by more than the sampler's tolerance")
        elif asked:
            ref_cfg = reference_config(case.config)
            victims = case.workload.aborted_ids()
            for rid, r in asked:
                recorded = test.prompt_logprobs.get(rid, [])
                # An aborted request reports the prompt positions it computed before its abort.
                prompt = r.prompt_token_ids[:len(recorded)] if rid in victims else r.prompt_token_ids
                if len(prompt) > 1:
                    check_prompt_logprobs(case, rid, recorded, self.solo.prompt_logits(ref_cfg, tuple(prompt)), prompt)
            reports["prompt_logprobs"] = True

    def alone_noise(self, case: Case, rid: str, r: RequestSpec, params, forced: list[int]) -> Trace:
        """The trace of `rid` run alone (`alone_case`), its one request renamed `rid`; cached
        like references (shrinking re-runs the same requests)."""
        alone = alone_case(case, rid, r, params, forced)
        key = alone.to_json() + repr(forced)
        if key not in self.alone_cache:
            try:
                trace = self._run(alone, {"r0": list(forced)})
            except Violation as v:  # the Case's failure: its reproducer is the Case, not this run
                v.case = case
                v.message = f"request {rid} run alone: {v.message}"
                v.args = (v.message,)
                raise
            trace.fa_records = []
            trace.tokens = {rid: trace.tokens.get("r0", [])}
            self.alone_cache[key] = trace
            if len(self.alone_cache) > REFERENCE_CACHE_SIZE:
                self.alone_cache.popitem(last=False)
        return self.alone_cache[key]

    def oracle_traces(self, case: Case, forced: dict, transformers: bool = False) -> tuple[dict, Tolerance]:
        """The sequence oracles' traces for `case` teacher-forced with `forced` (solo, and
        transformers when asked), and the tolerance they and the reference are judged with:
        in half precision the noise measured by solo in the test dtype against solo32."""
        cfg, ref_cfg = case.config, reference_config(case.config)
        traces = {"solo": self.solo.trace(ref_cfg, case.workload, forced)}
        noise = None
        if is_half(cfg.dtype):  # the baseline: plain arithmetic in the test dtype
            noise = Tolerance.measure(self.solo.trace(cfg, case.workload, forced), traces["solo"])
        if transformers and self.transformers is not None:
            traces["transformers"] = self.transformers.trace(ref_cfg, case.workload, forced)
        return traces, Tolerance(cfg.dtype, cfg.hidden_size, noise)

    def _transformers_due(self) -> bool:
        if self.transformers is None:
            return False
        return "transformers" in self.always or \
            self.transformers.seconds <= TRANSFORMERS_SHARE * self.check_seconds

    def _second_opinion(self, case: Case, test: Trace, forced: dict, tol: Tolerance) -> str | None:
        if self.transformers is None:
            return None
        tf = self.transformers.trace(reference_config(case.config), case.workload, forced)
        try:
            r = check_logits(case, tf, test, tol, "transformers")
        except Violation as w:
            return f"transformers also fails: {w.message}"
        return f"transformers passes (error/tolerance {r.ratio:.3g})"

    def clear_caches(self) -> None:
        """Forget cached references and oracle results, and the engine's process-wide caches
        of graph traces and attention launch plans (each bounded; tests measure memory)."""
        from engine import cpu_graph
        from engine.attention import reference

        self.ref_cache.clear()
        self.alone_cache.clear()
        for oracle in (self.solo, self.transformers):
            if oracle is not None:
                oracle.results.clear()
        cpu_graph.clear_templates()
        reference.clear_plans()

    def close(self) -> None:
        self.pool.close()
