"""Speculative decoding: greedy spec decode equals plain decoding, in every layout and mode,
with each proposer (n-gram in the driver, EAGLE on the last rank)."""
from __future__ import annotations

import pytest
import torch
from engine_testutil import Arrival, mixed_arrivals, run_arrivals

from engine import ConfigError, EngineConfig, EngineInvariantError, LLMEngine
from engine.attention.metadata import AttentionMetadataBuilder
from engine.attention.selector import get_attn_backend
from engine.eagle import EagleProposer, make_draft_state_dict
from engine.spec_decode import NgramProposer, verify_greedy
from engine.weights import make_state_dict
from fuzz.cases.case import Case, Workload
from fuzz.verdict.properties import check_fa_records

# Budget 16 < the longest prompt: chunked prefill. 4 layers split evenly over pp4.
BASE = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16, max_model_len=64, num_gpu_blocks=96)
K = 3
SIZES = (8, 16)  # uniform decodes of 1 + K = 4 tokens for 2 or 4 requests; fewer pad up


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


def arrivals() -> list[Arrival]:
    # A small alphabet (n-grams repeat, so n-gram drafts exist), a prompt longer than the
    # budget (chunked prefill), and late arrivals (prefills mixed with spec decodes).
    return (mixed_arrivals(0, [3, 20, 7], 6, (12, 20))
            + mixed_arrivals(1, [9, 2], 6, (12, 20), prefix="late", at_step=4))


def run(cfg: EngineConfig, faults=(), record_fa: bool = False):
    e = LLMEngine(cfg, record_fa=record_fa)
    try:
        e.reset(faults=faults)
        run_arrivals(e, arrivals())
        return e.trace, (e.collect_fa_records() if record_fa else [])
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def plain():
    return run(BASE)[0]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
@pytest.mark.parametrize("layout,mode", [("tp1pp1", "NONE"), ("tp1pp1", "FULL"), ("tp2pp2", "NONE"),
                                         ("tp2pp2", "FULL"), ("pp4", "NONE"), ("pp4", "FULL")])
def test_spec_decode_equals_plain_decoding(method, layout, mode, plain):
    graph = mode == "FULL"
    cfg = BASE.replace(layout=layout, speculative_method=method, num_speculative_tokens=K,
                       cudagraph_mode=mode, capture_sizes=SIZES if graph else ())
    spec, records = run(cfg, record_fa=graph or layout == "tp1pp1")
    assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    assert spec.output_token_ids() == plain.output_token_ids()
    for rid in plain.tokens:  # same positions, same logits (bitwise in this batch-invariant engine)
        for a, b in zip(plain.tokens[rid], spec.tokens[rid]):
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    if records:  # every attention call, the draft's included, meets the FA contract
        check_fa_records(Case(cfg, Workload(())), records)
        draft = [r for r in records if r.layer == cfg.num_hidden_layers]
        assert bool(draft) == (method == "eagle") and not any(r.graph for r in draft)  # drafts run eager
    if graph:
        # Spec decodes replay captured graphs; EAGLE (always K drafts here) reaches uniform
        # decodes of 1 + K tokens per request, n-gram drafts are often shorter.
        q_lens = [set(torch.diff(r.cu_seqlens_q[:r.num_reqs + 1]).tolist()) for r in records if r.graph]
        assert any(q & set(range(2, K + 2)) for q in q_lens), "no spec decode replayed from a graph"
        if method == "eagle":
            assert {1 + K} in q_lens, "no uniform spec decode replayed from a graph"


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_spec_rollback_missing_is_caught(method):
    with pytest.raises(EngineInvariantError):
        run(BASE.replace(speculative_method=method, num_speculative_tokens=K), faults=("spec_rollback_missing",))


def test_eagle_is_chosen_when_the_engine_is_built():
    e = LLMEngine(BASE)
    try:
        with pytest.raises(ConfigError, match="speculative_method"):
            e.reset(scheduler_config=BASE.replace(speculative_method="eagle", num_speculative_tokens=2))
    finally:
        e.shutdown()


def _proposer(cfg: EngineConfig) -> EagleProposer:
    return EagleProposer(cfg, make_state_dict(cfg), rank=0, records=None, attn_backend=get_attn_backend(cfg))


def test_eagle_draft_steps_have_their_own_metadata():
    """Per draft step: one query token per request, positions advance by 1, seq_lens grow
    by 1, slot_mapping is the position's slot through the request's block table; a request
    allowed fewer drafts drops out. Drafts are deterministic."""
    cfg, bs = BASE.replace(speculative_method="eagle", num_speculative_tokens=3), BASE.block_size
    lens = [6, 3]  # two prefills of 6 and 3 tokens
    bt = torch.tensor([[5, 9, 2, 0], [7, 3, 0, 0]], dtype=torch.int32)  # includes lookahead blocks
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    slots = torch.cat([bt[0, pos[:6] // bs] * bs + pos[:6] % bs, bt[1, pos[6:] // bs] * bs + pos[6:] % bs]).long()
    md = AttentionMetadataBuilder().build(
        query_start_loc=torch.tensor([0, 6, 9], dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=bt, slot_mapping=slots, num_reqs=2, num_actual_tokens=9, max_query_len=6, max_seq_len=6)
    ids, hidden = torch.randint(0, cfg.vocab_size, (9,)), torch.randn(9, cfg.hidden_size)
    p = _proposer(cfg)
    drafts = p.propose(ids, pos, hidden, md, torch.tensor([5, 8]), bt, num_drafts=[3, 2])
    assert [len(d) for d in drafts] == [3, 2]
    first, *steps = p.last_metadata
    assert first is md and len(steps) == 2
    for j, s in enumerate(steps, start=1):
        live = [0, 1] if j == 1 else [0]
        want_pos = torch.tensor([lens[i] - 1 + j for i in live])
        assert s.num_reqs == s.num_actual_tokens == len(live) and s.max_query_len == 1
        assert s.query_start_loc.tolist() == list(range(len(live) + 1))
        assert s.seq_lens.tolist() == (want_pos + 1).tolist() and s.max_seq_len == int(want_pos.max()) + 1
        want_slots = [int(bt[i, p_ // bs]) * bs + int(p_) % bs for i, p_ in zip(live, want_pos)]
        assert s.slot_mapping.tolist() == want_slots
        assert s.block_table_tensor.tolist() == bt[live].tolist()
    k_cache = p.kv_caches[cfg.num_hidden_layers][0].view(-1, *p.kv_caches[cfg.num_hidden_layers][0].shape[2:])
    assert bool((k_cache[[int(bt[0, 1]) * bs + 3]] != 0).any())  # step 2 of request 0 wrote position 7
    again = _proposer(cfg)
    assert again.propose(ids, pos, hidden, md, torch.tensor([5, 8]), bt, num_drafts=[3, 2]) == drafts
    assert torch.equal(make_draft_state_dict(cfg)["fc.weight"], make_draft_state_dict(cfg)["fc.weight"])
