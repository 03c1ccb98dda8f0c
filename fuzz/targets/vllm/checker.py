"""What is checked when a Case runs on vLLM (`VLLMChecker`), and the Violations it raises.

`VLLMChecker` is the generic black-box checker (fuzz.targets.blackbox) on a VLLMRunner, under
vLLM's property names, plus vLLM's own n-gram draft check.

Properties (each in fuzz.verdict.properties' Violation tree, so shrinking and reproducers work)
-----------------------------------------------------------------------------------
- `vllm_crash` / `vllm_hang`: any exception or dead process / no reply within the bound.
- `vllm_greedy`: the sampled token is the top-1 of vLLM's own logprobs.
- `vllm_vs_reference`: against our reference engine (tp1pp1, eager, fp32) on the same
  checkpoint, by `fuzz.verdict.compare.compare_runs`: greedy tokens equal where the reference's
  margin is comfortable, logprobs of every token in both top-k lists within `lp_tol`.
- `vllm_sampling`: each sampled token is one its params allow (fuzz.targets.sampled), and a
  seeded random request's is the one vLLM's CPU Gumbel-max draws from its seed
  (fuzz.targets.vllm.gumbel), where no near tie leaves it open.
- `vllm_draft`: with n-gram speculation, every draft vLLM's proposer made equals the one
  the request's token history implies (fuzz.targets.vllm.drafts); acceptance is counted
  per cell (`draft_stats`).
- `vllm_prefix_cache`: every run's reported cached-token counts (`num_cached_tokens`) within
  the harness's own model of the engine's prefix cache over what it served before
  (fuzz.targets.vllm.prefix: never above it; not below it while nothing can have been evicted).
- `vllm_batch_invariance`: each request alone (a fresh workload of one request on the same
  engine) vs in the mixed batch, same comparison with the solo run as the oracle.
- `vllm_vs_transformers`: `transformers`' LlamaForCausalLM on the same checkpoint directory,
  teacher-forced on vLLM's own tokens (`fuzz.verdict.compare.check_teacher_forced`): each generated
  token is transformers' argmax up to the tolerance (a near-tie), every top-k logprob and
  every prompt logprob (vLLM's `prompt_logprobs`, asked for unless prefix caching is on)
  within `lp_tol`. On when `transformers` imports (`VLLMChecker(transformers=...)`).

Tolerance: `logprob_tolerance(cfg, absmax)` = 4 x `fuzz.verdict.tolerance.logits_tolerance` (the
dtype-derived logits bound; a logprob is a logit minus a logsumexp, so its error is at
most about twice the logits error, and a factor 2 more covers vLLM's different GEMM and
attention kernels). For the default fp32 model that is ~4e-4 nats; the differences
measured between vLLM and the reference are ~1e-6 (see docs/vllm.md).
"""
from __future__ import annotations

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.targets.blackbox import (BlackBoxChecker, BlackBoxVerdict, TargetBatchInvariance, TargetCrash, TargetGreedy,
                                   TargetHang, TargetSampling, TargetVsReference, TargetVsTransformers, engine_items,
                                   logprob_tolerance, properties_for)
from fuzz.verdict.properties import EngineViolation
from fuzz.verdict.tolerance import VLLM_HALF_RULES
from fuzz.targets.reference import ReferenceRunner
from fuzz.targets.runs import TargetFailure, TargetRun
from fuzz.targets.vllm.configs import VLLM_MODEL, VLLMOptions, cell_name
from fuzz.targets.vllm.drafts import DraftStats, check_drafts
from fuzz.targets.vllm.launch import llm_kwargs
from fuzz.targets.vllm.runner import VLLMRunner

__all__ = ["VLLMChecker", "VLLMCrash", "VLLMHang", "VLLMGreedy", "VLLMvsReference", "VLLMBatchInvariance",
           "VLLMvsTransformers", "VLLMDraft", "VLLMPrefixCache", "VLLMVerdict", "logprob_tolerance", "violation_for",
           "vllm_case"]


# The generic black-box properties (fuzz.targets.blackbox) under vLLM's names: reproducers are
# filed by them, and committed ones name them.
class VLLMCrash(TargetCrash):
    property = "vllm_crash"


class VLLMHang(VLLMCrash, TargetHang):
    property = "vllm_hang"


class VLLMGreedy(TargetGreedy):
    property = "vllm_greedy"


class VLLMvsReference(TargetVsReference):
    property = "vllm_vs_reference"


class VLLMBatchInvariance(TargetBatchInvariance):
    property = "vllm_batch_invariance"


class VLLMvsTransformers(TargetVsTransformers):
    property = "vllm_vs_transformers"


class VLLMSampling(TargetSampling):
    property = "vllm_sampling"


class VLLMDraft(EngineViolation):
    """An n-gram draft that differs from what the token history implies (fuzz.targets.vllm.drafts);
    greedy verification keeps the output right, so no other property sees it. `signature`:
    how the first draft differed (`vllm_draft:too-long`, ...), one per drafter bug."""

    property = "vllm_draft"
    signature: str | None = None


