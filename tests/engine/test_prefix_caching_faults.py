"""The prefix-caching faults, each caught on a hand-built workload: by logits that differ
from the same workload with caching off, or by `check_accounting` naming the block."""
from __future__ import annotations

import pytest
import torch

from engine import LLMEngine
from engine.faults import (CACHED_BLOCK_EVICTED_WHILE_REFERENCED, PREFIX_HASH_IGNORES_EXTRA_KEY,
                           PREFIX_HIT_MID_BLOCK_COUNTED_FULL, FaultSet)
from engine.kv_cache import KVAccountingError, KVCacheManager
from engine.scheduler import Request
from test_prefix_caching import BASE, Req, in_flight_workload, run, shared_prefix_workload, toks


def differs(ref, got, rids=None) -> bool:
    """Any position of `rids` (all requests by default) whose token or logits differ (NaN
    included) from the reference run."""
    return any(len(ref.tokens[rid]) != len(got.tokens[rid])
               or any(x.token != y.token or not torch.equal(x.logits, y.logits)
                      for x, y in zip(ref.tokens[rid], got.tokens[rid]))
               for rid in (rids or ref.tokens))


@pytest.fixture(scope="module")
def tp1pp1():
    e = LLMEngine(BASE)
    yield e
    e.shutdown()


def test_every_prefix_fault_is_harmless_with_caching_off(tp1pp1):
    """The seams sit on the caching path only: off, each fault changes nothing."""
    reqs = shared_prefix_workload()
    ref = run(tp1pp1, reqs, BASE).trace
    for fault in (PREFIX_HASH_IGNORES_EXTRA_KEY, CACHED_BLOCK_EVICTED_WHILE_REFERENCED,
                  PREFIX_HIT_MID_BLOCK_COUNTED_FULL):
        assert not differs(ref, run(tp1pp1, reqs, BASE, faults=(fault,)).trace), fault


def test_prefix_hash_ignores_extra_key(tp1pp1):
    """Equal prompts under two salts: with the salt left out of the hash the second request
    hits the first one's blocks, and the books see a block cached under a hash that is not
    its holder's salted prefix."""
    edge = toks("edge", 12)
    kv = KVCacheManager(32, 4, enable_caching=True, faults=FaultSet([PREFIX_HASH_IGNORES_EXTRA_KEY]))
    for rid, salt in (("a", "alice"), ("b", "bob")):
        r = Request(rid, list(edge), 2, cache_salt=salt)
        hits, n = kv.get_computed_blocks(r)
        kv.allocate_slots(rid, 12, hits)
        kv.cache_blocks(r, 12)
    assert n == 8, "bob should not see alice's blocks, and with the fault does"
    reqs = [Req("a", edge, 3, salt="alice"), Req("b", edge, 3, at_step=4, salt="bob")]
    cfg = BASE.replace(enable_prefix_caching=True)
    with pytest.raises(KVAccountingError, match=r"block \d+ is cached under a hash that is not request a's"):
        run(tp1pp1, reqs, cfg, faults=(PREFIX_HASH_IGNORES_EXTRA_KEY,))


def test_cached_block_evicted_while_referenced(tp1pp1):
    """A repeat of a finished prompt hits its free cached blocks; touched but left on the free
    queue, they are free and owned at once (and the next allocation would evict them)."""
    p = toks("rep", 13)
    reqs = [Req("a", p, 2), Req("b", p, 2, at_step=5)]
    cfg = BASE.replace(enable_prefix_caching=True)
    ok = run(tp1pp1, reqs, cfg)
    assert ok.kv.num_hit_tokens == 12
    with pytest.raises(KVAccountingError, match=r"block \d+ both free and owned"):
        run(tp1pp1, reqs, cfg, faults=(CACHED_BLOCK_EVICTED_WHILE_REFERENCED,))


@pytest.mark.parametrize("layout", ["tp1pp2", "tp1pp4"])
def test_prefix_hit_mid_block_counted_full(layout):
    """A's first chunk (6 of 14 tokens, budget 6) ends inside block 1; counted full, block 1
    is cached, and B, admitted while that chunk is in flight, hits it and skips positions 6
    and 7, whose KV nothing has written yet (it reads the reset's poison)."""
    e = LLMEngine(BASE.replace(layout=layout))
    try:
        cfg = e.cfg.replace(max_num_batched_tokens=6)
        ref = run(e, in_flight_workload(), cfg).trace
        on = run(e, in_flight_workload(), cfg.replace(enable_prefix_caching=True))
        assert not differs(ref, on.trace)
        bad = run(e, in_flight_workload(), cfg.replace(enable_prefix_caching=True),
                  faults=(PREFIX_HIT_MID_BLOCK_COUNTED_FULL,))
        hits = {nr.req_id: nr.num_computed_tokens for so in bad.outputs for nr in so.scheduled_new_reqs}
        assert hits == {"A": 0, "B": 8} and on.kv.num_hit_tokens == 4
        assert differs(ref, bad.trace, ["B"]) and not differs(ref, bad.trace, ["A"])  # only the reader is wrong
    finally:
        e.shutdown()
