"""The engine pool bounds its process's GPU memory (fuzz.verdict.engine_pool.EnginePool): over its budget it
first releases what the caching allocator caches, then evicts least recently used engines, never
the one asked for; the budget is the worker's GPU allowance (fuzz.campaign.jobs_gpus.WORKER_GPU_BYTES)
less the context; on the CPU nothing is measured or released. CPU tests model the allocator
(live engine bytes, and freed bytes it keeps until released, as it keeps the graph pools of
destroyed CUDA graphs); the `gpu` test runs graph-mode engines on CUDA."""
from __future__ import annotations

import random

import pytest

from fuzz.verdict import engine_pool
from fuzz.verdict.engine_pool import POOL_GPU_BYTES, EnginePool, cuda_reserved_bytes, release_cuda_memory
from fuzz.verdict.gpu_memory import CUDA_CONTEXT_BYTES, WORKER_GPU_BYTES
from fuzz.cases.strategies import FUZZ_MODEL


class Allocator:
    """A caching allocator's figures: bytes of live engines, and bytes freed but kept."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.cached = 0
        self.releases = 0

    def used(self) -> int:
        return sum(self.live.values()) + self.cached

    def release(self) -> None:
        self.cached = 0
        self.releases += 1


@pytest.fixture
def alloc(monkeypatch) -> Allocator:
    """LLMEngine replaced by a fake whose size is its config's seed (bytes; 1 if 0)."""
    a = Allocator()

    class FakeEngine:
        def __init__(self, cfg, record_fa=False) -> None:
            self.seed = cfg.seed
            a.live[id(self)] = cfg.seed or 1

        def grow(self, n: int) -> None:  # graphs captured as Cases run
            a.live[id(self)] += n

        def shutdown(self) -> None:
            a.cached += a.live.pop(id(self))

    monkeypatch.setattr(engine_pool, "LLMEngine", FakeEngine)
    return a


def cfg(seed: int, other: int = 0):
    """A config of an engine of `seed` bytes; `other` makes another engine of that size."""
    return FUZZ_MODEL.replace(seed=seed, step_timeout_s=60.0 + other)


def pool(a: Allocator, capacity: int, budget: int | None) -> EnginePool:
    return EnginePool(capacity, memory_budget=budget, memory_used=a.used, release=a.release)


def seeds(p: EnginePool) -> list[int]:
    return [e.seed for e in p.engines.values()]


def test_under_its_budget_the_pool_is_the_count_bounded_lru(alloc) -> None:
    p = pool(alloc, 3, 1000)
    for s in (4, 5, 6, 4, 7):
        p.get(cfg(s))
    assert seeds(p) == [6, 4, 7]  # 5, the least recently used, went for the count
    assert alloc.releases == 0 and p.evicted_for_memory == 0


def test_over_its_budget_the_cache_goes_before_any_engine(alloc) -> None:
    """Freed engines' bytes the allocator keeps (dead graph pools) are released first: no
    engine is evicted for memory that releasing alone gives back."""
    p = pool(alloc, 3, 8)
    for i in range(10):  # 3 live engines of 2 bytes; the count's evicted ones' bytes stay cached
        p.get(cfg(2, i))
        assert alloc.used() <= 8 + 2  # the budget, and the engine built after the check
    assert alloc.releases >= 1 and p.evicted_for_memory == 0 and len(p.engines) == 3


def test_over_its_budget_the_least_recently_used_engines_go(alloc) -> None:
    p = pool(alloc, 16, 10)
    for s in (4, 4, 4):  # same config: one engine
        p.get(cfg(s))
    engines = [p.get(cfg(s)) for s in (2, 3)]
    engines[0].grow(2)  # seed 4: 4, seed 2: 4, seed 3: 3 bytes: 11 live
    assert seeds(p) == [4, 2, 3]
    p.get(cfg(5))  # 11 > 10: release (nothing cached), evict 4 (LRU): 7; then build 5
    assert seeds(p) == [2, 3, 5] and p.evicted_for_memory == 1 and alloc.used() == 12
    p.get(cfg(2))  # a hit, over budget: evict 3 (2 is out of the LRU, safe)
    assert seeds(p) == [5, 2] and p.evicted_for_memory == 2 and alloc.used() == 9


def test_the_engine_asked_for_stays_when_it_alone_is_over_the_budget(alloc) -> None:
    p = pool(alloc, 16, 10)
    big = p.get(cfg(20))
    assert p.get(cfg(20)) is big and seeds(p) == [20]  # needed now: kept, runs alone
    p.get(cfg(1))  # over budget: big is evicted for the new one
    assert seeds(p) == [1] and alloc.used() == 1