class VLLMPrefixCache(EngineViolation):
    """A request's reported prefix-cache hit (`num_cached_tokens`) outside what the harness's
    own model of the engine's cache allows (fuzz.targets.vllm.prefix): above it, a hit on KV
    of other tokens or another cache salt (invisible to every output check: the KV is the
    same); below it where nothing can have been evicted, a lost hit. `signature`: which."""

    property = "vllm_prefix_cache"
    signature: str | None = None


PROPERTIES = properties_for("vllm", crash=VLLMCrash, hang=VLLMHang, greedy=VLLMGreedy, vs_reference=VLLMvsReference,
                            batch_invariance=VLLMBatchInvariance, vs_transformers=VLLMvsTransformers,
                            sampling=VLLMSampling)
VLLMVerdict = BlackBoxVerdict  # `batch` is the vllm-solo comparison


def violation_for(failure: TargetFailure, case: Case) -> VLLMCrash:
    return PROPERTIES.failure(failure, case)


LLAMA_DEFAULT_EOS = 2


class VLLMChecker(BlackBoxChecker):
    """fuzz.targets.blackbox.BlackBoxChecker on a VLLMRunner, with vLLM's options and its own
    property: n-gram drafts (`vllm_draft`, counted per cell in `draft_stats`).

    `prompt_logprobs`: ask vLLM for top-k prompt logprobs in the batch run and check them
    against transformers, except with prefix caching on (vLLM does not read the prefix cache
    for a request that asks for them, which would hide what is under test).

    bf16 is checked by the measured-noise rule calibrated on vLLM's CPU kernels
    (fuzz.verdict.tolerance.VLLM_HALF_RULES): |vLLM - oracle| <= k x our engine's bf16 noise on
    the Case + atol; `half_rule=False` falls back to the dtype formula's bound (tens of nats:
    greedy agreement and little more)."""

    half_rules = VLLM_HALF_RULES

    def __init__(self, runner: VLLMRunner | None = None, reference: ReferenceRunner | None = None,
                 batch_invariance: bool = True, solo_cache_size: int = 4096, transformers: bool | None = None,
                 prompt_logprobs: bool = True, half_rule: bool = True) -> None:
        super().__init__(runner or VLLMRunner(), "vllm", reference=reference, batch_invariance=batch_invariance,
                         solo_cache_size=solo_cache_size, transformers=transformers,
                         prompt_logprobs=prompt_logprobs, label="vLLM", props=PROPERTIES, half_rule=half_rule)
        self.draft_stats: dict[str, DraftStats] = {}  # per cell name: drafts, acceptance
        # vLLM's min_tokens masks the model's EOS as well as the stop ids, ignore_eos or not
        # (SamplingParams.update_from_generation_config): our checkpoints' config.json names no
        # EOS, so vLLM takes LlamaConfig's default, 2.
        self.min_tokens_masks = (LLAMA_DEFAULT_EOS,)
        # per cell name: what the batch runs asked and got of the prefix cache, and how they sampled
        self.mix_stats: dict[str, dict[str, int]] = {}
        # the last batch run's Case and the features it reached (`reached`), for Target.record
        self.last_reach: tuple[Case | None, frozenset] = (None, frozenset())

    def check(self, case: Case, opts: VLLMOptions | None = None) -> BlackBoxVerdict:
        """Run `case` on vLLM (with `opts` instead of the Case's own options, if given)."""
        if opts is not None or case.target != "vllm":
            case = (opts or VLLMOptions.of(case)).on(case)
        return super().check(case)

    def run(self, case: Case, items=None, prompt_logprobs: bool = False) -> TargetRun:
        """Every run on vLLM (batch and solo) with its prefix-cache hits judged (`vllm_prefix_cache`)."""
        out = super().run(case, items, prompt_logprobs)
        judged = getattr(self.runner, "last_prefix", None)
        if judged is not None and VLLMOptions.of(case).enable_prefix_caching:
            # How many requests were judged, and how many by equality (the bounds met).
            into = self.mix_stats.setdefault(cell_name(case.config, VLLMOptions.of(case)), {})
            into["cache_judged"] = into.get("cache_judged", 0) + len(judged.requests)
            into["cache_exact"] = into.get("cache_exact", 0) + sum(lo == hi for _, lo, hi in judged.requests.values())
        if judged is not None and (judged.above or judged.below):
            v = VLLMPrefixCache(("reported prefix-cache hits outside the harness's model of the engine's cache: "
                                 + judged.message()), case)
            v.signature = f"vllm_prefix_cache:{'above' if judged.above else 'below'}"
            raise v
        return out

    def wants_prompt_logprobs(self, case: Case) -> bool:
        return super().wants_prompt_logprobs(case) and not VLLMOptions.of(case).enable_prefix_caching

    def check_draws(self, case: Case, rid: str, spec: RequestSpec, rows: list, tokens: list[int], lp_tol: float) -> None:
        """`vllm_sampling`: a seeded random request's tokens are the ones vLLM's CPU Gumbel-max
        draws from its seed (fuzz.targets.vllm.gumbel), wherever the oracle's logits leave no
        near tie; counted per cell ("draws_checked", "draws_near_tie"). Not with speculative
        decoding (the rejection sampler draws otherwise) and not off the CPU (another kernel)."""
        p = spec.sampling
        if p.temperature <= 0 or p.seed is None or case.config.speculative_method != "none" \
                or case.config.device != "cpu":
            return
        from fuzz.targets.vllm.gumbel import check_draws

        bad, checked, ties = check_draws(spec, rows, tokens, lp_tol, self.min_tokens_masks)
        into = self.mix_stats.setdefault(cell_name(case.config, VLLMOptions.of(case)), {})
        into["draws_checked"] = into.get("draws_checked", 0) + checked
        into["draws_near_tie"] = into.get("draws_near_tie", 0) + ties
        if bad is not None:
            raise self.props.sampling(f"request {rid} position {bad[0]}: {bad[1]} (params {p.to_dict()})",
                                      case, None, "vLLM's seeded Gumbel draw")

    def _count_mix(self, case: Case, test: TargetRun, cell: str) -> dict[str, int]:
        into = self.mix_stats.setdefault(cell, {})
        mix = mix_counts(case, test)
        for k, v in mix.items():
            into[k] = into.get(k, 0) + v
        return mix

    def extra_checks(self, case: Case, test: TargetRun) -> None:
        """`vllm_draft`: the batch run's n-gram drafts (recorded in the worker) recomputed
        from each request's prompt + output with the proposer's parameters (llm_kwargs)."""
        cfg, opts = case.config, VLLMOptions.of(case)
        mix = self._count_mix(case, test, cell_name(cfg, opts))
        # What this example reached of its config's features (fuzz.targets.vllm.summary counts
        # a config, and its pairs, only by examples that reached them); drafts added below.
        self.last_reach = (case, reached(case, mix))
        if cfg.speculative_method != "ngram":
            return
        sc = llm_kwargs(cfg, opts)["speculative_config"]
        full = {rid: tuple(r.prompt_token_ids) + tuple(test.results[rid].token_ids)
                for rid, r in engine_items(case) if rid in test.results}
        st = check_drafts(getattr(self.runner, "last_drafts", {}) or {}, full, cfg.num_speculative_tokens,
                          sc["prompt_lookup_min"], sc["prompt_lookup_max"], cfg.max_model_len)
        self.draft_stats.setdefault(cell_name(cfg, opts), DraftStats()).add(st)
        if st.proposals:
            self.last_reach = (case, self.last_reach[1] | {"drafts"})
        if st.mismatches:
            v = VLLMDraft(f"{st.mismatches} of {st.proposals} n-gram drafts differ from the token history's "
                          f"({st.first_kind} first): " + "; ".join(st.examples), case)
            v.signature = f"vllm_draft:{st.first_kind}"
            raise v


