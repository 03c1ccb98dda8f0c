"""A black-box target's requests whose sampling params process the logits (random sampling,
penalties, a logit bias, min_tokens) or stop them: their tokens cannot be compared with the
reference's (another engine draws other random numbers; a near tie may move a stop), so the
reference is teacher-forced on the target's own tokens, and

- `<target>_vs_reference`: the same number of tokens (the reference stops where the params
  say the target's tokens stop: a stop token or sequence, min_tokens, max_tokens), and at
  every position the raw logprobs of the tokens in both top-k lists within the tolerance;
- `<target>_sampling`: each token is one the params allow, by the independent sampler
  (fuzz.verdict.oracles.sampling, which shares no code with either engine) on the
  reference's raw logits row and the token history: a greedy request's token is the argmax
  of the processed logits; a random one's is in the support left by top-k, top-p, min-p,
  the bias and min_tokens (which, on vLLM, masks the model's EOS too). The target's token
  gets the benefit of the tolerance: its raw logit is raised by it first, so another engine's rounding at a threshold is no failure;
- where the target's random draw is known (`checker.check_draws`: vLLM's CPU Gumbel-max,
  fuzz.targets.vllm.gumbel), a seeded request's token is the one its draw gives.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from fuzz.cases.case import Case
from fuzz.verdict.compare import CompareReport
from fuzz.verdict.oracles.sampling import expected_distribution
from fuzz.targets.runs import TargetRun


def check_sampled(checker, case: Case, items: list, plain: set[str], test: TargetRun, lp_tol: float) -> CompareReport:
    """Both properties above for the requests of `items` not in `plain`; the comparison."""
    sampled = {rid: spec for rid, spec in items if rid not in plain}
    forced = {rid: list(test.results[rid].token_ids) for rid in sampled if rid in test.results}
    ref = checker.reference.run(case, forced)
    rep = checker._compare({rid: ref.results[rid] for rid in sampled}, test.results, lp_tol, case, "reference",
                           checker.props.vs_reference, "reference (teacher-forced)")
    trace = checker.reference.trace(case, forced)
    for rid, spec in sampled.items():
        bad = first_disallowed(spec, [rec.logits for rec in trace.tokens[rid]], forced[rid], lp_tol,
                               getattr(checker, "min_tokens_masks", ()))
        if bad is not None:
            raise checker.props.sampling(f"request {rid} position {bad[0]}: {checker.label} chose token "
                                         f"{forced[rid][bad[0]]}, {bad[1]} (params {spec.sampling.to_dict()})",
                                         case, None, "sampling")
        checker.check_draws(case, rid, spec, [rec.logits for rec in trace.tokens[rid]], forced[rid], lp_tol)
    return rep


def first_disallowed(spec, rows, tokens: list[int], tol: float, min_tokens_masks=()) -> tuple[int, str] | None:
    """(position, why) of the first token `spec.sampling` does not allow, or None.
    `min_tokens_masks`: tokens the target masks under min_tokens besides the stop ids (vLLM:
    the model's EOS, even with ignore_eos)."""
    params, prompt = masked_under_min_tokens(spec.sampling, min_tokens_masks), list(spec.prompt_token_ids)
    for i, (row, tok) in enumerate(zip(rows, tokens)):
        exp = raised(row.double().numpy(), tok, tol, params, prompt, tokens[:i])
        if not (exp.keep[tok] or exp.borderline[tok]):
            return i, f"which {exp.masked_by.get(tok, 'the params')} excludes"
        if exp.greedy:
            best = float(np.max(np.where(exp.keep, exp.z, -np.inf)))
            if exp.z[tok] < best:
                return i, (f"not the argmax of the processed logits ({int(np.argmax(np.where(exp.keep, exp.z, -np.inf)))}"
                           f" leads by {best - exp.z[tok]:.3g} beyond the tolerance)")
    return None


def raised(raw: np.ndarray, tok: int, tol: float, params, prompt: list[int], output: list[int]):
    """The expected distribution with token `tok`'s raw logit raised by `tol`: the allowance a
    target's token gets, so that another engine's rounding at a mask's threshold is no failure."""
    up = raw.copy()
    up[tok] += tol
    return expected_distribution(up, params, prompt, output)


def masked_under_min_tokens(params, min_tokens_masks=()):
    """`params` as the sampler masks under min_tokens: the stop ids and `min_tokens_masks` (for
    the masking only: the request still stops on its own ids)."""
    if params.min_tokens and min_tokens_masks:
        return replace(params, stop_token_ids=tuple(sorted(set(params.stop_token_ids) | set(min_tokens_masks))))
    return params
