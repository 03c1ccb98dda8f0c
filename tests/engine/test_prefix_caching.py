"""Prefix caching: block hash chains, BlockPool ref counts and LRU eviction, and end to end
an engine with caching on gives bitwise the tokens and logits of caching off (shared system
prompts, branches, repeats, prompts on and one off a block edge, chunked prefill from a hit,
preemption, n-gram drafts, PP microbatches in flight, graph mode). The bookkeeping tests are
in test_prefix_caching_books.py, the faults in test_prefix_caching_faults.py."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.attention.fa_contract import check_varlen_args
from engine.kv_cache_utils import extend_block_hashes, hash_block_tokens, hash_request_tokens
from engine_testutil import capture_scheduler_outputs

BASE = EngineConfig(max_num_batched_tokens=16, num_gpu_blocks=64, max_model_len=64)  # block_size 4
BS, V = BASE.block_size, BASE.vocab_size


@dataclass(frozen=True, slots=True)
class Req:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    at_step: int = 0
    salt: str | None = None
    forced: tuple[int, ...] | None = None


def toks(seed, n: int, vocab: int = V) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(n))


def shared_prefix_workload(vocab: int = V, more: int = 0, crowd: int = 1) -> list[Req]:
    """A 10-token system prompt (2 blocks and a half) with branches arriving over time,
    repeats of finished prompts (hits on free cached blocks), prompts exactly on a block edge
    (fully cached: the last block is recomputed) and one off it, and differently salted
    twins that must not share. `more`: extra output tokens per request; arrivals come
    `crowd` times closer together."""
    sys10, edge12 = toks("sys", 10, vocab), toks("edge", 12, vocab)
    out = [Req(f"b{i}", sys10 + toks(f"branch{i}", n, vocab), 4, at_step=2 * i)
           for i, n in enumerate([3, 6, 1, 9, 2])]
    out += [Req("e0", edge12, 3), Req("e1", edge12, 3, at_step=6), Req("e2", edge12[:11], 3, at_step=7),
            Req("e3", edge12 + toks("e3", 1, vocab), 3, at_step=7), Req("e4", edge12[:8], 2, at_step=9)]
    out += [Req("rep", sys10 + toks("branch0", 3, vocab), 4, at_step=12)]
    out += [Req("s0", edge12, 2, at_step=10, salt="alice"), Req("s1", edge12, 2, at_step=12, salt="alice"),
            Req("s2", edge12, 2, at_step=12, salt="bob")]
    return [Req(r.req_id, r.prompt, r.max_tokens + more, r.at_step // crowd, r.salt) for r in out]


def drive(e: LLMEngine, reqs: list[Req], max_steps: int = 3000) -> None:
    pending, steps = sorted(reqs, key=lambda r: r.at_step), 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0].at_step <= steps:
            r = pending.pop(0)
            e.add_request(r.req_id, list(r.prompt), r.max_tokens,
                          list(r.forced) if r.forced else None, cache_salt=r.salt)
        if e.has_unfinished_requests():
            e.step()
        steps += 1
        assert steps < max_steps, "engine did not finish the workload"


@dataclass
class Run:
    trace: object
    kv: object
    outputs: list
    fa_records: list


def run(e: LLMEngine, reqs: list[Req], cfg: EngineConfig, faults: tuple[str, ...] = ()) -> Run:
    e.reset(faults=faults, scheduler_config=cfg)
    e.collect_fa_records()
    seen = capture_scheduler_outputs(e)
    try:
        drive(e, reqs)
    finally:
        del e.executor.submit  # back to the class's method
    return Run(e.trace, e.scheduler.kv, seen, e.collect_fa_records())


def assert_bitwise_same(ref, got, what: str) -> None:
    assert ref.tokens.keys() == got.tokens.keys()
    for rid in ref.tokens:
        a, b = ref.tokens[rid], got.tokens[rid]
        assert [t.token for t in a] == [t.token for t in b], f"{what}: {rid} tokens differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x.logits, y.logits), \
                f"{what}: {rid} position {i} logits differ by {(x.logits - y.logits).abs().max().item():.3g}"


def shared_read_only_blocks(records) -> int:
    """Attention calls in which two live sequences share a block (the contract checks each)."""
    n = 0
    for rec in records:
        check_varlen_args(**rec.varlen_args())
        k_lens, nr = rec.seqused_k[:rec.num_reqs], rec.num_reqs
        need = (k_lens + BS - 1) // BS
        ids = [b for i in range(nr) for b in set(rec.block_table[i, :int(need[i])].tolist()) if b]
        n += len(ids) != len(set(ids))
    return n


# -- hash chain -------------------------------------------------------------------------------

def test_same_prefix_same_hashes_and_a_change_reaches_every_later_block():
    a = list(toks("a", 17))
    b = a[:9] + [(a[9] + 1) % V] + a[10:]
    ha, hb = hash_request_tokens(BS, a), hash_request_tokens(BS, b)
    assert len(ha) == len(hb) == 4  # 17 tokens: 4 full blocks, the 17th is not hashed
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert hash_request_tokens(BS, a[:16]) == ha and hash_request_tokens(BS, a[:15]) == ha[:3]


def test_salt_enters_the_first_block_and_the_chain_carries_it():
    a = toks("a", 12)
    plain, salted, other = (hash_request_tokens(BS, a, k) for k in (None, ("s",), ("t",)))
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, salted, other))
    assert salted[0] == hash_block_tokens(None, a[:4], ("s",))
    assert salted[1] == hash_block_tokens(salted[0], a[4:8])  # no salt past the first block
    assert hash_request_tokens(BS, a, ("s",)) == salted


def test_extending_hashes_as_tokens_arrive_equals_hashing_at_once():
    a, hashes = toks("a", 23), []
    for n in range(24):
        extend_block_hashes(hashes, BS, a[:n], ("x",))
        assert hashes == hash_request_tokens(BS, a[:n], ("x",))


def test_hash_does_not_depend_on_the_process():
    code = ("from engine.kv_cache_utils import hash_request_tokens as h; "
            "print(h(4, list(range(9)), ('salt',))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {hash_request_tokens(4, list(range(9)), ("salt",))[-1].hex()}


# -- end to end: caching on == caching off, bitwise -----------------------------------------

LAYOUTS = [("tp1pp1", "NONE"), ("tp1pp1", "FULL"), ("tp2pp2", "NONE"), ("tp2pp2", "FULL"), ("tp1pp4", "NONE")]
VARIANTS = {  # scheduler-side changes, each a workload feature
    "plain": {},
    "chunked": {"max_num_batched_tokens": 6},
    "preempted": {"num_gpu_blocks": 17},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request):
    layout, mode = request.param
    cfg = BASE.replace(layout=layout, cudagraph_mode=mode, capture_sizes=(4, 8, 12) if mode == "FULL" else ())
    e = LLMEngine(cfg, record_fa=True)
    yield e
    e.shutdown()


def hits_on_in_flight_writes(outputs, pp: int) -> int:
    """Admissions whose hit includes a block handed out by the microbatch before, which was
    still in flight (with pp > 1 the driver schedules microbatch m before collecting m - 1)."""
    handed: dict[int, int] = {}
    n = 0
    for so in outputs:
        for nr in so.scheduled_new_reqs:
            hit = nr.block_ids[:nr.num_computed_tokens // BS]
            n += pp > 1 and any(handed.get(b) == so.microbatch - 1 for b in hit)
        new = [b for nr in so.scheduled_new_reqs for b in nr.block_ids[nr.num_computed_tokens // BS:]]
        for b in new + [b for bs in so.scheduled_cached_reqs.new_block_ids for b in bs]:
            handed[b] = so.microbatch
    return n


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_caching_on_is_bitwise_caching_off(engine, variant):
    cfg = engine.cfg.replace(**VARIANTS[variant])
    vocab = 6 if variant == "ngram" else V  # a small alphabet repeats n-grams: drafts exist
    more, crowd = {"ngram": (10, 1), "preempted": (8, 3)}.get(variant, (0, 1))
    reqs = shared_prefix_workload(vocab, more, crowd)
    off = run(engine, reqs, cfg)
    on = run(engine, reqs, cfg.replace(enable_prefix_caching=True))
    assert_bitwise_same(off.trace, on.trace, f"{engine.cfg.layout}/{variant}")
    kv = on.kv
    assert kv.num_hit_tokens > 0 and off.kv.num_hit_tokens == 0, "no prefix hit: the test is vacuous"
    assert kv.req_blocks == {} and kv.pool.num_free_blocks == cfg.num_gpu_blocks - 1
    kv.check_accounting()
    assert shared_read_only_blocks(on.fa_records) > 0  # shared read-only blocks pass the FA contract
    assert engine.cfg.cudagraph_mode == "NONE" or any(r.graph for r in on.fa_records)
    if variant == "preempted":
        assert on.trace.num_preemptions > 0
        seen: set[str] = set()
        resumed_hits = 0
        for so in on.outputs:
            for nr in so.scheduled_new_reqs:
                resumed_hits += nr.req_id in seen and nr.num_computed_tokens > 0
                seen.add(nr.req_id)
        assert resumed_hits > 0, "no preempted request resumed from a prefix hit"
    if variant == "ngram":
        assert on.trace.num_draft_tokens > 0 and on.trace.num_accepted_tokens < on.trace.num_draft_tokens
    print(f"{engine.cfg.layout}/{engine.cfg.cudagraph_mode}/{variant}: hit rate "
          f"{kv.num_hit_tokens}/{kv.num_queried_tokens} = {kv.hit_rate:.2f}")


def in_flight_workload() -> list[Req]:
    """With a budget of 6, A's first chunk fills block 0 and ends inside block 1; with PP, B
    is admitted while that chunk is in flight and hits block 0, then prefills in chunks from
    the hit (4 tokens, then 6 and 3)."""
    a = toks("inflight", 14)
    return [Req("A", a, 3), Req("B", a[:10] + toks("B", 3), 3)]


def test_hit_on_blocks_an_in_flight_microbatch_writes(engine):
    """Safe because each rank runs microbatches in submission order: on every stage A's
    chunk writes block 0 before B's reads it."""
    if engine.cfg.pp == 1:
        # The engine fixture runs every layout; with one stage a microbatch is collected in the
        # step that submits it, so the situation under test cannot arise (not a hidden failure).
        pytest.skip("no microbatch in flight without PP")
    cfg = engine.cfg.replace(max_num_batched_tokens=6)
    off = run(engine, in_flight_workload(), cfg)
    on = run(engine, in_flight_workload(), cfg.replace(enable_prefix_caching=True))
    assert_bitwise_same(off.trace, on.trace, f"{engine.cfg.layout}/in-flight")
    assert hits_on_in_flight_writes(on.outputs, engine.cfg.pp) == 1 and on.trace.max_in_flight > 1


