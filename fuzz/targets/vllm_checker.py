"""What is checked when a Case runs on vLLM (`VLLMChecker`), and the Violations it raises.

Properties (each a `fuzz.properties.Violation`, so shrinking and reproducers work)
-------------------------------------------------------------------------------
- `vllm_crash` / `vllm_hang`: any exception or dead process / no reply within the bound.
- `vllm_greedy`: the sampled token is the top-1 of vLLM's own logprobs.
- `vllm_vs_reference`: against our reference engine (tp1pp1, eager, fp32) on the same
  checkpoint, by `fuzz.targets.compare_runs`: greedy tokens equal where the reference's
  margin is comfortable, logprobs of every token in both top-k lists within `lp_tol`.
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
from dataclasses import dataclass, field

from engine.config import EngineConfig
from fuzz.case import Case, RequestSpec, Workload
from fuzz.properties import Violation
from fuzz.tolerance import logits_tolerance
from fuzz.targets import (CompareReport, ReferenceTarget, RequestResult, RunMismatch, TargetFailure, TargetRun,
                          TargetUnavailable, TeacherForcedReport, TransformersOracle, check_greedy,
                          check_teacher_forced, compare_runs, request_items)
from fuzz.targets.vllm_target import VLLM_MODEL, VLLMOptions, VLLMTarget, checkpoint_dir


class VLLMCrash(Violation):
    property = "vllm_crash"

    def __init__(self, failure: TargetFailure, case: Case | None = None) -> None:
        super().__init__(f"{failure.signature} | {failure.kind}: {failure.detail}", case)
        self.signature, self.kind, self.log_path = failure.signature, failure.kind, failure.log_path


class VLLMHang(VLLMCrash):
    property = "vllm_hang"


class VLLMGreedy(Violation):
    property = "vllm_greedy"


class VLLMvsReference(Violation):
    property = "vllm_vs_reference"


class VLLMBatchInvariance(Violation):
    property = "vllm_batch_invariance"


class VLLMvsTransformers(Violation):
    property = "vllm_vs_transformers"


def logprob_tolerance(cfg: EngineConfig, absmax: float) -> float:
    return 4.0 * logits_tolerance(cfg.torch_dtype(), cfg.hidden_size, absmax)


@dataclass
class VLLMVerdict:
    case: Case
    vs_reference: CompareReport
    batch: CompareReport | None
    vs_transformers: TeacherForcedReport | None
    lp_tol: float
    seconds: float
    vllm_seconds: float
    solo_runs: int = 0
    notes: list = field(default_factory=list)


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

    def _vllm(self, case: Case, opts: VLLMOptions, items=None, prompt_logprobs: bool = False) -> TargetRun:
        try:
            return self.target.run(case, opts, items, prompt_logprobs=prompt_logprobs)
        except TargetFailure as f:
            raise violation_for(f, case) from None

    def check(self, case: Case, opts: VLLMOptions = VLLMOptions()) -> VLLMVerdict:
        case.validate()
        t0 = time.perf_counter()
        ref = self.reference.run(case)
        lp_tol = logprob_tolerance(case.config, self.reference.logit_absmax(case))
        want_plp = self.hf is not None and self.prompt_logprobs and not opts.enable_prefix_caching
        test = self._vllm(case, opts, prompt_logprobs=want_plp)
        vllm_s = test.seconds
        try:
            check_greedy(test.results, lp_tol, "vLLM")
        except RunMismatch as e:
            raise VLLMGreedy(str(e), case) from None
        try:
            rep = compare_runs(ref.results, test.results, lp_tol=lp_tol, margin_tol=lp_tol,
                               oracle_name="reference", test_name="vLLM")
        except RunMismatch as e:
            raise VLLMvsReference(str(e), case, e.ratio) from None
        hf = None
        if self.hf is not None:
            prompts = {rid: r.prompt_token_ids for rid, r in request_items(case)}
            try:
                hf = check_teacher_forced(self.hf, checkpoint_dir(case.config), prompts, test.results,
                                          lp_tol=lp_tol, margin_tol=lp_tol, name="vLLM")
            except RunMismatch as e:
                raise VLLMvsTransformers(str(e), case, e.ratio) from None
        batch, n_solo = None, 0
        if self.batch_invariance and len(case.workload.requests) > 1:
            solo: dict[str, RequestResult] = {}
            key0 = self.target.engine_key(case.config, opts)
            for rid, r in request_items(case):
                k = key0 + json.dumps([r.prompt_token_ids, r.max_tokens])
                if k not in self._solo:
                    run = self._vllm(case, opts, [(rid, RequestSpec(r.prompt_token_ids, r.max_tokens, 0))])
                    vllm_s += run.seconds
                    n_solo += 1
                    if len(self._solo) >= self._solo_cap:
                        self._solo.pop(next(iter(self._solo)))
                    self._solo[k] = run.results[rid]
                solo[rid] = self._solo[k]
            try:
                batch = compare_runs(solo, test.results, lp_tol=lp_tol, margin_tol=lp_tol,
                                     oracle_name="vLLM alone", test_name="vLLM in the batch")
            except RunMismatch as e:
                raise VLLMBatchInvariance(str(e), case, e.ratio) from None
        return VLLMVerdict(case, rep, batch, hf, lp_tol, time.perf_counter() - t0, vllm_s, n_solo)

    def close(self) -> None:
        self.target.close()
        self.reference.close()


def vllm_case(workload: Workload | list[tuple[list[int], int]], base: EngineConfig = VLLM_MODEL, **changes) -> Case:
    """A Case on the vLLM model: `vllm_case([([1, 2, 3], 4)], layout="tp1pp2")`."""
    if not isinstance(workload, Workload):
        workload = Workload(tuple(RequestSpec(tuple(p), n) for p, n in workload))
    return Case(base.replace(**changes) if changes else base, workload)
