"""BlockPool / KVCacheManager bookkeeping: the null block is never handed out, a double free
is caught at once, and `check_accounting` catches every broken ownership state."""
from __future__ import annotations

import random

import pytest

from engine import EngineConfig, LLMEngine
from engine.kv_cache import BlockPool, KVAccountingError, KVCacheManager
from engine_testutil import capture_scheduler_outputs, mixed_arrivals, run_arrivals


def test_null_block_0_is_never_allocated():
    pool = BlockPool(9)
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9))
    assert 0 not in got and pool.num_free_blocks == 0
    with pytest.raises(KVAccountingError):
        pool.allocate(1)


def test_allocate_is_all_or_nothing():
    pool = BlockPool(5)
    pool.allocate(2)
    with pytest.raises(KVAccountingError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    kv = KVCacheManager(5, block_size=4)
    assert kv.allocate_slots("a", 12) == [1, 2, 3]
    assert kv.allocate_slots("b", 9) is None  # needs 3, one free: nothing taken
    assert kv.pool.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.check_accounting()


def test_double_free_is_detected():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.release(blocks[:1])
    with pytest.raises(KVAccountingError, match="double free"):
        pool.release(blocks[:1])
    with pytest.raises(KVAccountingError, match="double free"):
        pool.release([5])  # never allocated: still free
    assert pool.num_free_blocks == 3  # the failed releases changed nothing


def test_releasing_the_null_block_is_an_error():
    pool = BlockPool(4)
    with pytest.raises(KVAccountingError):
        pool.release([0])
    assert 0 not in pool.free


def test_slots_grow_by_whole_blocks():
    kv = KVCacheManager(16, block_size=4)
    assert kv.blocks_needed("a", 1) == 1
    assert len(kv.allocate_slots("a", 1)) == 1
    assert kv.allocate_slots("a", 4) == []  # still inside block one
    assert len(kv.allocate_slots("a", 5)) == 1
    assert len(kv.allocate_slots("a", 17)) == 3
    assert len(kv.req_blocks["a"]) == 5
    kv.free("a")
    assert kv.pool.num_free_blocks == 15
    kv.check_accounting()


def _populated() -> KVCacheManager:
    kv = KVCacheManager(12, block_size=2)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 3)
    kv.check_accounting()
    return kv


def test_check_accounting_catches_a_block_owned_twice():
    kv = _populated()
    kv.req_blocks["b"].append(kv.req_blocks["a"][0])
    kv.pool.free.remove(kv.pool.free[0])  # keep the count right: only the duplicate is wrong
    with pytest.raises(KVAccountingError, match="owned by two"):
        kv.check_accounting()


def test_check_accounting_catches_a_block_both_free_and_owned():
    kv = _populated()
    kv.pool.free.append(kv.req_blocks["a"][-1])
    with pytest.raises(KVAccountingError, match="both free and owned"):
        kv.check_accounting()


def test_check_accounting_catches_a_leak():
    kv = _populated()
    kv.req_blocks.pop("b")  # forgotten without a release
    with pytest.raises(KVAccountingError, match="leaked"):
        kv.check_accounting()


def test_check_accounting_catches_a_block_on_the_free_list_twice():
    """A double free that bypassed `release` (the free list holds a block twice, so two later
    requests would get it) must not pass as 'no leak' just because a set hides the copy."""
    kv = _populated()
    kv.free("b")
    kv.pool.free.append(kv.pool.free[0])  # freed again behind release()'s back
    owned = sum(len(b) for b in kv.req_blocks.values())
    assert owned + kv.pool.num_free_blocks == kv.pool.num_blocks  # one more than usable
    with pytest.raises(KVAccountingError):
        kv.check_accounting()


@pytest.mark.parametrize("seed", range(6))
def test_random_alloc_free_keeps_accounting(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(20, block_size=rng.choice([1, 2, 4]))
    sizes: dict[str, int] = {}
    for step in range(300):
        rid = f"r{rng.randrange(8)}"
        if rid in sizes and rng.random() < 0.3:
            kv.free(rid)
            sizes.pop(rid)
        else:
            want = sizes.get(rid, 0) + rng.randint(1, 6)
            if kv.allocate_slots(rid, want) is not None:
                sizes[rid] = want
        kv.check_accounting()
        for r, n in sizes.items():
            assert len(kv.req_blocks[r]) == -(-n // kv.block_size)
        assert all(0 not in blocks for blocks in kv.req_blocks.values())
    for rid in list(sizes):
        kv.free(rid)
    assert kv.pool.num_free_blocks == 19
    kv.check_accounting()


def test_engine_returns_every_block_and_never_hands_out_block_0():
    cfg = EngineConfig(num_gpu_blocks=17, max_model_len=64, max_num_batched_tokens=16)
    e = LLMEngine(cfg)
    try:
        seen = capture_scheduler_outputs(e)
        run_arrivals(e, mixed_arrivals(1, [30, 7, 1, 22, 13, 40, 4, 18], cfg.vocab_size, (3, 9)))
        assert e.trace.num_preemptions > 0  # blocks also came back through preemption
        for so in seen:
            ids = [b for nr in so.scheduled_new_reqs for b in nr.block_ids]
            ids += [b for blocks in so.scheduled_cached_reqs.new_block_ids for b in blocks]
            assert 0 not in ids, f"microbatch {so.microbatch} hands out the null block"
        kv = e.scheduler.kv
        assert kv.req_blocks == {} and kv.pool.num_free_blocks == cfg.num_gpu_blocks - 1
        kv.check_accounting()
    finally:
        e.shutdown()