def mix_counts(case: Case, test: TargetRun) -> dict[str, int]:
    """What one batch run exercised: prompt tokens and those the prefix cache served
    (vLLM's num_cached_tokens), requests, those with sampling params (random ones apart), and
    the requests aborted while unfinished."""
    items = [(rid, r) for rid, r in engine_items(case) if rid in test.results]
    return {"prompt_tokens": sum(len(r.prompt_token_ids) for _, r in items),
            "cached_tokens": sum(test.results[rid].num_cached_tokens for rid, _ in items),
            "requests": len(items), "sampled": sum(r.sampling is not None for _, r in items),
            "random": sum(r.sampling is not None and r.sampling.temperature > 0 for _, r in items),
            "aborted": len(test.aborted)}


def reached(case: Case, mix: dict[str, int]) -> frozenset:
    """The features one batch run reached (the drafts are the draft check's to add):
    `work` (more than one request, or a prompt of 2+ tokens: not the one-token minimum),
    `hits` (the prefix cache served a token), `abort` (a request aborted while unfinished),
    `sampled` (a request with sampling params ran)."""
    reqs = case.workload.requests
    out = set()
    if len(reqs) > 1 or any(len(r.prompt_token_ids) > 1 for r in reqs):
        out.add("work")
    if mix.get("cached_tokens"):
        out.add("hits")
    if mix.get("aborted"):
        out.add("abort")
    if mix.get("sampled"):
        out.add("sampled")
    return frozenset(out)


def vllm_case(workload: Workload | list[tuple[list[int], int]], base=VLLM_MODEL,
              opts: VLLMOptions = VLLMOptions(), **changes) -> Case:
    """A Case for vLLM on the vLLM model: `vllm_case([([1, 2, 3], 4)], layout="tp1pp2")`."""
    if not isinstance(workload, Workload):
        workload = Workload(tuple(RequestSpec(tuple(p), n) for p, n in workload))
    return opts.on(Case(base.replace(**changes) if changes else base, workload))
