"""The independent sampling oracle: it agrees with the engine on random sampling parameters,
and when a transform is wrong it says which one, in one line."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import EngineConfig, LLMEngine
from engine.sample.sampling_params import SamplingParams
from fuzz.verdict.oracles import sampling as oracle
from fuzz.verdict.oracles.sampling import check_row, check_trace, compare_noise, expected_distribution

V = 128
CFG = EngineConfig(num_hidden_layers=2, max_num_batched_tokens=16, max_model_len=48, num_gpu_blocks=64)
TOKEN = st.integers(0, V - 1)


def test_oracle_shares_no_code_with_the_engine():
    tree = ast.parse(Path(oracle.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.split(".")[0] in ("engine", "torch") for m in imported), imported


@st.composite
def sampling_params(draw) -> SamplingParams:
    greedy = draw(st.booleans())
    kw = dict(
        temperature=0.0 if greedy else draw(st.floats(0.05, 3.0)),
        top_k=draw(st.sampled_from([0, 1, 2, 5, 50, 200])),
        top_p=draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1])),
        min_p=draw(st.sampled_from([0.0, 0.01, 0.2, 0.9])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, -1.0, 0.7, 2.0])),
        presence_penalty=draw(st.sampled_from([0.0, -2.0, 0.4, 1.5])),
        logit_bias=draw(st.dictionaries(TOKEN, st.floats(-100, 100), max_size=4)),
        seed=draw(st.none() | st.integers(0, 2 ** 31)),
        stop_token_ids=tuple(draw(st.lists(TOKEN, max_size=3))),
        min_tokens=draw(st.integers(0, 4)),
        logprobs=draw(st.none() | st.integers(0, 5)),
    )
    return SamplingParams(**kw)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 3))
    return [(f"r{i}", draw(st.lists(st.integers(0, 7) | TOKEN, min_size=1, max_size=24)), draw(st.integers(1, 6)),
             draw(st.none() | sampling_params()), draw(st.integers(0, 2))) for i in range(n)]


@pytest.fixture(scope="module")
def engines():
    es = {layout: LLMEngine(CFG.replace(layout=layout, broadcast_pp_output=layout != "tp1pp1"))
          for layout in ("tp1pp1", "tp1pp2")}
    yield es
    for e in es.values():
        e.shutdown()


def _run(e: LLMEngine, work) -> dict:
    e.reset()
    pending, step = sorted(work, key=lambda w: w[4]), 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, prompt, n, params, _ = pending.pop(0)
            e.add_request(rid, prompt, max(n, params.min_tokens if params else 0), sampling_params=params)
        if e.has_unfinished_requests():
            e.step()
        step += 1
    return {rid: prompt for rid, prompt, *_ in work}


@pytest.mark.parametrize("layout", ["tp1pp1", "tp1pp2"])
def test_oracle_agrees_with_the_engine(engines, layout):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workloads())
    def check(work):
        prompts = _run(engines[layout], work)
        trace = engines[layout].trace
        assert check_trace(trace, prompts) == []
        for rid, recs in trace.tokens.items():
            p = trace.sampling_params.get(rid)
            if p is not None and p.logprobs is not None:
                assert all(r.top_logprobs is not None and r.sampled in r.top_logprobs for r in recs)

    check()


def _row(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, V).astype(np.float32).astype(np.float64)


def _engine_row_without(name: str, raw, params, prompt, output) -> np.ndarray:
    return expected_distribution(raw, params, prompt, output, skip=(name,)).logprobs()


@pytest.mark.parametrize("name,params", [
    ("top_k", SamplingParams(temperature=1.0, top_k=5)),
    ("top_p", SamplingParams(temperature=1.0, top_p=0.5)),
    ("min_p", SamplingParams(temperature=1.0, min_p=0.2)),
    ("temperature", SamplingParams(temperature=0.5)),
    ("frequency_penalty", SamplingParams(frequency_penalty=1.5)),
    ("presence_penalty", SamplingParams(presence_penalty=-1.0)),
    ("repetition_penalty", SamplingParams(repetition_penalty=1.7)),
    ("logit_bias", SamplingParams(logit_bias={3: 9.0})),
    ("min_tokens", SamplingParams(min_tokens=5, stop_token_ids=(int(_row().argmax()),)))])
def test_a_missing_transform_is_named(name, params):
    raw, prompt, output = _row(), [1, 2, 3, 2], [7, 7, 1, int(_row().argmax())]
    got = _engine_row_without(name, raw, params, prompt, output)
    sampled = int(np.nanargmax(np.where(np.isfinite(got), got, -np.inf)))
    why = check_row(raw, got, sampled, np.ones(V), params, prompt, output)
    assert why is not None and "\n" not in why and f"without {name})" in why, why


def test_sampled_token_is_checked():
    raw, p = _row(1), SamplingParams(temperature=1.0, top_k=3)
    lp = expected_distribution(raw, p, [1], []).logprobs()
    q = np.random.default_rng(2).exponential(size=V)
    winner = int(np.argmax(np.where(np.isfinite(lp), np.exp(lp) / q, 0)))
    assert check_row(raw, lp, winner, q, p, [1], []) is None
    loser = int(np.argsort(np.where(np.isfinite(lp), lp, -np.inf))[-2 if winner == int(np.argmax(lp)) else -1])
    assert "race" in check_row(raw, lp, loser, q, p, [1], [])
    outside = int(np.argmin(raw))
    assert "outside" in check_row(raw, lp, outside, q, p, [1], [])
    g = SamplingParams(presence_penalty=0.5)
    glp = expected_distribution(raw, g, [1], []).logprobs()
    assert "greedy" in check_row(raw, glp, int(np.argmin(raw)), None, g, [1], [])


def test_compare_noise_names_the_request():
    rec = lambda q: SimpleNamespace(noise=torch.tensor(q))  # noqa: E731
    a = SimpleNamespace(tokens={"x": [rec([1.0, 2.0]), rec([3.0, 4.0])]})
    b = SimpleNamespace(tokens={"x": [rec([1.0, 2.0]), rec([3.0, 5.0])]})
    assert compare_noise(a, a) == []
    assert compare_noise(a, b) == ["sampling: request x output 1: its random draw differs from the reference's "
                                   "(the generator is out of step)"]


def test_a_top_p_border_inside_a_run_of_equal_probabilities_goes_either_way():
    """bf16 logits round many tokens to one value: where the top-p border falls inside such
    a run, which of them the sort drops is arbitrary, so either choice passes; a token kept
    outside the run still fails."""
    raw = np.full(V, -30.0)
    raw[:4] = (2.0, 1.0, 1.0, 1.0)  # three equal tokens after the largest
    p = SamplingParams(temperature=1.0, top_p=0.75)
    e = expected_distribution(raw, p, [1], [])
    run = np.array([1, 2, 3])
    assert 0 < e.keep[run].sum() < 3 and e.borderline[run].all()  # the border cuts the run
    for kept in ([1], [2], [3], [1, 2], [2, 3]):  # any choice within the run
        keep = np.zeros(V, bool)
        keep[[0] + kept] = True
        lp = expected_distribution(raw, p, [1], []).logprobs(keep)
        assert check_row(raw, lp, 0, np.ones(V), p, [1], []) is None, kept
    keep = e.keep.copy()
    keep[10] = True  # far below the border: no sort order keeps it
    lp = expected_distribution(raw, p, [1], []).logprobs(keep)
    assert "keeps token 10" in check_row(raw, lp, 0, np.ones(V), p, [1], [])
