"""The precision-aware logits rule: bf16 runs are judged against measured noise, so a bug that
the old ε × max|logit| bound hid (a pipeline stage skipping a whole layer) fails, while the
clean bf16 run of the same Case passes with room."""
from __future__ import annotations

import pytest
import torch

from fuzz.cases.case import Case, RequestSpec, Workload, reference_config
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import LogitsMismatch
from fuzz.cases.strategies import FUZZ_MODEL, tokens_from_seed
from fuzz.verdict.tolerance import HALF_RULES, Tolerance, logits_tolerance


def _case(dtype: str, faults=()) -> Case:
    reqs = (RequestSpec(tokens_from_seed(3, 11, 128), 4), RequestSpec(tokens_from_seed(4, 6, 128), 3))
    return Case(FUZZ_MODEL.replace(layout="tp1pp3", dtype=dtype), Workload(reqs), faults=tuple(faults))


@pytest.fixture(scope="module")
def harness():
    h = Harness(4)
    yield h
    h.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_skipped_layer_fails_in_half_precision_and_the_clean_run_passes(harness, dtype) -> None:
    v = harness.check(_case(dtype))
    assert v.logits.ratio < 0.5, v.oracles
    with pytest.raises(LogitsMismatch) as e:
        harness.check(_case(dtype, ["pp_uneven_partition"]))
    assert e.value.error_ratio > 4, e.value.message
    if dtype == "bfloat16":  # the old bound, 2 x 16 eps sqrt(hidden) max|logit|, passed it
        case = _case(dtype, ["pp_uneven_partition"])
        ref = harness.reference(case)
        test = harness._run(case, ref.output_token_ids())
        old = max(float((t.logits - r.logits).abs().max()) /
                  logits_tolerance(torch.bfloat16, 64, float(r.logits.abs().max()))
                  for rid in ref.tokens for r, t in zip(ref.tokens[rid], test.tokens[rid]))
        assert old < 1.0


def test_the_reference_is_float32_on_the_half_runs_weights() -> None:
    ref = reference_config(FUZZ_MODEL.replace(dtype="bfloat16", speculative_method="ngram",
                                              num_speculative_tokens=2))
    assert (ref.dtype, ref.weights_dtype, ref.speculative_method) == ("float32", "bfloat16", "none")
    from engine.weights import load_state_dict

    w32 = load_state_dict(ref)["lm_head.weight"]
    w16 = load_state_dict(FUZZ_MODEL.replace(dtype="bfloat16"))["lm_head.weight"]
    assert w32.dtype == torch.float32 and torch.equal(w32, w16.float())


def test_noise_is_the_largest_baseline_error_of_each_request() -> None:
    from engine.llm_engine import TokenRecord, Trace

    def trace(rows):
        t = Trace()
        t.tokens["r0"] = [TokenRecord(0, 0, torch.tensor(r), 0, 0) for r in rows]
        return t

    noise = Tolerance.measure(trace([[1.0, 2.0], [3.0, 4.0]]), trace([[1.1, 2.0], [3.0, 3.5]]))
    assert noise["r0"] == pytest.approx(0.5)
    tol = Tolerance("bfloat16", 64, noise)
    rule = HALF_RULES["bfloat16"]
    assert tol.bound("r0", torch.zeros(2)) == pytest.approx(rule.k * 0.5 + rule.atol)
    assert Tolerance("float32", 64).bound("r0", torch.tensor([3.0])) == logits_tolerance(torch.float32, 64, 3.0)
