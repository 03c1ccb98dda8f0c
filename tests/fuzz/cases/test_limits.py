"""fuzz/cases/limits.py and the strategies' draws at config limits: which limits a Case reaches
(exactly, and one off), that drawn Cases reach every one of them, the prefix_hit_mid_block
fault's class, and that each choice of a limit shrinks away when it does not matter."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from engine.config import ConfigError, EngineConfig
from engine.sample.sampling_params import SamplingParams
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.limits import (LIMITS, MAX_SPEC_TOKENS, full_batch, kv_demand, kv_pool, limits_reached,
                         mid_block_prefix_class, mix_counts, spec_tokens, tiny_budget)
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, IMPLEMENTED_MODES, cases, tokens_from_seed

_FAST = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck))


def toks(seed, n: int) -> tuple[int, ...]:
    return tokens_from_seed(seed, n, FUZZ_MODEL.vocab_size)


def _find(pred, n: int = 3000, shrink: bool = False) -> Case:
    """The first drawn Case (a fixed seed: derandomized) that satisfies `pred`; fails past `n`."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return find(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES), pred,
                settings=settings(max_examples=n, phases=phases, derandomize=True, **_FAST))


def _reaches(name: str):
    return lambda c: name in limits_reached(c.config, c.workload.requests)


def test_max_spec_tokens_is_the_engines() -> None:
    EngineConfig(speculative_method="ngram", num_speculative_tokens=MAX_SPEC_TOKENS)
    with pytest.raises(ConfigError):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=MAX_SPEC_TOKENS + 1)


def test_limits_are_named_exactly_and_one_off() -> None:
    cfg = FUZZ_MODEL  # max_model_len 64, block 4, budget 64, 8 seqs, 96 blocks
    at = lambda *reqs, c=cfg: limits_reached(c, reqs)  # noqa: E731
    assert "max_model_len" in at(RequestSpec(toks(1, 60), 4))
    assert at(RequestSpec(toks(1, 59), 4))[0] == "max_model_len - 1"
    assert not {"max_model_len", "max_model_len - 1"} & set(at(RequestSpec(toks(1, 58), 4)))
    ngram = cfg.replace(speculative_method="ngram", num_speculative_tokens=3)
    assert "max_model_len with drafts" in at(RequestSpec(toks(1, 58), 4), c=ngram)
    assert "max_model_len with drafts" not in at(RequestSpec(toks(1, 56), 5), c=ngram)
    assert {"budget = 1 + k", "budget 2", "spec k 1"} <= set(at(RequestSpec(toks(1, 3), 1), c=ngram.replace(
        max_num_batched_tokens=2, num_speculative_tokens=1)))
    assert "budget = k" in at(RequestSpec(toks(1, 3), 1), c=ngram.replace(max_num_batched_tokens=3))
    # k 3: two decodes need 8 tokens; a budget of 6 cuts the second's drafts, 8 and 12 cut none.
    two = (RequestSpec(toks(1, 3), 4), RequestSpec(toks(2, 3), 4))
    assert "budget cuts a decode's drafts" in at(*two, c=ngram.replace(max_num_batched_tokens=6))
    assert not {"budget cuts a decode's drafts"} & set(at(*two, c=ngram.replace(max_num_batched_tokens=8))
                                                       + at(*two, c=ngram.replace(max_num_batched_tokens=12)))
    eight = [RequestSpec(toks(i, 2), 1) for i in range(8)]
    assert "max_num_seqs" in at(*eight) and "max_num_seqs + 1" in at(*eight, RequestSpec(toks(9, 2), 1))
    # A late ninth request does not arrive with the eight.
    assert "max_num_seqs" in at(*eight, RequestSpec(toks(9, 2), 1, arrival_step=3))
    # 16 blocks of 4 hold 64 tokens: 17 blocks (with the null block) exactly, 16 one short.
    assert "kv blocks exact" in at(RequestSpec(toks(1, 60), 4), c=cfg.replace(num_gpu_blocks=17))
    assert "kv blocks + 1" in at(RequestSpec(toks(1, 60), 4), RequestSpec(toks(2, 3), 1),
                                 c=cfg.replace(num_gpu_blocks=17))
    assert {"block edge", "tile edge"} <= set(at(RequestSpec(toks(1, 64), 0 + 1, 0), c=cfg.replace(max_model_len=128,
                                                                                                  num_gpu_blocks=40)))
    graph = cfg.replace(cudagraph_mode="FULL", capture_sizes=(4, 8))
    assert "capture size" in at(RequestSpec(toks(1, 8), 1), c=graph)
    assert "capture size + 1" in at(RequestSpec(toks(1, 9), 1), c=graph)
    assert "capture size" not in at(RequestSpec(toks(1, 8), 1))  # eager: no graphs