def test_differently_salted_requests_never_share(engine):
    edge = toks("edge", 12)
    reqs = [Req("a", edge, 2), Req("b", edge, 2, at_step=4, salt="s"), Req("c", edge, 2, at_step=8, salt="t"),
            Req("d", edge, 2, at_step=12, salt="s")]
    on = run(engine, reqs, engine.cfg.replace(enable_prefix_caching=True))
    hits = {nr.req_id: nr.num_computed_tokens for so in on.outputs for nr in so.scheduled_new_reqs}
    assert hits == {"a": 0, "b": 0, "c": 0, "d": 8}  # only d finds its salt's blocks (2 of 3)


@pytest.mark.parametrize("layout", ["tp1pp1", "tp1pp2"])
def test_eagle_caching_on_is_bitwise_caching_off(layout):
    """EAGLE drafts read the draft KV of hit blocks; the last matched block is recomputed."""
    e = LLMEngine(BASE.replace(layout=layout, speculative_method="eagle", num_speculative_tokens=3))
    try:
        for variant in ("plain", "preempted"):
            cfg = e.cfg.replace(**VARIANTS[variant])
            reqs = shared_prefix_workload(V, 6, 3 if variant == "preempted" else 1)
            off, on = run(e, reqs, cfg), run(e, reqs, cfg.replace(enable_prefix_caching=True))
            assert_bitwise_same(off.trace, on.trace, f"{layout}/eagle/{variant}")
            assert on.kv.num_hit_tokens > 0 and on.trace.num_draft_tokens > 0
    finally:
        e.shutdown()
