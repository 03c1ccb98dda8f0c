"""Seeded sampling is a property of the request alone: the same seed draws the same noise at
every output index, and samples the same tokens, whether the request runs alone, batched with
others, chunked otherwise, preempted and recomputed, teacher-forced, or in another layout.

Draws are compared bitwise everywhere (a request's generator draws once per token it samples,
whatever else happens). Tokens are compared where the raw logits are bitwise equal: fp32 on
CPU is not batch-invariant (engine/test_batch_invariance.py), and a near-tie in the race may
flip on a last-bit difference; on these workloads none does, so all tokens agree too.
"""
from __future__ import annotations

import pytest
from sampling_testutil import (SReq, assert_same_draws, assert_same_tokens_where_logits_equal, others, prompt_of,
                               run, tokens)

from engine import EngineConfig, LLMEngine
from engine.sample.sampling_params import SamplingParams

# Engines are built for a budget of 64 (the target's prompt in one step); Cases run at 16.
BUILT = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=96)
BASE = BUILT.replace(max_num_batched_tokens=16)
SEEDED = SamplingParams(temperature=1.2, top_p=0.97, seed=1234, presence_penalty=0.5)
UNSEEDED = SamplingParams(temperature=1.5, min_p=0.01)


def target(params=SEEDED, at_step: int = 0, n: int = 29) -> SReq:
    return SReq("t", prompt_of("target", n), 10, params, at_step)


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(BUILT)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def alone(engine):
    """The target alone, its prompt prefilled in one step."""
    return {p: run(engine, [target(p)]) for p in (SEEDED, UNSEEDED)}


MIXES = {
    "same_step": lambda p: others(1, 5) + [target(p)],
    "late_target": lambda p: others(2, 4) + [target(p, at_step=3)],
    "sampled_neighbours": lambda p: others(3, 4, params=SamplingParams(temperature=0.7)) + [target(p, at_step=1)],
    "crowd": lambda p: others(4, 7, at_step=0) + [target(p, at_step=2)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "derived_seed"])
def test_batched_equals_alone(engine, alone, mix, seeded):
    p = SEEDED if seeded else UNSEEDED
    got = run(engine, MIXES[mix](p), scheduler_config=BASE)
    assert_same_draws(alone[p], got, "t")
    assert_same_tokens_where_logits_equal(alone[p], got, "t")
    assert tokens(got, "t") == tokens(alone[p], "t")


@pytest.mark.parametrize("layout", ["tp1pp2", "tp2pp2", "tp1pp4", "tp2pp1"])
def test_every_layout_equals_alone(alone, layout):
    e = LLMEngine(BASE.replace(layout=layout, broadcast_pp_output=layout == "tp1pp2"))
    try:
        got = run(e, MIXES["same_step"](SEEDED))  # built at budget 16: chunked
    finally:
        e.shutdown()
    assert_same_draws(alone[SEEDED], got, "t")
    assert tokens(got, "t") == tokens(alone[SEEDED], "t")


@pytest.mark.parametrize("budget", [4, 7, 16])
def test_chunking_does_not_move_the_generator(engine, alone, budget):
    got = run(engine, [target()], scheduler_config=BASE.replace(max_num_batched_tokens=budget))
    assert_same_draws(alone[SEEDED], got, "t")
    assert tokens(got, "t") == tokens(alone[SEEDED], "t")


def test_preempted_request_resumes_its_generator(engine, alone):
    """A KV pool too small for everyone: the target is preempted, recomputed, and goes on
    drawing where its generator stopped."""
    small = BASE.replace(num_gpu_blocks=18)
    reqs = [SReq(f"p{i}", prompt_of(f"p{i}", 9), 12) for i in range(3)] + [target(at_step=1)]  # newest: the victim
    got = run(engine, reqs, scheduler_config=small)
    assert engine.scheduler.requests["t"].num_preemptions > 0, "the workload must preempt the target"
    assert_same_draws(alone[SEEDED], got, "t")
    assert tokens(got, "t") == tokens(alone[SEEDED], "t")


def test_teacher_forcing_consumes_randomness_as_sampling(engine, alone):
    """Forced to other tokens, the request draws the same noise at every index (its history
    differs, so its tokens may not)."""
    forced = tuple((t + 1) % 128 for t in tokens(alone[SEEDED], "t"))
    got = run(engine, [SReq("t", target().prompt, 10, SEEDED, 0, forced)], scheduler_config=BASE)
    assert tokens(got, "t") == list(forced)
    assert_same_draws(alone[SEEDED], got, "t")
    assert got.tokens["t"][0].sampled == alone[SEEDED].tokens["t"][0].sampled


def test_derived_seed_depends_on_engine_seed_and_id(engine, alone):
    other_id = run(engine, [SReq("u", target().prompt, 10, UNSEEDED)], scheduler_config=BASE)
    assert tokens(other_id, "u") != tokens(alone[UNSEEDED], "t")
    e = LLMEngine(BUILT.replace(seed=1))  # other weights too: only the draws are compared
    try:
        other_seed = run(e, [target(UNSEEDED)])
    finally:
        e.shutdown()
    assert not all(a.noise.equal(b.noise) for a, b in zip(alone[UNSEEDED].tokens["t"], other_seed.tokens["t"]))
