"""Speculative decoding: greedy spec decode equals plain decoding, in every layout and mode."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, EngineInvariantError, LLMEngine
from engine.spec_decode import NgramProposer, verify_greedy

BASE = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16, max_model_len=96, num_gpu_blocks=160)


def test_ngram_proposer_longest_recent_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # 3-gram [1,2,3] seen at 0
    assert p.propose([5, 6, 7, 6]) == [7, 6]  # 1-gram [6]: what followed its last occurrence
    assert p.propose([1, 2, 3]) == []  # no earlier occurrence
    assert p.propose([1, 2, 1, 2], max_k=1) == [1]


def test_verify_greedy_accepts_matching_prefix_plus_bonus():
    assert verify_greedy([4, 5, 6], [4, 5, 9, 7]) == [4, 5, 9]
    assert verify_greedy([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert verify_greedy([1], [2, 3]) == [2]


def workload():
    rng = random.Random(0)
    # A small alphabet in prompts and long outputs: n-grams repeat and some drafts are accepted.
    return [(f"r{i}", [rng.randrange(6) for _ in range(rng.randint(3, 20))], rng.randint(30, 60)) for i in range(6)]


def run(cfg, faults=()):
    e = LLMEngine(cfg)
    try:
        e.reset(faults=faults)
        for r in workload():
            e.add_request(*r)
        while e.has_unfinished_requests():
            e.step()
        return e.trace
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def plain():
    return run(BASE)


@pytest.mark.parametrize("layout,mode", [("tp1pp1", "NONE"), ("tp1pp2", "NONE"), ("tp2pp2", "NONE"),
                                         ("tp1pp1", "FULL"), ("tp1pp2", "FULL")])
def test_spec_decode_equals_plain_decoding(layout, mode, plain):
    cfg = BASE.replace(layout=layout, speculative_method="ngram", num_speculative_tokens=3,
                       cudagraph_mode=mode, capture_sizes=(4, 8, 16) if mode == "FULL" else ())
    spec = run(cfg)
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert spec.output_token_ids() == plain.output_token_ids()
    for rid in plain.tokens:  # same positions, same logits (bitwise: batch-invariant engine)
        for a, b in zip(plain.tokens[rid], spec.tokens[rid]):
            assert torch.equal(a.logits, b.logits)


def test_spec_rollback_missing_is_caught():
    with pytest.raises(EngineInvariantError):
        run(BASE.replace(speculative_method="ngram", num_speculative_tokens=3), faults=("spec_rollback_missing",))
