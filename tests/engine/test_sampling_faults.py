"""The sampling faults change outputs, and the checks that do not share the engine's sampling
code catch them: the independent sampler (fuzz/verdict/oracles/sampling.py) and the draws of
the request run alone with the same seed."""
from __future__ import annotations

import pytest
from sampling_testutil import SReq, prompt_of, run, tokens

from engine import EngineConfig, LLMEngine
from engine.faults import FAULTS
from engine.sample.sampling_params import SamplingParams
from fuzz.verdict.oracles.sampling import check_trace, compare_noise

BASE = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=96)
PENALISED = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)


def test_faults_are_registered():
    assert {"sampling_penalty_stale_row", "sampling_generator_advanced_unsampled"} <= set(FAULTS)


def test_penalty_stale_row_is_caught_by_the_independent_sampler():
    """N-gram drafting makes r2's decode a multi-token row, scheduled before r1's plain
    decode: reorder_batch swaps them, and with the fault r2's penalties read r1's row's counts."""
    reqs = [SReq("r0", (0, 2, 4, 3, 3, 2, 3, 2, 4), 5, PENALISED, 1), SReq("r1", (1, 0, 4, 2, 4), 9, None, 1),
            SReq("r2", (0, 5, 0, 5, 2), 7, PENALISED, 0)]
    prompts = {r.req_id: list(r.prompt) for r in reqs}
    e = LLMEngine(BASE.replace(max_num_batched_tokens=16, speculative_method="ngram", num_speculative_tokens=3))
    try:
        clean = run(e, reqs)
        faulty = run(e, reqs, faults=("sampling_penalty_stale_row",))
    finally:
        e.shutdown()
    assert not check_trace(clean, prompts)
    assert tokens(faulty, "r2") != tokens(clean, "r2")
    problems = check_trace(faulty, prompts)
    assert len(problems) == 1 and problems[0].startswith("sampling: request r2 output 3 (step 4): logprob of token")


@pytest.mark.parametrize("layout", ["tp1pp1", "tp1pp2"])
def test_generator_advanced_unsampled_is_caught_by_the_run_alone(layout):
    """The target's 29-token prompt takes two steps at a budget of 16: with the fault its
    generator also draws on the first, so its draws (and tokens) leave those of the same
    request prefilled in one step."""
    target = SReq("t", prompt_of("target", 29), 8, SamplingParams(temperature=1.0, seed=5))
    e = LLMEngine(BASE.replace(layout=layout))
    try:
        alone = run(e, [target])
        chunked = BASE.replace(layout=layout, max_num_batched_tokens=16)
        clean = run(e, [target], scheduler_config=chunked)
        faulty = run(e, [target], faults=("sampling_generator_advanced_unsampled",), scheduler_config=chunked)
        unchunked_faulty = run(e, [target], faults=("sampling_generator_advanced_unsampled",))
    finally:
        e.shutdown()
    assert not compare_noise(clean, alone) and tokens(clean, "t") == tokens(alone, "t")
    assert not compare_noise(unchunked_faulty, alone), "without a partial prefill the fault is silent"
    assert compare_noise(faulty, alone) == [
        "sampling: request t output 0: its random draw differs from the reference's (the generator is out of step)"]
    assert tokens(faulty, "t") != tokens(alone, "t")
    assert not check_trace(faulty, {"t": list(target.prompt)}), "each draw is still a valid draw"
