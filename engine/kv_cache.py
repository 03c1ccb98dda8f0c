"""BlockPool and KVCacheManager: the paged KV cache's bookkeeping (driver side).

Block 0 is the null block: never allocated, used by padded block-table rows. Physical KV
tensors live on the ranks; the scheduler only hands out block ids.
"""
from __future__ import annotations

from collections import deque


class KVAccountingError(AssertionError):
    """Engine invariant: a block leaked, was freed twice or is owned twice."""


class BlockPool:
    """Free list of block ids 1..num_blocks-1 (0 is the null block)."""

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self._is_free = [False] + [True] * (num_blocks - 1)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise KVAccountingError(f"allocate({n}) with {len(self.free)} free blocks")
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if b == self.NULL_BLOCK or self._is_free[b]:
                raise KVAccountingError(f"double free of block {b}")
            self._is_free[b] = True
            self.free.append(b)


class KVCacheManager:
    """Per-request block lists; grows them as tokens are scheduled."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        have = len(self.req_blocks.get(req_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate_slots(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Make room for `num_tokens` total tokens; returns the new block ids, or None when
        the pool is short (the scheduler then preempts)."""
        n = self.blocks_needed(req_id, num_tokens)
        if n > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(n)
        self.req_blocks.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> None:
        self.pool.release(self.req_blocks.pop(req_id, []))

    def check_accounting(self) -> None:
        """No block owned twice, none leaked: owned + free == all usable blocks."""
        if len(set(self.pool.free)) != len(self.pool.free):
            dup = next(b for b in self.pool.free if self.pool.free.count(b) > 1)
            raise KVAccountingError(f"block {dup} is on the free list twice (double free)")
        owned = [b for blocks in self.req_blocks.values() for b in blocks]
        if len(owned) != len(set(owned)):
            dup = next(b for b in owned if owned.count(b) > 1)
            raise KVAccountingError(f"block {dup} owned by two requests")
        free = set(self.pool.free)
        if free & set(owned):
            raise KVAccountingError(f"block {min(free & set(owned))} both free and owned")
        if len(owned) + len(free) != self.pool.num_blocks - 1:
            raise KVAccountingError(f"{self.pool.num_blocks - 1 - len(owned) - len(free)} blocks leaked")
