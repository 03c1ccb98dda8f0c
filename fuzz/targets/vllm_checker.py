"""What is checked when a Case runs on vLLM (`VLLMChecker`), and the Violations it raises.

Properties (each in fuzz.properties' Violation tree, so shrinking and reproducers work)
-----------------------------------------------------------------------------------
- `vllm_crash` / `vllm_hang`: any exception or dead process / no reply within the bound.
- `vllm_greedy`: the sampled token is the top-1 of vLLM's own logprobs.
- `vllm_vs_reference`: against our reference engine (tp1pp1, eager, fp32) on the same
  checkpoint, by `fuzz.targets.compare_runs`: greedy tokens equal where the reference's
  margin is comfortable, logprobs of every token in both top-k lists within `lp_tol`.
- `vllm_draft`: with n-gram speculation, every draft vLLM's proposer made equals the one
  the request's token history implies (fuzz.targets.vllm_drafts); acceptance is counted
  per cell (`draft_stats`).
- `vllm_batch_invariance`: each request alone (a fresh workload of one request on the same
  engine) vs in the mixed batch, same comparison with the solo run as the oracle.
- `vllm_vs_transformers`: `transformers`' LlamaForCausalLM on the same checkpoint directory,
  teacher-forced on vLLM's own tokens (`fuzz.targets.check_teacher_forced`): each generated
  token is transformers' argmax up to the tolerance (a near-tie), every top-k logprob and
  every prompt logprob (vLLM's `prompt_logprobs`, asked for unless prefix caching is on)
  within `lp_tol`. On when `transformers` imports (`VLLMChecker(transformers=...)`).

Tolerance: `logprob_tolerance(cfg, absmax)` = 4 x `fuzz.tolerance.logits_tolerance` (the
dtype-derived logits bound; a logprob is a logit minus a logsumexp, so its error is at
most about twice the logits error, and a factor 2 more covers vLLM's different GEMM and
attention kernels). For the default fp32 model that is ~4e-4 nats; the differences
measured between vLLM and the reference are ~1e-6 (see docs/vllm.md).
"""
from __future__ import annotations

import json
import time

from engine.config import EngineConfig
from fuzz.case import Case, RequestSpec, Workload
from fuzz.harness import Verdict
from fuzz.properties import CrashViolation, EngineViolation, LivenessViolation, LogitsMismatch, LogitsReport
from fuzz.tolerance import logits_tolerance
from fuzz.targets import (CompareReport, ReferenceTarget, RequestResult, RunMismatch, TargetFailure, TargetRun,
                          TargetUnavailable, TeacherForcedReport, TransformersOracle, check_greedy,
                          check_teacher_forced, compare_runs, request_items)
from fuzz.targets.vllm_drafts import DraftStats, check_drafts
from fuzz.targets.vllm_target import VLLM_MODEL, VLLMOptions, VLLMTarget, checkpoint_dir


# Each property is a kind of the reference engine's (crash, liveness, engine invariant,
# logits), under its own name: reproducers are filed by it, and old ones name it.
class VLLMCrash(CrashViolation):
    property = "vllm_crash"

    def __init__(self, failure: TargetFailure, case: Case | None = None) -> None:
        super().__init__(f"{failure.signature} | {failure.kind}: {failure.detail}", case)
        self.signature, self.kind, self.log_path = failure.signature, failure.kind, failure.log_path


class VLLMHang(VLLMCrash, LivenessViolation):
    property = "vllm_hang"


class VLLMGreedy(EngineViolation):
    property = "vllm_greedy"


class VLLMvsReference(LogitsMismatch):
    property = "vllm_vs_reference"


class VLLMBatchInvariance(LogitsMismatch):
    property = "vllm_batch_invariance"


class VLLMvsTransformers(LogitsMismatch):
    property = "vllm_vs_transformers"


