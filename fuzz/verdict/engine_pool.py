"""The engine pool: live engines reused across Cases, keyed by the config they are built with.

Engines are expensive (threads or processes per rank, weight shards, KV cache, captured
graphs), so one engine per config serves many Cases and resets between them (reset poisons
buffers, so a Case's verdict never depends on the Cases before it). The pool bounds how many
it keeps and, on CUDA, the GPU memory they hold.
"""
from __future__ import annotations

import ctypes
import functools
from collections import OrderedDict
from typing import Callable

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from fuzz.verdict.gpu_memory import CUDA_CONTEXT_BYTES, WORKER_GPU_BYTES


def _pow2(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def engine_config(cfg: EngineConfig) -> EngineConfig:
    """The config an engine is built with for `cfg`: token budget, KV blocks and max_num_seqs
    rounded up, since on the ranks they only size buffers, and no n-gram speculation, which lives in the driver (the
    Case's own settings go to the scheduler and proposer at reset). EAGLE stays: its draft
    head is part of the last rank's runner, so it is built with the engine."""
    spec = {} if cfg.speculative_method == "eagle" else dict(speculative_method="none", num_speculative_tokens=0)
    # Prefix caching is the scheduler's alone (set per Case at reset): one engine serves both.
    return cfg.replace(max_num_batched_tokens=_pow2(cfg.max_num_batched_tokens, 64), max_num_seqs=_pow2(cfg.max_num_seqs, 8),
                       num_gpu_blocks=_pow2(cfg.num_gpu_blocks, 128), enable_prefix_caching=False, **spec)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Give the pages of freed heap memory back to the OS. Engines are built and dropped all
    campaign long, each by its own rank threads, and glibc keeps what they free in per-thread
    arenas: measured over a 6-minute campaign, 170 MB of the RSS was free heap (RSS grew
    while live allocations stayed flat); trimming returns it. A no-op off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# What a pool lets its process's CUDA caching allocator hold: the allowance less the context.
POOL_GPU_BYTES = WORKER_GPU_BYTES - CUDA_CONTEXT_BYTES


def cuda_reserved_bytes() -> int:
    """What this process's CUDA caching allocator holds, over every device it uses: its engines
    (weights, KV caches, the graph pools of captured CUDA graphs), the oracles' tensors and the
    blocks it caches. 0 while CUDA is untouched (a CPU campaign never initializes it)."""
    import torch

    if not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))


def release_cuda_memory() -> None:
    """Give the GPU memory this process's caching allocator caches back to the driver: freed
    blocks, and the private pools of destroyed CUDA graphs, which stay reserved until
    empty_cache. gc first: an engine's ranks and graphs can sit in reference cycles, and
    their memory is freed only once collected. A no-op while CUDA is untouched."""
    import gc

    import torch

    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


class EnginePool:
    """LRU of live engines keyed by their built config (schedule, faults and scheduling
    limits are per Case), bounded by count (`capacity`) and by GPU memory: before an engine is
    handed out, while `memory_used()` (this process's reserved CUDA memory) is above
    `memory_budget`, the pool releases what the allocator caches and then evicts the least
    recently used other engines. Releasing only then keeps the allocator's cache (and its
    speed) below the budget. The engine asked for is never evicted for memory: it is needed
    now (one engine over the budget runs alone). With --world torch the engines' rank
    processes hold their own memory, which dies with them at eviction: the count bounds it.
    The budget guarantees the bound whatever an engine holds (a graph pool pinned by a library's
    workspace, say)."""

    def __init__(self, capacity: int = 16, memory_budget: int | None = POOL_GPU_BYTES,
                 memory_used: Callable[[], int] = cuda_reserved_bytes,
                 release: Callable[[], None] = release_cuda_memory) -> None:
        self.capacity = capacity
        self.memory_budget, self.memory_used, self.release = memory_budget, memory_used, release
        self.engines: OrderedDict[str, LLMEngine] = OrderedDict()
        self.evicted_for_memory = 0

    def get(self, cfg: EngineConfig) -> LLMEngine:
        cfg = engine_config(cfg)
        key = repr(cfg.to_dict())
        eng = self.engines.pop(key, None)
        # Memory first, so a new engine is built with the memory of those evicted back (the
        # engine asked for is out of the LRU now, safe from it).
        if self._over_budget():
            self.release()
            while self.engines and self._over_budget():
                self._evict()
                self.release()  # freed blocks count as reserved until released
                self.evicted_for_memory += 1
        if eng is None:
            eng = LLMEngine(cfg, record_fa=True)
            while len(self.engines) >= self.capacity:
                self._evict()
        self.engines[key] = eng
        return eng

    def _over_budget(self) -> bool:
        return self.memory_budget is not None and self.memory_used() > self.memory_budget

    def _evict(self) -> None:
        self.engines.popitem(last=False)[1].shutdown()
        release_freed_memory()

    def discard(self, cfg: EngineConfig) -> None:
        eng = self.engines.pop(repr(engine_config(cfg).to_dict()), None)
        if eng is not None:
            eng.shutdown()
            release_freed_memory()

    def close(self) -> None:
        while self.engines:
            self.engines.popitem()[1].shutdown()
        release_freed_memory()


def pool_capacity_for(num_layouts: int, num_modes: int) -> int:
    """Engines worth keeping for a campaign over these layouts and modes. One (layout, mode)
    cell needs ~5 engines over a campaign (capture sizes, sequence parallelism, EAGLE and
    the token budget are part of an engine), and the campaign visits layouts round robin,
    so once the working set outgrows the pool the LRU barely hits whatever its size. Measured
    by replaying the engine keys of 60 chunks through an LRU: 2 layouts x 2 modes miss 4.6 %
    with 16 engines (21 % with 8); 4 x 2 miss 23 % with 16, 26 % with 8; the default 12 x 2
    miss 28.8 % with 16, 29.6 % with 8 (41 % and 45 % since async scheduling, which the
    ranks are built with: 161 distinct engines over those chunks, 128 without it). At ~10 MB an engine, 16 instead of
    8 held ~80 MB more (a 30-minute campaign's memory grew while the pool filled) for few hits."""
    return 16 if num_layouts * num_modes <= 4 else 8

