"""Harness: run a Case on a reused engine, run its reference, check every property.

Engines are expensive (threads or processes per rank, weight shards, KV cache, captured
graphs), so one engine per config serves many Cases and resets between them; reset
poisons buffers, so a Case's verdict never depends on the Cases before it. Reference runs
are cached by (reference config, workload).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig
from engine.inproc_world import RankFailure
from engine.kv_cache import KVAccountingError
from engine.llm_engine import EngineInvariantError, LLMEngine, Trace
from engine.schedule import Schedule
from fuzz.case import Case, Workload, reference_config
from fuzz.invariants import FAInvariantError
from fuzz.jobs_gpus import CUDA_CONTEXT_BYTES, WORKER_GPU_BYTES
from fuzz.oracles import ORACLES, hf
from fuzz.oracles.solo import SoloOracle
from fuzz.properties import (CrashViolation, EngineViolation, FAViolation, LivenessViolation, LogitsMismatch,
                             LogitsReport, Violation, check_determinism, check_fa_records, check_logits)
from fuzz.tolerance import Tolerance, is_half

# Share of the harness's time the transformers oracle may take on passing Cases.
TRANSFORMERS_SHARE = 0.25
DETERMINISM_ONE_IN = 20  # Cases, chosen by hash, that run twice (CPU)


@dataclass(slots=True)
class Verdict:
    case: Case
    logits: LogitsReport  # the comparison with the largest error/tolerance
    oracles: dict  # oracle name -> LogitsReport, or True for determinism
    fa_calls_checked: int
    num_steps: int
    num_preemptions: int
    max_in_flight: int
    seconds: float
    engine_seconds: float


def _pow2(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def engine_config(cfg: EngineConfig) -> EngineConfig:
    """The config an engine is built with for `cfg`: token budget and KV blocks rounded up,
    since they only size buffers, and no n-gram speculation, which lives in the driver (the
    Case's own settings go to the scheduler and proposer at reset). EAGLE stays: its draft
    head is part of the last rank's runner, so it is built with the engine."""
    spec = {} if cfg.speculative_method == "eagle" else dict(speculative_method="none", num_speculative_tokens=0)
    return cfg.replace(max_num_batched_tokens=_pow2(cfg.max_num_batched_tokens, 64),
                       num_gpu_blocks=_pow2(cfg.num_gpu_blocks, 128), **spec)


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


# What a pool lets its process's CUDA caching allocator hold: the worker's GPU allowance
# (fuzz/jobs_gpus.py, by which workers are dealt GPUs) less the context, which the allocator's
# figures leave out. One constant bounds both.
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
    (The growth that asked for the budget, 18.6 GiB a worker after 7 minutes, was engines'
    graph pools pinned by cuBLAS workspaces, fixed in engine/cuda_graph.py; the budget is what
    guarantees the bound whatever an engine holds.)"""

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
    miss 28.8 % with 16, 29.6 % with 8. At ~10 MB an engine, 16 instead of 8 held ~80 MB
    more (a 30-minute campaign's memory grew while the pool filled) for almost no hits."""
    return 16 if num_layouts * num_modes <= 4 else 8


def max_steps_for(w: Workload) -> int:
    """A generous bound on driver steps; a run past it is a liveness failure."""
    return 64 + 4 * sum(len(r.prompt_token_ids) + r.max_tokens for r in w.requests) \
        + max((r.arrival_step for r in w.requests), default=0)


def drive(engine: LLMEngine, case: Case, schedule: Schedule, faults: tuple[str, ...],
          forced: dict[str, list[int]] | None) -> Trace:
    """Run the workload to completion on `engine` (arrivals by driver step)."""
    engine.reset(schedule, faults, scheduler_config=case.config, poison=case.poison)
    pending = sorted(enumerate(case.workload.requests), key=lambda p: (p[1].arrival_step, p[0]))
    step, limit = 0, max_steps_for(case.workload)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, r = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(rid, list(r.prompt_token_ids), r.max_tokens,
                               forced.get(rid) if forced is not None else None)
        if engine.has_unfinished_requests():
            engine.step()
        step += 1
        if step > limit:
            raise LivenessViolation(f"workload not finished after {limit} driver steps", case)
    trace = engine.trace
    trace.fa_records = engine.collect_fa_records()
    return trace


# References are reused when the same workload runs again: in shrinking (the same workload
# on simpler layouts, modes and schedules) and Hypothesis's mutations within a chunk, both
# recent. A campaign rarely draws a workload twice, so a large cache only holds memory
# (~0.14 MB a reference: 256 of them grew a 30-minute campaign by ~35 MB).
REFERENCE_CACHE_SIZE = 64


def sampled_for_determinism(case: Case) -> bool:
    """About one Case in DETERMINISM_ONE_IN, fixed by its content (never by chance)."""
    return hashlib.sha256(case.key().encode()).digest()[0] % DETERMINISM_ONE_IN == 0


class Harness:
    def __init__(self, pool_capacity: int = 16, oracles: frozenset[str] = frozenset()) -> None:
        import torch

        # CPU GEMMs round differently per thread count: one compute thread makes verdicts
        # and reproducers identical across machines and across the two worlds.
        torch.set_num_threads(1)
        self.pool = EnginePool(pool_capacity)
        self.ref_cache: OrderedDict[str, Trace] = OrderedDict()
        self.engine_seconds = 0.0
        self.check_seconds = 0.0
        self.always = frozenset(oracles)  # oracles asked for on every Case (--oracle)
        unknown = self.always - set(ORACLES)
        if unknown:
            raise ValueError(f"oracle: unknown oracle {sorted(unknown)[0]!r}")
        if "transformers" in self.always and not hf.available():
            raise ValueError("oracle: transformers is not installed (pip install transformers)")
        self.solo = SoloOracle()
        self.transformers = hf.TransformersOracle() if hf.available() else None
        if self.transformers is None:  # a core dependency; a hand-made environment may lack it
            sys.stderr.write("llmfuzz: transformers is not installed: the transformers oracle is off "
                             "(pip install transformers)\n")

    def reference(self, case: Case) -> Trace:
        cfg = reference_config(case.config)
        # A bug everywhere is in the reference run too (and changes it: part of the key).
        ref_case = Case(cfg, case.workload, faults=case.faults if case.fault_scope == "everywhere" else ())
        key = repr(cfg.to_dict()) + ref_case.to_json()
        if key not in self.ref_cache:
            trace = self._run(ref_case, None)
            # Only the reference's tokens and logits are compared against. Its FA records
            # (hundreds per Case, each holding small tensors) made this cache the largest
            # memory user of a long campaign: keep them out of it.
            trace.fa_records = []
            self.ref_cache[key] = trace
            if len(self.ref_cache) > REFERENCE_CACHE_SIZE:
                self.ref_cache.popitem(last=False)
        return self.ref_cache[key]

    def _run(self, case: Case, forced: dict[str, list[int]] | None) -> Trace:
        cfg = case.config
        t0 = time.perf_counter()
        try:
            return drive(self.pool.get(cfg), case, case.schedule, case.faults, forced)
        except RankFailure as e:
            self.pool.discard(cfg)
            if isinstance(e.__cause__, FAInvariantError):  # refused before a graph replay
                raise FAViolation(f"rank(s) {e.ranks} (graph replay, checked before launch): "
                                  f"{e.__cause__}", case) from None
            # A hang or a deadlock is liveness; a rank that raised or died is a crash.
            kind = LivenessViolation if e.kind in ("timeout", "deadlock") else CrashViolation
            raise kind(f"{e.kind} on rank(s) {e.ranks}: {e.detail}", case) from None
        except (EngineInvariantError, KVAccountingError) as e:
            self.pool.discard(cfg)
            raise EngineViolation(str(e), case) from None
        except LivenessViolation:
            self.pool.discard(cfg)
            raise
        except Exception as e:  # any other engine error is a crash, keyed by its signature
            self.pool.discard(cfg)
            raise CrashViolation(f"{type(e).__name__}: {e}", case) from e
        finally:
            self.engine_seconds += time.perf_counter() - t0

    def run_case(self, case: Case) -> Trace:
        """The test run, teacher-forced with the reference's tokens."""
        ref = self.reference(case)
        return self._run(case, ref.output_token_ids())

    def check(self, case: Case) -> Verdict:
        """Run `case`, its reference and its oracles; raise the first Violation, else return a
        Verdict. Checks run cheapest first: FA invariants, reference, solo, transformers,
        determinism. A failure of the run's logits or FA calls carries the transformers
        oracle's verdict on the same run as its `second_opinion`."""
        case.validate()
        t0 = time.perf_counter()
        e0 = self.engine_seconds
        try:
            ref = self.reference(case)
            forced = ref.output_token_ids()
            test = self._run(case, forced)
            oracles, tol = self.oracle_traces(case, forced, transformers=self._transformers_due())
            try:
                n_fa = check_fa_records(case, test.fa_records)
                reports = {name: check_logits(case, trace, test, tol, name)
                           for name, trace in {"reference": ref, **oracles}.items()}
            except (FAViolation, LogitsMismatch) as v:
                v.second_opinion = self._second_opinion(case, test, forced, tol)
                raise
            if case.config.device == "cpu" and ("determinism" in self.always or sampled_for_determinism(case)):
                check_determinism(case, test, self._run(case, forced))
                reports["determinism"] = True
        finally:
            self.check_seconds += time.perf_counter() - t0
        worst = max((r for r in reports.values() if isinstance(r, LogitsReport)), key=lambda r: r.ratio)
        return Verdict(case, worst, reports, n_fa, test.num_steps, test.num_preemptions, test.max_in_flight,
                       time.perf_counter() - t0, self.engine_seconds - e0)

    def oracle_traces(self, case: Case, forced: dict, transformers: bool = False) -> tuple[dict, Tolerance]:
        """The sequence oracles' traces for `case` teacher-forced with `forced` (solo, and
        transformers when asked), and the tolerance they and the reference are judged with:
        in half precision the noise measured by solo in the test dtype against solo32."""
        cfg, ref_cfg = case.config, reference_config(case.config)
        traces = {"solo": self.solo.trace(ref_cfg, case.workload, forced)}
        noise = None
        if is_half(cfg.dtype):  # the baseline: plain arithmetic in the test dtype
            noise = Tolerance.measure(self.solo.trace(cfg, case.workload, forced), traces["solo"])
        if transformers and self.transformers is not None:
            traces["transformers"] = self.transformers.trace(ref_cfg, case.workload, forced)
        return traces, Tolerance(cfg.dtype, cfg.hidden_size, noise)

    def _transformers_due(self) -> bool:
        if self.transformers is None:
            return False
        return "transformers" in self.always or \
            self.transformers.seconds <= TRANSFORMERS_SHARE * self.check_seconds

    def _second_opinion(self, case: Case, test: Trace, forced: dict, tol: Tolerance) -> str | None:
        if self.transformers is None:
            return None
        tf = self.transformers.trace(reference_config(case.config), case.workload, forced)
        try:
            r = check_logits(case, tf, test, tol, "transformers")
        except Violation as w:
            return f"transformers also fails: {w.message}"
        return f"transformers passes (error/tolerance {r.ratio:.3g})"

    def clear_caches(self) -> None:
        """Forget cached references and oracle results, and the engine's process-wide caches
        of graph traces and attention launch plans (each bounded; tests measure memory)."""
        from engine import cpu_graph
        from engine.attention import reference

        self.ref_cache.clear()
        for oracle in (self.solo, self.transformers):
            if oracle is not None:
                oracle.results.clear()
        cpu_graph.clear_templates()
        reference.clear_plans()

    def close(self) -> None:
        self.pool.close()