class VLLMDraft(EngineViolation):
    """An n-gram draft that differs from what the token history implies (fuzz.targets.vllm_drafts);
    greedy verification keeps the output right, so no other property sees it."""

    property = "vllm_draft"


def logprob_tolerance(cfg: EngineConfig, absmax: float) -> float:
    return 4.0 * logits_tolerance(cfg.torch_dtype(), cfg.hidden_size, absmax)


class VLLMVerdict(Verdict):
    """fuzz.harness.Verdict of a vLLM run: `logits` is the comparison with the reference in
    nats of logprob (max |Δ logprob| against the tolerance), `oracles` every comparison by
    oracle name (reference, vllm-solo, transformers); the properties name them."""

    __slots__ = ()

    @property
    def vs_reference(self) -> CompareReport:
        return self.oracles["reference"]

    @property
    def batch(self) -> CompareReport | None:
        return self.oracles.get("vllm-solo")

    @property
    def vs_transformers(self) -> TeacherForcedReport | None:
        return self.oracles.get("transformers")

    @property
    def lp_tol(self) -> float:
        return self.logits.tolerance


def violation_for(failure: TargetFailure, case: Case) -> VLLMCrash:
    return (VLLMHang if failure.kind == "hang" else VLLMCrash)(failure, case)


class VLLMChecker:
    """Runs a Case on vLLM and checks every property above; raises the first Violation.

    `transformers`: None (default) uses the transformers oracle when `transformers` is
    importable here, True requires it, False skips it. `prompt_logprobs`: ask vLLM for top-k
    prompt logprobs in the batch run and check them against transformers, except with prefix
    caching on (vLLM does not read the prefix cache for a request that asks for them, which
    would hide what is under test)."""

    def __init__(self, target: VLLMTarget | None = None, reference: ReferenceTarget | None = None,
                 batch_invariance: bool = True, solo_cache_size: int = 4096, transformers: bool | None = None,
                 prompt_logprobs: bool = True) -> None:
        self.target = target or VLLMTarget()
        self.reference = reference or ReferenceTarget()
        self.batch_invariance = batch_invariance
        if transformers is None:
            transformers = TransformersOracle.available()
        elif transformers and not TransformersOracle.available():
            raise TargetUnavailable("package transformers is not installed (pip install transformers)")
        self.hf = TransformersOracle() if transformers else None
        self.prompt_logprobs = prompt_logprobs
        self._solo: dict[str, RequestResult] = {}
        self._solo_cap = solo_cache_size
        self.draft_stats: dict[str, DraftStats] = {}  # per cell name: drafts, acceptance

    def _vllm(self, case: Case, opts: VLLMOptions, items=None, prompt_logprobs: bool = False) -> TargetRun:
        try:
            return self.target.run(case, opts, items, prompt_logprobs=prompt_logprobs)
        except TargetFailure as f:
            raise violation_for(f, case) from None

    def check(self, case: Case, opts: VLLMOptions | None = None) -> VLLMVerdict:
        """Run `case` on vLLM (with `opts` instead of the Case's own options, if given)."""
        if opts is not None or case.target != "vllm":
            case = (opts or VLLMOptions.of(case)).on(case)
        opts = VLLMOptions.of(case)
        case.validate()
        t0 = time.perf_counter()
        ref = self.reference.run(case)
        lp_tol = logprob_tolerance(case.config, self.reference.logit_absmax(case))
        want_plp = self.hf is not None and self.prompt_logprobs and not opts.enable_prefix_caching
        test = self._vllm(case, opts, prompt_logprobs=want_plp)
        try:
            check_greedy(test.results, lp_tol, "vLLM")
        except RunMismatch as e:
            raise VLLMGreedy(str(e), case) from None
        try:
            oracles = {"reference": compare_runs(ref.results, test.results, lp_tol=lp_tol, margin_tol=lp_tol,
                                                 oracle_name="reference", test_name="vLLM")}
        except RunMismatch as e:
            raise VLLMvsReference(str(e), case, e.ratio, "reference") from None
        if self.hf is not None:
            prompts = {rid: r.prompt_token_ids for rid, r in request_items(case)}
            try:
                oracles["transformers"] = check_teacher_forced(self.hf, checkpoint_dir(case.config), prompts,
                                                               test.results, lp_tol=lp_tol, margin_tol=lp_tol,
                                                               name="vLLM")
            except RunMismatch as e:
                raise VLLMvsTransformers(str(e), case, e.ratio, "transformers") from None
        self._check_drafts(case, opts, test)
        vllm_s = test.seconds
        if self.batch_invariance and len(case.workload.requests) > 1:
            oracles["vllm-solo"], solo_s = self._batch_invariance(case, opts, test, lp_tol)
            vllm_s += solo_s
        rep = oracles["reference"]
        return VLLMVerdict(case, LogitsReport("reference", rep.max_lp_error, lp_tol, rep.positions), oracles, 0,
                           test.steps, 0, len(case.workload.requests), time.perf_counter() - t0, vllm_s)

    def _check_drafts(self, case: Case, opts: VLLMOptions, test: TargetRun) -> None:
        """`vllm_draft`: the batch run's n-gram drafts (recorded in the worker) recomputed
        from each request's prompt + output with the proposer's parameters (llm_kwargs)."""
        from fuzz.targets.vllm_target import cell_name, llm_kwargs

        cfg = case.config
        if cfg.speculative_method != "ngram":
            return
        sc = llm_kwargs(cfg, opts)["speculative_config"]
        full = {rid: tuple(r.prompt_token_ids) + tuple(test.results[rid].token_ids)
                for rid, r in request_items(case) if rid in test.results}
        st = check_drafts(getattr(self.target, "last_drafts", {}) or {}, full, cfg.num_speculative_tokens,
                          sc["prompt_lookup_min"], sc["prompt_lookup_max"], cfg.max_model_len)
        self.draft_stats.setdefault(cell_name(cfg, opts), DraftStats()).add(st)
        if st.mismatches:
            raise VLLMDraft(f"{st.mismatches} of {st.proposals} n-gram drafts differ from the token history's: "
                            + "; ".join(st.examples), case)

    def _batch_invariance(self, case: Case, opts: VLLMOptions, test: TargetRun, lp_tol: float):
        """Each request alone (cached by engine and request) against the batch run: the
        comparison and the seconds vLLM spent on solo runs."""
        solo: dict[str, RequestResult] = {}
        key0, seconds = self.target.engine_key(case.config, opts), 0.0
        for rid, r in request_items(case):
            k = key0 + json.dumps([r.prompt_token_ids, r.max_tokens])
            if k not in self._solo:
                run = self._vllm(case, opts, [(rid, RequestSpec(r.prompt_token_ids, r.max_tokens, 0))])
                seconds += run.seconds
                if len(self._solo) >= self._solo_cap:
                    self._solo.pop(next(iter(self._solo)))
                self._solo[k] = run.results[rid]
            solo[rid] = self._solo[k]
        try:
            return compare_runs(solo, test.results, lp_tol=lp_tol, margin_tol=lp_tol, oracle_name="vLLM alone",
                                test_name="vLLM in the batch"), seconds
        except RunMismatch as e:
            raise VLLMBatchInvariance(str(e), case, e.ratio, "vllm-solo") from None

    def close(self) -> None:
        self.target.close()
        self.reference.close()


def vllm_case(workload: Workload | list[tuple[list[int], int]], base: EngineConfig = VLLM_MODEL,
              opts: VLLMOptions = VLLMOptions(), **changes) -> Case:
    """A Case for vLLM on the vLLM model: `vllm_case([([1, 2, 3], 4)], layout="tp1pp2")`."""
    if not isinstance(workload, Workload):
        workload = Workload(tuple(RequestSpec(tuple(p), n) for p, n in workload))
    return opts.on(Case(base.replace(**changes) if changes else base, workload))
