"""BlockPool and KVCacheManager: the paged KV cache's bookkeeping (driver side), with prefix
caching shaped like vLLM v1's (block_pool.py, kv_cache_manager.py).

Block 0 is the null block: never allocated, used by padded block-table rows. Physical KV
tensors live on the ranks; the scheduler only hands out block ids. With prefix caching a
block full of computed tokens is registered under its hash chain (engine/kv_cache_utils.py);
a later request whose prefix hashes the same shares it read-only (ref count > 1). A freed
block keeps its hash while it waits in the free queue, and loses it only when it is evicted
to serve as a fresh block.
"""
from __future__ import annotations

from collections import Counter, deque

from engine.faults import (CACHED_BLOCK_EVICTED_WHILE_REFERENCED, PREFIX_HASH_IGNORES_EXTRA_KEY,
                           PREFIX_HIT_MID_BLOCK_COUNTED_FULL, FaultSet)
from engine.kv_cache_utils import BlockHash, extend_block_hashes


class KVAccountingError(AssertionError):
    """Engine invariant: a block leaked, was freed twice, or is owned, shared or cached in a
    way its ref count, the free queue and the hash map do not all agree on."""


class BlockPool:
    """Blocks 1..num_blocks-1 with ref counts, the free queue and the prefix-cache map.

    `free_block_queue` holds every block with ref count 0, least recently freed first: a
    fresh block comes from its head, evicting that block's cached hash if it has one, so
    cached blocks survive as long as the pool allows."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, faults: FaultSet | None = None) -> None:
        self.num_blocks = num_blocks
        self.faults = faults or FaultSet()
        self.free_block_queue: deque[int] = deque(range(1, num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[BlockHash, int] = {}

    @property
    def free(self) -> deque[int]:
        """The free queue under the name the plain allocator's callers and tests use."""
        return self.free_block_queue

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks from the head of the free queue, each evicted from the cache."""
        if n > len(self.free_block_queue):
            raise KVAccountingError(f"allocate({n}) with {len(self.free_block_queue)} free blocks")
        out = [self.free_block_queue.popleft() for _ in range(n)]
        for b in out:
            self._maybe_evict_cached_block(b)
            self.ref_cnt[b] += 1
        return out

    def _maybe_evict_cached_block(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached_block_hash_to_block.get(h) == b:
                del self.cached_block_hash_to_block[h]

    def touch(self, blocks: list[int]) -> None:
        """A prefix hit takes a reference on each block; a block nobody referenced leaves the
        free queue, or the next allocation would evict it under its reader
        (docs/bug_classes.md#cached_block_evicted_while_referenced)."""
        for b in blocks:
            if self.ref_cnt[b] == 0 and not self.faults.on(CACHED_BLOCK_EVICTED_WHILE_REFERENCED):
                self.free_block_queue.remove(b)
            self.ref_cnt[b] += 1

    def cache_full_block(self, b: int, block_hash: BlockHash) -> None:
        """Register a block full of computed tokens. When another block already holds this
        hash (two requests computed the same prefix side by side), the first stays the cached
        one and `b` stays private: one hash, one block."""
        if block_hash not in self.cached_block_hash_to_block:
            self.cached_block_hash_to_block[block_hash] = b
            self.block_hash[b] = block_hash

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block, in the order given; a block that reaches 0 joins the
        free queue's tail, keeping its hash. All or nothing: a double free changes nothing."""
        for b, k in Counter(blocks).items():
            if b == self.NULL_BLOCK or self.ref_cnt[b] < k:
                raise KVAccountingError(f"double free of block {b}")
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_block_queue.append(b)

    def check(self, owners: Counter) -> None:
        """The books balance: every usable block is free (ref 0, in the free queue once,
        cached or not) or owned (ref count == the number of requests holding it), and the hash
        map and each block's hash agree. `owners`: block -> number of requests holding it."""
        queue = self.free_block_queue
        seen: set[int] = set()
        for b in queue:
            if b in seen or b == self.NULL_BLOCK:
                raise KVAccountingError(f"block {b} is on the free list twice (double free)"
                                        if b in seen else "the null block 0 is on the free list")
            seen.add(b)
        for b in range(1, self.num_blocks):
            n, ref = owners.get(b, 0), self.ref_cnt[b]
            if n != ref and n > 1:
                raise KVAccountingError(f"block {b} owned by two or more requests ({n}) but its ref count is {ref}")
        for b in range(1, self.num_blocks):
            n, ref = owners.get(b, 0), self.ref_cnt[b]
            if b in seen and (n or ref):
                raise KVAccountingError(f"block {b} both free and owned (ref count {ref}, {n} owners)")
            if n != ref:
                raise KVAccountingError(f"block {b} leaked: ref count {ref} but {n} requests hold it")
            if ref == 0 and b not in seen:
                raise KVAccountingError(f"block {b} leaked: ref count 0 but not on the free list")
        self._check_hashes()

    def _check_hashes(self) -> None:
        if self.ref_cnt[self.NULL_BLOCK] or self.block_hash[self.NULL_BLOCK] is not None:
            raise KVAccountingError("the null block 0 is referenced or cached")
        for h, b in self.cached_block_hash_to_block.items():
            if self.block_hash[b] != h:
                raise KVAccountingError(f"block {b} is in the prefix-cache map under a hash it does not hold")
        for b, h in enumerate(self.block_hash):
            if h is not None and self.cached_block_hash_to_block.get(h) != b:
                raise KVAccountingError(f"block {b} holds a hash the prefix-cache map gives to "
                                        f"block {self.cached_block_hash_to_block.get(h)}")


class KVCacheManager:
    """Per-request block lists; grows them as tokens are scheduled, and with prefix caching
    finds a request's cached prefix at admission and caches its blocks as they fill."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 faults: FaultSet | None = None, use_eagle: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.faults = faults or FaultSet()
        self.pool = BlockPool(num_blocks, self.faults)
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks of a request already cached
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.requests: dict = {}  # req_id -> Request, for the books' hash check
        self._expected_hashes: dict[str, list[BlockHash]] = {}
        # Cached hash -> (the content digest it was first held under, holder); per request, the
        # content digest of each of its full blocks, extended as its tokens grow.
        self._hash_content: dict[BlockHash, tuple[int, str]] = {}
        self._contents: dict[str, list[int]] = {}
        # Prefix-cache stats, per lookup as vLLM counts them (a request the pool cannot admit
        # yet is looked up again at its next try).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_short_allocations = 0  # allocate_slots calls the pool could not serve

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        have = len(self.req_blocks.get(req_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def _extra_keys(self, request) -> tuple | None:
        """What besides the tokens decides a block's KV: the cache salt. Left out, differently
        salted requests share KV (docs/bug_classes.md#prefix_hash_ignores_extra_key)."""
        if request.cache_salt is None or self.faults.on(PREFIX_HASH_IGNORES_EXTRA_KEY):
            return None
        return (request.cache_salt,)

    def block_hashes(self, request) -> list[BlockHash]:
        """The hash of each full block of the request's known tokens (prompt and outputs)."""
        self.requests[request.req_id] = request
        hashes = self.req_to_block_hashes.setdefault(request.req_id, [])
        return extend_block_hashes(hashes, self.block_size, request.all_token_ids, self._extra_keys(request))

    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """The longest cached prefix of a request being admitted: (blocks, tokens). None for a
        request that wants prompt logprobs (as vLLM): a hit would skip positions they need."""
        params = getattr(request, "sampling_params", None)
        if not self.enable_caching or (params is not None and params.prompt_logprobs is not None):
            return [], 0
        # At least one token is computed: the last one's logits are the request's next
        # sample. A whole-prompt hit thus drops its last block and recomputes all of it, so a
        # hit always ends on a block edge and the request writes only into blocks of its own.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self.block_hashes(request)[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        if self.use_eagle and hits:
            # EAGLE's draft KV at a block's last position was computed from the token after
            # it, which that block's hash does not cover; the next matched block pins it, so
            # the last matched block is recomputed (vLLM drops it the same way).
            hits.pop()
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req_id: str, num_tokens: int,
                       new_computed_blocks: list[int] | tuple = ()) -> list[int] | None:
        """Make room for `num_tokens` total tokens, the first of them in `new_computed_blocks`
        (a prefix hit, at admission); returns the new block ids, or None when the pool is
        short (the scheduler then preempts)."""
        hits = list(new_computed_blocks)
        n = self.blocks_needed(req_id, num_tokens) - len(hits)
        # Unreferenced hit blocks wait in the free queue: they are not free for this request.
        if n > self.pool.num_free_blocks - sum(1 for b in hits if self.pool.ref_cnt[b] == 0):
            self.num_short_allocations += 1
            return None
        if hits:
            # Touch before allocating, or the allocation could evict a block of the hit.
            self.pool.touch(hits)
            self.num_cached_block[req_id] = len(hits)
        new = self.pool.allocate(n)
        self.req_blocks.setdefault(req_id, []).extend(hits + new)
        return new

    def _num_full_blocks(self, num_computed_tokens: int) -> int:
        """Blocks whose every slot holds computed KV. A block the computed prefix ends inside
        is still being filled; cached, it would serve unwritten slots to a hit
        (docs/bug_classes.md#prefix_hit_mid_block_counted_full)."""
        if self.faults.on(PREFIX_HIT_MID_BLOCK_COUNTED_FULL):
            return -(-num_computed_tokens // self.block_size)
        return num_computed_tokens // self.block_size

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Cache the request's blocks that are full once its first `num_computed_tokens`
        tokens have KV. The caller passes real tokens only, never draft or lookahead slots:
        a draft's KV is not the KV of the token later accepted there."""
        if not self.enable_caching:
            return
        rid = request.req_id
        blocks, hashes = self.req_blocks[rid], self.block_hashes(request)
        start = self.num_cached_block.get(rid, 0)
        # A block has a hash only when all its tokens are known: that bounds it too.
        end = min(self._num_full_blocks(num_computed_tokens), len(hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], hashes[i])
        self.num_cached_block[rid] = max(start, end)

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self.num_cached_block.pop(req_id, None)
        self.req_to_block_hashes.pop(req_id, None)
        self.requests.pop(req_id, None)
        self._expected_hashes.pop(req_id, None)
        self._contents.pop(req_id, None)
        # With caching, tail first: a request's tail is its least shared part, so it is the
        # first evicted (vLLM's order). Without, the order only decides which ids later
        # requests get, and stays as recorded reproducers replay it.
        self.pool.release(blocks[::-1] if self.enable_caching else blocks)

    def check_accounting(self) -> None:
        """The books balance (BlockPool.check), and no request lists a block twice."""
        owners: Counter = Counter()
        for rid, blocks in self.req_blocks.items():
            if len(set(blocks)) != len(blocks):
                dup = next(b for b in blocks if blocks.count(b) > 1)
                raise KVAccountingError(f"block {dup} is in request {rid}'s block list twice")
            owners.update(blocks)
        self.pool.check(owners)
        self._check_holders_hashes()

    def _check_holders_hashes(self) -> None:
        """A cached block a request holds is cached under that request's own prefix and salt:
        otherwise its KV belongs to another prefix. The expected hashes are derived here from
        the tokens and the salt, apart from the hashing the cache itself uses."""
        for rid, request in self.requests.items():
            salt = None if request.cache_salt is None else (request.cache_salt,)
            expected = extend_block_hashes(self._expected_hashes.setdefault(rid, []), self.block_size,
                                           request.all_token_ids, salt)
            contents = self._content(rid, request)
            for i, b in enumerate(self.req_blocks.get(rid, ())):
                h = self.pool.block_hash[b]
                if h is None:
                    continue
                if i >= len(expected) or h != expected[i]:
                    raise KVAccountingError(f"block {b} is cached under a hash that is not request {rid}'s "
                                            f"block {i} (another prefix or cache salt shares its KV)")
                self._check_one_content_per_hash(h, b, rid, contents[i], i)

    def _content(self, rid: str, request) -> list[int]:
        """A digest per full block of the request's salt and tokens up to that block's end, by
        Python's own tuple hash (no code shared with the cache's hashing); a request's tokens
        only grow, so earlier digests stay valid and each step extends the list."""
        out, bs, tokens = self._contents.setdefault(rid, []), self.block_size, request.all_token_ids
        for i in range(len(out), len(tokens) // bs):
            out.append(hash((out[i - 1] if i else ("salt", request.cache_salt), tuple(tokens[i * bs:(i + 1) * bs]))))
        return out

    def _check_one_content_per_hash(self, h: BlockHash, b: int, rid: str, content: int, i: int) -> None:
        """A cached hash stands for one salt and one token prefix, whoever holds it, ever. Checked
        by content, without the cache's hashing: the re-derivation above shares
        extend_block_hashes with the cache, so a scheme that drops the salt from some blocks
        passes it, and shows here once two differently salted requests (or two prefixes) hold a
        block of one hash."""
        first = self._hash_content.setdefault(h, (content, rid))
        if first[0] != content:
            raise KVAccountingError(f"block {b}, held by request {rid} as its block {i}, is cached under the hash "
                                    f"request {first[1]} cached another salt or prefix under (they share its KV)")