def test_a_campaign_of_growing_engines_stays_within_the_budget(alloc) -> None:
    """A campaign's pattern: engines of many configs, asked for at random, growing as they run
    (graph captures). The pool's memory at each check stays within its budget; the count alone
    (no budget, the pool before it had one) lets cached bytes grow without bound."""
    def campaign(budget: int | None) -> int:
        rng, p, most = random.Random(1), pool(alloc, 16, budget), 0
        for _ in range(400):
            eng = p.get(cfg(rng.randint(1, 40)))
            most = max(most, alloc.used() - eng.seed)  # at the check, before the new one
            eng.grow(rng.randint(0, 3))
        p.close()
        return most

    budget = 200
    assert campaign(budget) <= budget + 3 * 16  # + growth since the last check
    alloc.release()
    assert campaign(None) > 5 * budget  # the bug: evicted engines' bytes kept all campaign long


def test_the_budget_is_the_worker_allowance_less_a_context() -> None:
    assert POOL_GPU_BYTES == WORKER_GPU_BYTES - CUDA_CONTEXT_BYTES
    assert EnginePool().memory_budget == POOL_GPU_BYTES
    assert EnginePool().memory_used is cuda_reserved_bytes and EnginePool().release is release_cuda_memory


def test_on_the_cpu_nothing_is_measured_or_released() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    p = EnginePool(2)
    c = FUZZ_MODEL.replace(layout="tp1pp2")
    try:
        eng = p.get(c)
        assert p.get(c) is eng
        assert cuda_reserved_bytes() == 0 and p.evicted_for_memory == 0
        release_cuda_memory()  # a no-op: CUDA untouched
        assert not torch.cuda.is_initialized()
    finally:
        p.close()


def _graph_engines(n: int, layout: str = "tp1pp2"):
    """(config, drive) for `n` graph-mode CUDA engines of distinct configs and equal size."""
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.verdict.runner import drive

    base = FUZZ_MODEL.replace(device="cuda", layout=layout, dtype="bfloat16", attention_backend="torch_flash",
                              cudagraph_mode="FULL", capture_sizes=(4, 8, 16, 32))
    work = Workload((RequestSpec(tuple(range(1, 20)), 4, 0), RequestSpec((5, 1, 2), 6, 1)))
    for i in range(n):
        c = base.replace(step_timeout_s=60.0 + i)
        yield c, lambda eng, c=c: drive(eng, Case(c, work), Case(c, work).schedule, (), None)


@pytest.mark.gpu
def test_shut_down_graph_engines_free_their_gpu_memory() -> None:
    """engine/cuda_graph.py: an engine's CUDA graphs and their memory pool go with it. cuBLAS's
    cached workspace, first made during a capture inside the graph's pool, pinned that pool for
    good: ~64 MiB a rank leaked with every engine (an H200: 8 tp1pp2 engines, +1 GiB)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.llm_engine import LLMEngine

    seen = []
    for i, (c, run) in enumerate(_graph_engines(9)):
        eng = LLMEngine(c, record_fa=True)
        run(eng)
        eng.shutdown()
        del eng
        release_cuda_memory()
        seen.append(torch.cuda.memory_allocated())
    print("allocated after each engine, MiB:", [b >> 20 for b in seen])
    # From the second on (the first makes what lasts: eager cuBLAS workspaces of reused handles).
    assert max(seen[1:]) - seen[1] <= 160 << 20, [b >> 20 for b in seen]


@pytest.mark.gpu
def test_graph_engines_on_cuda_stay_within_the_pool_budget() -> None:
    """Graph-mode engines of distinct configs through a pool on CUDA with a budget of a few
    engines: the process's reserved memory at each check stays within it (plus the engine
    built after), engines are evicted for it, and what they held is given back."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    release_cuda_memory()
    p = EnginePool(16, memory_budget=None)
    for c, run in _graph_engines(1):
        run(p.get(c))
    one = cuda_reserved_bytes()  # one engine's memory (and what the process's first one keeps)
    p.close()
    release_cuda_memory()
    budget = 3 * one
    bounded, most = EnginePool(16, memory_budget=budget), 0
    for c, run in _graph_engines(12):
        eng = bounded.get(c)
        most = max(most, cuda_reserved_bytes())
        run(eng)
    bounded.close()
    release_cuda_memory()
    print(f"one engine {one >> 20} MiB; budget {budget >> 20} MiB: up to {most >> 20} MiB at a check, "
          f"{bounded.evicted_for_memory} evicted for memory; after close {cuda_reserved_bytes() >> 20} MiB")
    assert most <= budget + one, (most, budget, one)
    assert bounded.evicted_for_memory > 0
    # Back to what the first engine left (an H200: 106 MiB against 104: a segment of cached eager blocks).
    assert cuda_reserved_bytes() <= one + (32 << 20)
