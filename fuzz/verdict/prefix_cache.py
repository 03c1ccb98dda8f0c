"""An independent model of a block prefix cache: which prompt tokens a request may find cached,
given what the engine served before it. Written from the definition below, sharing no code
with any engine (not ours, not vLLM's), so that it can judge what an engine *reports* about
its own cache hits (vLLM: each request's `num_cached_tokens`).

The definition
--------------
- The cache holds the KV of FULL blocks of `block_size` tokens. A block is named by a hash of
  (its parent block's name, its tokens, its extra keys); the first block's parent is a fixed
  root. Chained by the parent, a block's name stands for the whole prefix up to its end.
- Extra keys: the request's cache salt on its FIRST block (chained, it separates every later
  block too), and `extra` keys that apply to every block (a LoRA adapter's name, say). An
  empty salt is no salt: it separates nothing.
- A request's lookup finds the longest run of its prompt's blocks, from the first, whose
  names are cached; never its last prompt token, which must be computed for the logits: a
  hit is at most floor((len(prompt) - 1) / block_size) blocks.
- A served request leaves the blocks of the tokens whose KV it computed (prompt, then
  output). Where only part of that is known (a request aborted mid-way: its output was never
  seen), `add(..., unknown=n)` says that up to n more tokens past the known ones may have been
  computed: a lookup that matches the known tokens up to their end may go on through n
  tokens of anything. An upper bound stays an upper bound.

`PrefixCacheModel.hit(...)` is what the model allows: with every block ever served, and no
eviction, the largest hit possible; a model of only the blocks certainly computed gives the
least an engine that evicted nothing must find.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

ROOT = b"prefix-cache-root"


def block_name(parent: bytes, tokens: Sequence[int], keys: tuple = ()) -> bytes:
    """A full block's name: (parent's name, tokens, extra keys), hashed."""
    return hashlib.sha256(repr((parent, tuple(int(t) for t in tokens), keys)).encode()).digest()


def block_names(tokens: Sequence[int], block_size: int, salt: str | None = None, extra: tuple = ()) -> list[bytes]:
    """The names of every full block of `tokens`, first to last, chained."""
    out, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        keys = (*extra, *((("cache_salt", salt),) if i == 0 and salt else ()))
        parent = block_name(parent, tokens[i * block_size:(i + 1) * block_size], keys)
        out.append(parent)
    return out


@dataclass
class _Open:
    """A served request's unknown continuation: past `tail` (its known tokens after its last
    full block, whose name is the parent), anything, up to `reach` tokens from the start."""

    tail: tuple[int, ...]
    reach: int


@dataclass
class PrefixCacheModel:
    """The blocks a cache may hold (`add` each served request), and the hit a lookup may find
    (`hit`). `within`: other models whose blocks count as this one's (a union, never copied)."""

    block_size: int
    names: set = field(default_factory=set)
    open_tails: dict = field(default_factory=dict)  # parent's name -> [_Open]

    def add(self, tokens: Sequence[int], salt: str | None = None, extra: tuple = (), unknown: int = 0) -> None:
        names = block_names(tokens, self.block_size, salt, extra)
        self.names.update(names)
        if unknown > 0:
            full = len(names) * self.block_size
            self.open_tails.setdefault(names[-1] if names else (ROOT, salt or None, extra), []).append(
                _Open(tuple(int(t) for t in tokens[full:]), len(tokens) + unknown))

    def hit(self, prompt: Sequence[int], salt: str | None = None, extra: tuple = (),
            within: Iterable["PrefixCacheModel"] = ()) -> int:
        """Prompt tokens a lookup may find cached: whole blocks, the last token never."""
        models = (self, *within)
        cap = max(0, (len(prompt) - 1) // self.block_size)
        names = block_names(prompt, self.block_size, salt, extra)[:cap]
        found = 0
        for i, name in enumerate(names):
            if any(name in m.names for m in models):
                found = i + 1
                continue
            parent = names[i - 1] if i else (ROOT, salt or None, extra)
            block = tuple(int(t) for t in prompt[i * self.block_size:(i + 1) * self.block_size])
            reach = max((o.reach for m in models for o in m.open_tails.get(parent, ())
                         if block[:len(o.tail)] == o.tail), default=0)
            found = max(found, min(cap, reach // self.block_size))
            break
        return found * self.block_size
