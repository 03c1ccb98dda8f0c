"""The Cases a check derives from the Case under test, and which Cases get each check.

The prefix-cache twin (caching off), a random-sampling request run alone, and the Cases
the determinism oracle re-runs: each is the Case with one thing changed, so a difference
between the two runs is that thing's.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

from engine.config import EngineConfig
from engine.sample.sampling_params import request_seed
from engine.schedule import Schedule
from fuzz.cases.case import Case, RequestSpec, Workload, reference_config, steps_to_finish

DETERMINISM_ONE_IN = 20  # Cases, chosen by hash, that run twice (CPU), besides those below
# With three TP ranks or more, also every Case of at most this many driver steps (its requests'
# `steps_to_finish`, summed). An arrival-order reduction shows in every all-reduce, so a short
# Case shows it as well as a long one; re-running every such Case cost 0.4 x the examples/s at
# tp8pp1 (bench/results/oracle_cost_same_cases_cpu.json), a re-run costing what the run did.
DETERMINISM_TP_STEPS = 8


def prefix_twin_due(case: Case) -> bool:
    """Cases whose run with prefix caching is compared bitwise with the same run without it:
    caching on, CPU, float32 (where the engine promises equality; in half precision and on
    CUDA the reference oracle's tolerance judges caching on against off)."""
    cfg = case.config
    return cfg.enable_prefix_caching and cfg.device == "cpu" and cfg.dtype == "float32"


def caching_off(case: Case) -> Case:
    """The prefix-cache twin: the same Case (layout, mode, schedule, faults) with caching off."""
    return replace(case, config=case.config.replace(enable_prefix_caching=False))


def reference_case(case: Case) -> Case:
    """The reference run's Case (`reference_config`). A bug everywhere is in the reference run
    too; the reference sees the test run's memory model: what a reset leaves in memory (poison)."""
    return Case(reference_config(case.config), case.workload,
                faults=case.faults if case.fault_scope == "everywhere" else (), poison=case.poison)


def plain_twin(case: Case) -> Case:
    """The Case's plain form in its own dtype: the reference's Case (tp1pp1, eager,
    synchronous, plain decoding, no prefix caching, the same weights) computing in the test
    run's dtype. What the half-precision bitwise check compares a tp1 run with
    (fuzz.verdict.bitwise.TWIN)."""
    ref = reference_case(case)
    return replace(ref, config=ref.config.replace(dtype=case.config.dtype))


def alone_config(cfg: EngineConfig) -> EngineConfig:
    """The config a random-sampling request runs alone with (`Harness.alone_noise`): the
    reference's, with a token budget and KV blocks that take any prompt in one step, so its
    prefill is never chunked and it is never preempted."""
    ref = reference_config(cfg)
    return ref.replace(max_num_batched_tokens=max(ref.max_num_batched_tokens, ref.max_model_len),
                       num_gpu_blocks=max(ref.num_gpu_blocks, -(-ref.max_model_len // ref.block_size) + 1))


def alone_case(case: Case, rid: str, r: RequestSpec, params, forced: list[int]) -> Case:
    """Request `rid` (a workload request or one of its n > 1 children, with `params`) alone on
    `alone_config`, as "r0", seeded as the engine seeds `rid` (`request_seed`: its own seed, or
    one derived from its id), so its generator is the one `rid` has in the Case. Teacher-forced
    with `forced`, it stops where the Case's run did (max_tokens no more than that)."""
    cfg = alone_config(case.config)
    p = replace(params, seed=request_seed(params, cfg.seed, rid))
    n = max(1, len(forced), p.min_tokens)
    return Case(cfg, Workload((RequestSpec(r.prompt_token_ids, min(n, r.max_tokens), sampling=p),)),
                faults=case.faults if case.fault_scope == "everywhere" else (), poison=case.poison)


def sampled_for_determinism(case: Case) -> bool:
    """Every short Case (DETERMINISM_TP_STEPS) whose TP group has three ranks or more: there
    the order partials are summed in can change bits (two partials commute exactly), so only
    there can another Schedule show a timing-dependent reduction
    (docs/bug_classes.md#allreduce_arrival_order). Of all others about one in
    DETERMINISM_ONE_IN, fixed by its content (never by chance): a Case always gets the same
    checks."""
    cfg = case.config
    if cfg.tensor_parallel_size >= 3 and sum(steps_to_finish(r, cfg) for r in case.workload.requests) \
            <= DETERMINISM_TP_STEPS:
        return True
    return hashlib.sha256(case.key().encode()).digest()[0] % DETERMINISM_ONE_IN == 0


def other_schedule(s: Schedule) -> Schedule:
    """The Schedule the determinism oracle re-runs a Case under: ranks picked at random from
    another seed, copies delayed and the host running ahead by other amounts, so the order in
    which ranks reach each collective and when copies land both differ from the Case's own run
    (a correct engine's results depend on neither). A pure function of `s`.

    The engine's own decisions stay: async_wait, and the seed its driver draws them from
    (engine/schedule.py: when to wait for the step in flight), which decide how requests are
    batched; in bf16 another batching may round differently without any bug. With async_wait
    the seed is kept, and the ranks' picks still differ (other copy and run-ahead draws from
    the same stream, and random order where the Case's own was natural)."""
    keep_seed = s.rank_order != "random" or s.async_wait != 0.0
    return Schedule(seed=s.seed if keep_seed else (s.seed + 0x9E37) % 2 ** 16,
                    rank_order="random", copy_delay=0.5 if s.copy_delay != 0.5 else 0.9,
                    prepare_ahead=1.0 if s.prepare_ahead != 1.0 else 0.5, async_wait=s.async_wait)


def rescheduled(case: Case) -> Case:
    """The determinism oracle's other run: `case` under `other_schedule`."""
    return replace(case, schedule=other_schedule(case.schedule))
