"""Sampling parameters: validation, the default is today's greedy bit for bit, stops,
min_tokens, logprobs, parallel sampling (n > 1) and speculative decoding's greedy-only policy."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sampling_testutil import SReq, forced_like, others, prompt_of, run, tokens

from engine import ConfigError, EngineConfig, LLMEngine
from engine.sample.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import RequestStatus
from fuzz.verdict.oracles.sampling import check_prompt_logprobs, check_trace

BASE = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16, max_model_len=64, num_gpu_blocks=96)
SIZES = (4, 8, 16)
RANDOM = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(BASE)
    yield e
    e.shutdown()


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=0.001), "temperature"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"), (dict(seed=-1), "seed"), (dict(n=0), "n"),
    (dict(n=2), "n"), (dict(stop_sequences=((),)), "stop_sequences"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(temperature=float("nan")), "temperature")])
def test_invalid_params_are_one_line_errors(kwargs, field):
    with pytest.raises(SamplingParamsError, match=rf"^SamplingParams\.{field}") as e:
        SamplingParams(**kwargs)
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)


def test_params_normalise_and_round_trip():
    p = SamplingParams(top_k=5, top_p=0.5, min_p=0.1)  # greedy: the random knobs are unused
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0) and not p.processes_logits
    q = SamplingParams(temperature=0.7, logit_bias={9: -1.0, 2: 0.5}, stop_sequences=[[1, 2]], seed=3, n=2)
    assert q.logit_bias == ((2, 0.5), (9, -1.0)) and SamplingParams.from_dict(q.to_dict()) == q
    assert SamplingParams().to_dict() == {} and hash(q) == hash(SamplingParams.from_dict(q.to_dict()))
    assert [c.seed for c in (q.child(0), q.child(1))] == [3, 4]


def test_add_request_refusals(engine):
    engine.reset()
    with pytest.raises(ConfigError, match="outside vocab_size"):
        engine.add_request("a", [1], 2, sampling_params=SamplingParams(stop_token_ids=(128,)))
    with pytest.raises(ConfigError, match="contradicts max_tokens"):
        engine.add_request("a", [1], 2, sampling_params=SamplingParams(max_tokens=3))
    engine.add_request("0_b", [1], 2)
    with pytest.raises(ConfigError, match="child id 0_b is taken"):
        engine.add_request("b", [1], 2, sampling_params=SamplingParams(temperature=1.0, n=2))
    engine.reset(scheduler_config=BASE.replace(speculative_method="ngram", num_speculative_tokens=2))
    with pytest.raises(ConfigError, match="verifies greedily"):
        engine.add_request("a", [1], 2, sampling_params=RANDOM)
    engine.add_request("g", [1], 2, sampling_params=SamplingParams(repetition_penalty=1.2))  # greedy: served


def _workload(params=None) -> list[SReq]:
    return others(0, 5, params=params) + [SReq("t", prompt_of("t", 23), 6, params, 1)]


@pytest.mark.parametrize("layout", ["tp1pp1", "tp2pp2", "tp1pp4"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_default_params_are_plain_greedy_bitwise(layout, mode):
    """SamplingParams() is the engine without sampling: same raw logits, argmax tokens, nothing
    recorded besides, in every layout and mode."""
    cfg = BASE.replace(layout=layout)
    if mode == "graph":
        cfg = cfg.replace(cudagraph_mode="FULL", capture_sizes=SIZES)
    e = LLMEngine(cfg)
    try:
        plain = run(e, _workload())
        explicit = run(e, _workload(SamplingParams()))
    finally:
        e.shutdown()
    assert not explicit.sampling_params and not explicit.prompt_logprobs
    for rid, recs in plain.tokens.items():
        assert len(recs) == len(explicit.tokens[rid])
        for a, b in zip(recs, explicit.tokens[rid]):
            assert torch.equal(a.logits, b.logits) and a.token == b.token == b.sampled == int(b.logits.argmax())
            assert b.logprobs is None and b.noise is None and b.top_logprobs is None


@pytest.mark.parametrize("layout", ["tp1pp1", "tp2pp2"])
def test_plain_rows_are_untouched_beside_sampled_rows(layout):
    """Batched with processed rows (forced to the same tokens, so the batches are equal), a
    default request samples exactly what it samples among default requests."""
    e = LLMEngine(BASE.replace(layout=layout))
    try:
        plain = _workload()
        ref = run(e, plain)
        mixed = [r if i % 2 else SReq(r.req_id, r.prompt, r.max_tokens, RANDOM, r.at_step)
                 for i, r in enumerate(plain)]
        got = run(e, forced_like(mixed, ref))
    finally:
        e.shutdown()
    for i, r in enumerate(mixed):
        for a, b in zip(ref.tokens[r.req_id], got.tokens[r.req_id]):
            assert torch.equal(a.logits, b.logits), r.req_id
            if r.params is None:
                assert a.sampled == b.sampled and b.logprobs is None


def test_stop_token_id_and_sequence_finish_the_request(engine):
    base = tokens(run(engine, [SReq("g", prompt_of("g", 9), 12)]), "g")
    stop_id = base[4]
    first = base.index(stop_id)
    seq = tuple(base[2:4])
    tr = run(engine, [SReq("a", prompt_of("g", 9), 12, SamplingParams(stop_token_ids=(stop_id,))),
                      SReq("b", prompt_of("g", 9), 12, SamplingParams(stop_sequences=((99, 98, 97), seq))),
                      SReq("c", prompt_of("g", 9), 12, SamplingParams(stop_token_ids=(stop_id,), min_tokens=first + 2))])
    assert tokens(tr, "a") == base[:first + 1] and tr.stop_reasons["a"] == stop_id
    assert tokens(tr, "b") == base[:4] and tr.stop_reasons["b"] == seq
    reqs = engine.scheduler.requests
    assert reqs["a"].status is RequestStatus.FINISHED_STOPPED and RequestStatus.is_finished(reqs["a"].status)
    # min_tokens: the stop id is suppressed for the first min_tokens outputs, so the request goes on.
    c = tokens(tr, "c")
    assert stop_id not in c[:first + 2] and len(c) > first + 1
    assert all(torch.isneginf(r.logprobs[stop_id]) for r in tr.tokens["c"][:first + 2])
    assert not check_trace(tr, {rid: list(prompt_of("g", 9)) for rid in "abc"})


def test_logprobs_and_prompt_logprobs(engine):
    from fuzz.verdict.oracles.solo import SoloOracle
    p = SamplingParams(temperature=0.8, seed=1, logprobs=3, prompt_logprobs=2)
    prompt = prompt_of("lp", 37)  # over the budget of 16: three prefill chunks
    tr = run(engine, [SReq("a", prompt, 5, p)] + others(1, 3))
    for rec in tr.tokens["a"]:
        assert rec.sampled in rec.top_logprobs and len(rec.top_logprobs) in (3, 4)
        best = rec.logprobs.topk(3).indices.tolist()
        assert set(best) <= set(rec.top_logprobs)
    pl = tr.prompt_logprobs["a"]
    assert len(pl) == len(prompt) and pl[0] is None and all(prompt[i] in pl[i] for i in range(1, len(prompt)))
    rows = SoloOracle().request_logits(BASE, prompt[:1], prompt[1:] + (0,))  # rows predicting prompt[1:]
    assert check_prompt_logprobs(pl, rows.double().numpy(), list(prompt)) is None
    assert not check_trace(tr, {"a": list(prompt)})


def test_prompt_logprobs_skip_the_prefix_cache():
    """A cache hit would skip the prompt positions whose logprobs are wanted (vLLM skips it too)."""
    e = LLMEngine(BASE.replace(enable_prefix_caching=True))
    prompt = prompt_of("pc", 21)
    try:
        tr = run(e, [SReq("a", prompt, 2), SReq("b", prompt, 2, SamplingParams(prompt_logprobs=1), at_step=3),
                     SReq("c", prompt, 2, at_step=3)])
        hits = e.scheduler.kv.num_hit_tokens
    finally:
        e.shutdown()
    assert hits > 0, "c must hit a's blocks"
    assert len(tr.prompt_logprobs["b"]) == len(prompt) and all(tr.prompt_logprobs["b"][1:])


def test_parallel_sampling_children(engine):
    p = SamplingParams(temperature=1.0, n=3, seed=11)
    tr = run(engine, [SReq("r", prompt_of("n", 5), 8, p)])
    kids = [tokens(tr, f"{i}_r") for i in range(3)]
    assert "r" not in tr.tokens and len({tuple(k) for k in kids}) == 3
    assert kids == [tokens(run(engine, [SReq("r", prompt_of("n", 5), 8, p)]), f"{i}_r") for i in range(3)]
    # Child i is the request with seed 11 + i, alone.
    alone = run(engine, [SReq("x", prompt_of("n", 5), 8, SamplingParams(temperature=1.0, seed=12))])
    assert tokens(alone, "x") == kids[1]
    unseeded = SamplingParams(temperature=1.0, n=2)
    u = run(engine, [SReq("r", prompt_of("n", 5), 8, unseeded)])
    assert tokens(u, "0_r") != tokens(u, "1_r")


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_processing_under_speculative_decoding_equals_plain(method):
    """Drafted positions see the drafts before them as outputs (penalties, min_tokens), so
    spec decoding with processed greedy requests appends what plain decoding appends."""
    params = [SamplingParams(repetition_penalty=1.4, frequency_penalty=0.4, logprobs=2),
              SamplingParams(presence_penalty=-1.5, logit_bias={5: 3.0, 6: 2.5}, min_tokens=4, stop_token_ids=(5,)),
              SamplingParams(frequency_penalty=-1.0, stop_sequences=((6, 5),))]
    reqs = [SReq(f"s{i}", tuple(np.random.default_rng(i).integers(0, 8, 11).tolist()), 14, p, i)
            for i, p in enumerate(params)]
    plain = LLMEngine(BASE)
    spec = LLMEngine(BASE.replace(speculative_method=method, num_speculative_tokens=3))
    try:
        want, got = run(plain, reqs), run(spec, reqs)
    finally:
        plain.shutdown()
        spec.shutdown()
    assert got.num_draft_tokens > 0 and (method == "eagle" or got.num_accepted_tokens > 0)
    for r in reqs:
        assert tokens(got, r.req_id) == tokens(want, r.req_id), r.req_id
    assert not check_trace(got, {r.req_id: list(r.prompt) for r in reqs})
