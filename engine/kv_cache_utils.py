"""Block hashes for prefix caching (vLLM v1's kv_cache_utils): a hash chain over full blocks.

A block's KV depends on every token before it, so a block's hash covers its parent's hash,
its own token ids and, for the first block, the request's extra keys (the cache salt): equal
hashes mean an equal prefix up to the end of that block, under the same salt. Only full
blocks are hashed: a partial block's KV is still being written, and its tokens are not all
known. The hash is sha256 over a canonical JSON encoding, never Python's `hash`, which is
salted per process: the driver and a reproducer run in another process must agree.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)


def hash_block_tokens(parent_block_hash: BlockHash | None, curr_block_token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """The hash of one full block, chained on its parent's (None for the first block)."""
    payload = [parent_block_hash.hex() if parent_block_hash is not None else None,
               [int(t) for t in curr_block_token_ids],
               list(extra_keys) if extra_keys is not None else None]
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=True).encode()
    return BlockHash(hashlib.sha256(encoded).digest())


def extend_block_hashes(block_hashes: list[BlockHash], block_size: int, token_ids: Sequence[int],
                        extra_keys: tuple | None = None) -> list[BlockHash]:
    """Append the hashes of the blocks of `token_ids` that became full since `block_hashes`
    was last extended (a request's tokens only grow, so earlier hashes stay valid)."""
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[i - 1] if i else None
        # The salt enters the first block only; the chain carries it to every later block.
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                              extra_keys if i == 0 else None))
    return block_hashes


def hash_request_tokens(block_size: int, token_ids: Sequence[int],
                        extra_keys: tuple | None = None) -> list[BlockHash]:
    """The hash of every full block of `token_ids`; a trailing partial block has none."""
    return extend_block_hashes([], block_size, token_ids, extra_keys)
