"""Prefix caching bookkeeping: BlockPool ref counts, touch and LRU eviction, the hit rules
of KVCacheManager, and `check_accounting` naming the block of every unbalanced book."""
from __future__ import annotations

import pytest

from engine.kv_cache import BlockPool, KVAccountingError, KVCacheManager
from engine.kv_cache_utils import hash_request_tokens
from engine.scheduler import Request

BS = 4


def req(rid: str, tokens, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), max_tokens=4, cache_salt=salt)


def admit(kv: KVCacheManager, r: Request, computed: int | None = None) -> tuple[list[int], int]:
    """Admit `r` as the scheduler does, compute `computed` tokens (all by default), cache."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r.req_id, r.num_tokens, hits) is not None
    kv.cache_blocks(r, r.num_tokens if computed is None else computed)
    kv.check_accounting()
    return hits, n


def test_touch_takes_a_free_cached_block_off_the_queue_and_counts_refs():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = req("a", range(13))
    admit(kv, a)
    blocks = list(kv.req_blocks["a"])
    kv.free("a")
    assert kv.pool.num_free_blocks == 15 and len(kv.pool.cached_block_hash_to_block) == 3
    hits, n = admit(kv, req("b", range(13)))
    assert hits == blocks[:3] and n == 12
    assert all(kv.pool.ref_cnt[b] == 1 and b not in kv.pool.free_block_queue for b in hits)
    admit(kv, req("c", list(range(9)) + [99]))  # shares the first 2 blocks with b
    assert [kv.pool.ref_cnt[b] for b in hits] == [2, 2, 1]
    kv.free("b")
    assert [kv.pool.ref_cnt[b] for b in hits] == [1, 1, 0] and hits[2] in kv.pool.free_block_queue
    kv.check_accounting()


def test_eviction_takes_the_least_recently_freed_block_and_drops_its_hash():
    kv = KVCacheManager(7, BS, enable_caching=True)  # 6 usable blocks
    admit(kv, req("a", range(12)))  # 3 cached blocks
    a_blocks = list(kv.req_blocks["a"])
    kv.free("a")  # tail first: the last block is evicted first
    assert list(kv.pool.free_block_queue)[-3:] == a_blocks[::-1]
    admit(kv, req("x", [100 + i for i in range(16)]))  # 4 blocks: 3 never used, then a's tail
    assert a_blocks[2] in kv.req_blocks["x"] and not set(a_blocks[:2]) & set(kv.req_blocks["x"])
    assert kv.pool.block_hash[a_blocks[2]] != hash_request_tokens(BS, range(12))[2]
    kv.free("x")
    hits, n = admit(kv, req("b", range(13)))
    assert hits == a_blocks[:2] and n == 8  # the evicted third block is a miss


@pytest.mark.parametrize("cached,prompt,hit", [(12, 12, 8), (12, 13, 12), (12, 11, 8), (12, 8, 4), (8, 9, 8)])
def test_a_hit_leaves_at_least_one_token_and_ends_on_a_block_edge(cached, prompt, hit):
    kv = KVCacheManager(32, BS, enable_caching=True)
    admit(kv, req("a", range(cached)))
    hits, n = admit(kv, req("b", range(prompt)))
    assert n == hit and len(hits) * BS == hit
    assert kv.num_hit_tokens == hit and kv.num_queried_tokens == cached + prompt


def test_eagle_recomputes_the_last_matched_block():
    kv = KVCacheManager(32, BS, enable_caching=True, use_eagle=True)
    admit(kv, req("a", range(12)))
    assert admit(kv, req("b", range(13)))[1] == 8


def test_a_salt_isolates_and_the_same_salt_shares():
    kv = KVCacheManager(32, BS, enable_caching=True)
    admit(kv, req("a", range(9), salt="s"))
    assert admit(kv, req("b", range(9)))[1] == 0
    assert admit(kv, req("c", range(9), salt="t"))[1] == 0
    assert admit(kv, req("d", range(9), salt="s"))[1] == 8


def test_only_blocks_full_of_computed_known_tokens_are_cached():
    kv = KVCacheManager(32, BS, enable_caching=True)
    a = req("a", range(10))
    admit(kv, a, computed=6)  # a chunk that ends inside block 1
    assert kv.num_cached_block["a"] == 1
    kv.cache_blocks(a, 10)
    assert kv.num_cached_block["a"] == 2  # 10 tokens known: block 2 is not full
    a.output_token_ids += [50, 51]
    kv.allocate_slots("a", 12 + 3)  # room for 3 draft tokens after the sampled one
    kv.cache_blocks(a, min(12 + 3, a.num_tokens))  # the scheduler's bound: real tokens only
    assert kv.num_cached_block["a"] == 3 and len(kv.pool.cached_block_hash_to_block) == 3
    kv.check_accounting()


def test_a_prefix_computed_twice_side_by_side_keeps_one_cached_copy():
    kv = KVCacheManager(32, BS, enable_caching=True)
    a, b = req("a", range(9)), req("b", range(9))
    for r in (a, b):  # both admitted before either caches: no hit
        assert kv.allocate_slots(r.req_id, 9, kv.get_computed_blocks(r)[0]) is not None
    kv.cache_blocks(a, 9)
    kv.cache_blocks(b, 9)
    cached = set(kv.pool.cached_block_hash_to_block.values())
    assert cached == set(kv.req_blocks["a"][:2]) and not cached & set(kv.req_blocks["b"])
    kv.check_accounting()
    kv.free("a")
    kv.free("b")
    kv.check_accounting()


def test_caching_off_never_hashes_and_frees_in_order():
    kv = KVCacheManager(16, BS)
    r = req("a", range(13))
    assert kv.get_computed_blocks(r) == ([], 0)
    kv.allocate_slots("a", 13)
    kv.cache_blocks(r, 13)
    blocks = list(kv.req_blocks["a"])
    kv.free("a")
    assert not kv.pool.cached_block_hash_to_block and list(kv.pool.free_block_queue)[-4:] == blocks


# -- the books balance ------------------------------------------------------------------------

def _shared() -> tuple[KVCacheManager, list[int]]:
    kv = KVCacheManager(16, BS, enable_caching=True)
    admit(kv, req("a", range(13)))
    hits, _ = admit(kv, req("b", range(13)))
    return kv, hits


def test_a_shared_block_is_owned_by_as_many_requests_as_its_ref_count():
    kv, hits = _shared()
    kv.pool.ref_cnt[hits[0]] = 1
    with pytest.raises(KVAccountingError, match=f"block {hits[0]} owned by two or more requests"):
        kv.check_accounting()


def test_a_referenced_block_on_the_free_queue_is_caught():
    kv, hits = _shared()
    kv.pool.free_block_queue.append(hits[1])
    with pytest.raises(KVAccountingError, match=f"block {hits[1]} both free and owned"):
        kv.check_accounting()


def test_a_free_cached_block_that_left_the_queue_leaked():
    kv, hits = _shared()
    kv.free("a")
    kv.free("b")
    kv.pool.free_block_queue.remove(hits[2])
    with pytest.raises(KVAccountingError, match=f"block {hits[2]} leaked"):
        kv.check_accounting()


def test_hash_map_and_block_hashes_must_agree():
    kv, hits = _shared()
    h = kv.pool.block_hash[hits[0]]
    kv.pool.cached_block_hash_to_block[h] = hits[1]
    with pytest.raises(KVAccountingError, match=f"block {hits[1]} is in the prefix-cache map"):
        kv.check_accounting()


def test_a_held_block_cached_under_another_prefix_is_caught():
    kv, hits = _shared()
    kv.pool.block_hash[hits[0]], kv.pool.block_hash[hits[1]] = kv.pool.block_hash[hits[1]], kv.pool.block_hash[hits[0]]
    for b in hits[:2]:
        kv.pool.cached_block_hash_to_block[kv.pool.block_hash[b]] = b
    with pytest.raises(KVAccountingError, match=f"block {hits[0]} is cached under a hash that is not"):
        kv.check_accounting()


def test_release_is_all_or_nothing_with_shared_blocks():
    pool = BlockPool(6)
    b = pool.allocate(2)
    pool.touch(b[:1])
    with pytest.raises(KVAccountingError, match="double free"):
        pool.release([b[0], b[0], b[0]])  # two references, three releases
    assert pool.ref_cnt[b[0]] == 2 and pool.num_free_blocks == 3


def test_a_hash_scheme_that_drops_the_salt_from_a_block_is_caught_by_content(monkeypatch):
    """A bug in the shared hashing (the salt enters every block but the first) makes the cache
    and the books' re-derivation agree, so only the content check sees two salts share block 0."""
    import engine.kv_cache as kv_cache
    from engine.kv_cache_utils import hash_block_tokens

    def salt_after_the_first(hashes, block_size, token_ids, extra_keys=None):
        for i in range(len(hashes), len(token_ids) // block_size):
            hashes.append(hash_block_tokens(hashes[i - 1] if i else None,
                                            token_ids[i * block_size:(i + 1) * block_size], extra_keys if i else None))
        return hashes

    monkeypatch.setattr(kv_cache, "extend_block_hashes", salt_after_the_first)
    kv = KVCacheManager(16, BS, enable_caching=True)
    admit(kv, req("a", range(9), salt="tenant-1"))
    hits, _ = kv.get_computed_blocks(req("b", range(9), salt="tenant-2"))
    assert hits == kv.req_blocks["a"][:1]  # the planted bug: another tenant's block 0 is a hit
    with pytest.raises(KVAccountingError, match="cached another salt or prefix under"):
        admit(kv, req("b", range(9), salt="tenant-2"))
    monkeypatch.undo()
    clean = KVCacheManager(16, BS, enable_caching=True)
    admit(clean, req("a", range(9), salt="tenant-1"))
    assert admit(clean, req("b", range(9), salt="tenant-2")) == ([], 0)