def test_limit_choices_land_on_the_limit_or_leave_the_case_as_is() -> None:
    wl = Workload((RequestSpec(toks(1, 60), 4),))
    assert kv_demand(FUZZ_MODEL, wl.requests) == 16
    assert kv_pool(FUZZ_MODEL, wl, "exact").num_gpu_blocks == 17
    assert kv_pool(FUZZ_MODEL, wl, "one short") == FUZZ_MODEL  # 16 blocks cannot hold max_model_len
    assert kv_pool(FUZZ_MODEL, wl, "no") == FUZZ_MODEL
    full = full_batch(Workload((RequestSpec(toks(1, 5), 2, 0, sampling=SamplingParams(temperature=1.0, n=2)),)),
                      FUZZ_MODEL, "one over", 10)
    assert "max_num_seqs + 1" in limits_reached(FUZZ_MODEL, full.requests)  # n = 2 counts twice
    assert full_batch(wl, FUZZ_MODEL, "at", 5) == wl  # the fillers would pass max_requests
    assert tiny_budget(FUZZ_MODEL, Workload((RequestSpec(toks(1, 8), 2),)), 1).max_num_batched_tokens == 1
    assert tiny_budget(FUZZ_MODEL, wl, 1) == FUZZ_MODEL  # too many tokens for a token a step
    assert spec_tokens("ngram", 2, "fills budget", 3, 9) == 8 and spec_tokens("ngram", 2, "one past budget", 3, 9) == 2

    assert spec_tokens("eagle", 2, "any", 5, 64) == 2 and spec_tokens("eagle", 2, "max", 5, 64) == MAX_SPEC_TOKENS


@pytest.mark.slow
def test_drawn_cases_reach_every_limit() -> None:
    """One pass over drawn Cases (a fixed seed) until every limit was reached by one."""
    left = set(LIMITS)

    def reaches_the_last(c: Case) -> bool:
        left.difference_update(limits_reached(c.config, c.workload.requests))
        return not left

    try:
        _find(reaches_the_last)
    except Exception:
        pytest.fail(f"limits no drawn Case reached: {sorted(left)}")


def test_mid_block_class_is_the_faults_ground() -> None:
    a = toks("inflight", 14)
    cfg = FUZZ_MODEL.replace(layout="tp1pp2", max_num_batched_tokens=6, enable_prefix_caching=True)
    reqs = (RequestSpec(a, 3), RequestSpec(a[:10] + toks("B", 3), 3))
    assert mid_block_prefix_class(cfg, reqs)
    assert not mid_block_prefix_class(cfg.replace(max_num_batched_tokens=8), reqs)  # chunk ends on a block edge
    assert not mid_block_prefix_class(cfg.replace(layout="tp1pp1"), reqs)
    assert not mid_block_prefix_class(cfg, (reqs[0], RequestSpec(reqs[1].prompt_token_ids, 3, 2)))  # too late
    assert not mid_block_prefix_class(cfg, (reqs[0], RequestSpec(reqs[1].prompt_token_ids, 3, 0, "a")))  # salt
    _find(lambda c: mid_block_prefix_class(c.config, c.workload.requests), n=1000)


def test_mix_counts() -> None:
    reqs = (RequestSpec(toks(1, 3), 2), RequestSpec(toks(2, 3), 2, sampling=SamplingParams(temperature=0.5)),
            RequestSpec(toks(3, 3), 2, sampling=SamplingParams(frequency_penalty=0.5), abort_step=1))
    assert mix_counts(reqs) == {"requests": 3, "requests_sampling": 2, "requests_random": 1,
                                "requests_penalties": 1, "requests_aborted": 1}


def test_limits_shrink_away_unless_they_matter() -> None:
    simplest = _find(lambda c: True, 50, shrink=True)
    assert len(simplest.workload.requests) == 1
    assert simplest.config.num_gpu_blocks == FUZZ_MODEL.num_gpu_blocks  # the pool as drawn
    assert simplest.config.max_num_batched_tokens == FUZZ_MODEL.max_num_batched_tokens
    assert set(limits_reached(simplest.config, simplest.workload.requests)) <= {"block edge +- 1"}
    # A limit that matters stays, and only it: max_model_len is one request on tp1pp1.
    at_end = _find(_reaches("max_model_len"), shrink=True)
    (r,) = at_end.workload.requests
    assert len(r.prompt_token_ids) + r.max_tokens == at_end.config.max_model_len
    assert at_end.config.layout == "tp1pp1" and at_end.mode == "eager"
    full = _find(_reaches("max_num_seqs"), shrink=True)
    assert len(full.workload.requests) == full.config.max_num_seqs
    assert full.config.layout == "tp1pp1" and full.config.speculative_method == "none"


def test_limit_draws_keep_within_max_requests() -> None:
    from hypothesis.errors import NoSuchExample

    with pytest.raises(NoSuchExample):
        find(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES, max_requests=3), lambda c: len(c.workload.requests) > 3,
             settings=settings(max_examples=400, phases=[Phase.generate], derandomize=True, **_FAST))
