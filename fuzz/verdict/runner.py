"""Driving one run: a Case's workload on a pooled engine, to completion, as a Trace.

`drive` feeds arrivals and aborts by driver step and steps the engine; `run_on_pool` runs it on
the pool's engine for the Case's config and turns what the engine raises into the Violation
that names it (a crash, a hang, a broken invariant), dropping the engine it broke.
"""
from __future__ import annotations

from engine.inproc_world import RankFailure
from engine.kv_cache import KVAccountingError
from engine.llm_engine import EngineInvariantError, LLMEngine, Trace
from engine.schedule import Schedule
from fuzz.cases.case import Case, Workload
from fuzz.verdict.engine_pool import EnginePool
from fuzz.verdict.invariants import FAInvariantError
from fuzz.verdict.properties import CrashViolation, EngineViolation, FAViolation, LivenessViolation


def max_steps_for(w: Workload) -> int:
    """A generous bound on driver steps; a run past it is a liveness failure (a request with
    sampling n > 1 counts n times: its children are scheduled as requests of their own)."""
    return 64 + 4 * w.num_tokens \
        + max((r.arrival_step for r in w.requests), default=0)


def drive(engine: LLMEngine, case: Case, schedule: Schedule, faults: tuple[str, ...],
          forced: dict[str, list[int]] | None) -> Trace:
    """Run the workload to completion on `engine`: arrivals by driver step, each request with
    its sampling params (n > 1 as its children, `Workload.engine_requests`, added one by one
    so each is teacher-forced on its own), then the aborts due at that step, then the step (an
    abort in step lands while it runs)."""
    engine.reset(schedule, faults, scheduler_config=case.config, poison=case.poison)
    pending = sorted(enumerate(case.workload.requests), key=lambda p: (p[1].arrival_step, p[0]))
    ids: dict[int, list[tuple[str, object]]] = {}
    for rid, i, _, params in case.workload.engine_requests():
        ids.setdefault(i, []).append((rid, params))
    aborts = sorted((r.abort_step, i) for i, r in enumerate(case.workload.requests) if r.abort_step is not None)
    step, limit = 0, max_steps_for(case.workload)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, r = pending.pop(0)
            for rid, params in ids[i]:
                # A request without params is added exactly as before sampling existed.
                kw = {} if params is None else {"sampling_params": params}
                engine.add_request(rid, list(r.prompt_token_ids), r.max_tokens,
                                   forced.get(rid) if forced is not None else None, cache_salt=r.cache_salt, **kw)
        due = []
        while aborts and aborts[0][0] <= step:  # abort_step >= arrival_step: it was added
            due.append(aborts.pop(0)[1])
        # An abort in step lands while the step runs (RequestSpec.abort_in_step), the others before it.
        for i in due:
            if not case.workload.requests[i].abort_in_step:
                engine.abort_request([rid for rid, _ in ids[i]])
        in_step = [i for i in due if case.workload.requests[i].abort_in_step]

        def land_in_step() -> None:
            for i in in_step:
                engine.abort_request([rid for rid, _ in ids[i]])
        if not engine.has_unfinished_requests():
            land_in_step()  # no step runs: it lands all the same (finished ids are ignored)
        elif in_step:
            engine.step(between=land_in_step)
        else:
            engine.step()
        step += 1
        if step > limit:
            raise LivenessViolation(f"workload not finished after {limit} driver steps", case)
    trace = engine.trace
    trace.fa_records = engine.collect_fa_records()
    kv = engine.scheduler.kv  # prefix-cache counters (0 with caching off), for the Verdict
    trace.prefix_tokens = (kv.num_queried_tokens, kv.num_hit_tokens)
    return trace


def run_on_pool(pool: EnginePool, case: Case, forced: dict[str, list[int]] | None) -> Trace:
    """`drive` `case` on `pool`'s engine for its config; an engine error is raised as the
    Violation it is, and the engine it came from is discarded (its state is unknown)."""
    cfg = case.config
    try:
        return drive(pool.get(cfg), case, case.schedule, case.faults, forced)
    except RankFailure as e:
        pool.discard(cfg)
        if isinstance(e.__cause__, FAInvariantError):  # refused before a graph replay
            raise FAViolation(f"rank(s) {e.ranks} (graph replay, checked before launch): "
                              f"{e.__cause__}", case) from None
        # A hang or a deadlock is liveness; a rank that raised or died is a crash.
        kind = LivenessViolation if e.kind in ("timeout", "deadlock") else CrashViolation
        raise kind(f"{e.kind} on rank(s) {e.ranks}: {e.detail}", case) from None
    except (EngineInvariantError, KVAccountingError) as e:
        pool.discard(cfg)
        raise EngineViolation(str(e), case) from None
    except LivenessViolation:
        pool.discard(cfg)
        raise
    except Exception as e:  # any other engine error is a crash, keyed by its signature
        pool.discard(cfg)
        raise CrashViolation(f"{type(e).__name__}: {e}", case) from e
