"""Async scheduling: a decode scheduled ahead of its step in flight, on a placeholder the ranks
fill from their own sampled ids, gives bitwise the tokens and logits of synchronous scheduling
(fp32, CPU) over chunked prefill, PP, speculative decoding, preemption, prefix caching, aborts,
stop tokens, penalties, graphs and teacher forcing; the fault async_placeholder_not_replaced
is seen; the Schedule's async_wait replays exactly."""
from __future__ import annotations

import pytest
import torch

from engine import LLMEngine
from engine.config import EngineConfig
from engine.faults import ASYNC_PLACEHOLDER_NOT_REPLACED
from engine.kv_cache import KVAccountingError
from engine.sample.sampling_params import SamplingParams
from engine.schedule import Schedule
from engine_testutil import Arrival, capture_scheduler_outputs, mixed_arrivals, run_arrivals

BASE = EngineConfig(max_num_batched_tokens=16, num_gpu_blocks=64, max_model_len=48, async_scheduling=True)
ARRIVALS = mixed_arrivals(1, [5, 20, 3, 9], 128, (3, 10)) + mixed_arrivals(2, [7, 2], 128, (4, 8), "late", 3)


@pytest.fixture(scope="module")
def engines():
    """Engines built with async scheduling (they also run synchronously), one per build."""
    built: dict[str, LLMEngine] = {}

    def get(**build) -> LLMEngine:
        key = repr(sorted(build.items()))
        if key not in built:
            built[key] = LLMEngine(BASE.replace(**build))
        return built[key]
    yield get
    for e in built.values():
        e.shutdown()


def run(e: LLMEngine, arrivals, asynchronous: bool, faults=(), schedule=None, params=None, aborts=None, **sched):
    """Drive the workload; `params`: request -> SamplingParams; `aborts`: driver step -> ids."""
    cfg = e.cfg.replace(async_scheduling=asynchronous, **sched)
    e.reset(schedule, faults, scheduler_config=cfg)
    pending, step = sorted(arrivals, key=lambda a: a.at_step), 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0].at_step <= step:
            a = pending.pop(0)
            kw = {"sampling_params": params[a.req_id]} if params and a.req_id in params else {}
            e.add_request(a.req_id, list(a.prompt), a.max_tokens, list(a.forced) if a.forced else None, **kw)
        if aborts and step in aborts:
            e.abort_request(aborts[step])
        if e.has_unfinished_requests():
            e.step()
        step += 1
        assert step < 2000
    return e.trace


def assert_bitwise_equal(a, b) -> None:
    """Equal tokens, logits, stops; an aborted request over the positions both runs have (an
    abort comes at a driver step, and the runs make different progress by then)."""
    ta, tb = a.output_token_ids(), b.output_token_ids()
    assert ta.keys() == tb.keys()
    for rid in tb:
        n = min(len(ta[rid]), len(tb[rid])) if rid in b.aborted else len(tb[rid])
        assert ta[rid][:n] == tb[rid][:n] and (rid in b.aborted or len(ta[rid]) == n), rid
        for i, (x, y) in enumerate(zip(a.tokens[rid][:n], b.tokens[rid][:n])):
            assert x.sampled == y.sampled and torch.equal(x.logits, y.logits), (rid, i)
    assert a.stop_reasons == b.stop_reasons and a.aborted.keys() == b.aborted.keys()


CASES = {  # name -> (engine build, scheduler-config changes)
    "chunked_prefill": ({}, {}),
    "pp2": ({"pipeline_parallel_size": 2}, {}),
    "tp2pp2": ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {}),
    "pp2_broadcast": ({"pipeline_parallel_size": 2, "broadcast_pp_output": True}, {}),
    "ngram": ({}, {"speculative_method": "ngram", "num_speculative_tokens": 2}),
    "eagle": ({"speculative_method": "eagle", "num_speculative_tokens": 2}, {}),
    "preemption": ({}, {"num_gpu_blocks": 13}),
    "preemption_pp2": ({"pipeline_parallel_size": 2}, {"num_gpu_blocks": 13}),
    "prefix_caching": ({}, {"enable_prefix_caching": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_async_equals_sync_bitwise(engines, name):
    build, sched = CASES[name]
    e = engines(**build)
    sync = run(e, ARRIVALS, False, **sched)
    ahead = run(e, ARRIVALS, True, **sched)
    assert_bitwise_equal(ahead, sync)
    assert sync.num_async_steps == 0
    assert ahead.num_async_steps >= 4, "the async run never overlapped a step"
    if "preemption" in name:
        assert ahead.num_preemptions > 0


@pytest.mark.slow
def test_async_equals_sync_in_graph_mode(engines):
    e = engines(cudagraph_mode="FULL", capture_sizes=(4, 8, 16))
    sync, ahead = run(e, ARRIVALS, False), run(e, ARRIVALS, True)
    assert_bitwise_equal(ahead, sync)
    assert ahead.num_async_steps >= 4


def test_prefix_cache_never_hashes_a_placeholder(engines):
    """A request whose prompt is another's prompt plus its outputs hits the blocks written by
    steps run ahead exactly as often as without async scheduling, with the same logits."""
    e = engines()
    first = Arrival("a", tuple(range(3, 12)), 12)
    tokens = run(e, [first], False, enable_prefix_caching=True).output_token_ids()["a"]
    follow = [first, Arrival("b", first.prompt + tuple(tokens[:10]), 4, at_step=16)]
    sync = run(e, follow, False, enable_prefix_caching=True)
    hits_sync = e.scheduler.kv.num_hit_tokens
    ahead = run(e, follow, True, enable_prefix_caching=True)
    assert_bitwise_equal(ahead, sync)
    assert e.scheduler.kv.num_hit_tokens == hits_sync >= 16


def test_stop_token_drops_the_step_run_ahead(engines):
    """A request that stops at step N already has N+1 scheduled: its output is dropped."""
    e = engines()
    plain = run(e, ARRIVALS, False).output_token_ids()
    stops = {rid: SamplingParams(stop_token_ids=(toks[1],)) for rid, toks in plain.items() if len(toks) > 2}
    sync = run(e, ARRIVALS, False, params=stops)
    ahead = run(e, ARRIVALS, True, params=stops)
    assert_bitwise_equal(ahead, sync)
    assert sync.stop_reasons and all(len(t) == 2 for rid, t in sync.output_token_ids().items() if rid in stops)
    assert ahead.num_async_steps >= 4


def test_penalties_and_aborts(engines):
    """A request with penalties waits for its steps (penalties count the unknown token); the
    others run ahead; requests aborted with a step ahead in flight release their blocks."""
    e = engines(pipeline_parallel_size=2)
    params = {"r1": SamplingParams(frequency_penalty=0.7, presence_penalty=0.3)}
    aborts = {3: ["r0"], 5: ["late0", "r2"]}
    sync = run(e, ARRIVALS, False, params=params, aborts=aborts)
    ahead = run(e, ARRIVALS, True, params=params, aborts=aborts)
    assert_bitwise_equal(ahead, sync)
    assert ahead.aborted and ahead.num_async_steps >= 4


def test_teacher_forcing_drops_steps_run_ahead_on_other_tokens(engines):
    """Forced tokens the model would not sample: every step run ahead on a sampled token is
    dropped and recomputed on the forced one; the outputs are still synchronous scheduling's."""
    forced = [Arrival(a.req_id, a.prompt, a.max_tokens, a.at_step, tuple((7 * i + 3) % 128 for i in range(a.max_tokens)))
              for a in ARRIVALS]
    for build in ({}, {"pipeline_parallel_size": 2}):
        e = engines(**build)
        assert_bitwise_equal(run(e, forced, True), run(e, forced, False))


def test_placeholder_fault_is_caught_and_needs_async(engines):
    """The stale row map gives the placeholder another request's token: the outputs leave
    synchronous scheduling's. Off the async path the fault changes nothing."""
    e = engines()
    sync = run(e, ARRIVALS, False)
    bad = run(e, ARRIVALS, True, faults=(ASYNC_PLACEHOLDER_NOT_REPLACED,))
    assert bad.output_token_ids() != sync.output_token_ids()
    assert_bitwise_equal(run(e, ARRIVALS, False, faults=(ASYNC_PLACEHOLDER_NOT_REPLACED,)), sync)
    assert_bitwise_equal(run(e, ARRIVALS, True), sync)


def test_async_wait_replays_exactly(engines):
    """Schedule.async_wait: the engine waits for its step in flight on some steps, drawn from
    the Schedule's seed; the same Schedule replays the same microbatches, and a wait changes
    the overlap, never the outputs."""
    e = engines()

    def batches(schedule):
        seen = capture_scheduler_outputs(e)
        trace = run(e, ARRIVALS, True, schedule=schedule)
        e.executor.submit = type(e.executor).submit.__get__(e.executor)
        return [(so.num_scheduled_tokens, so.scheduled_cached_reqs.new_token_ids) for so in seen], trace

    always, t_always = batches(Schedule())
    half, t_half = batches(Schedule(seed=7, async_wait=0.5))
    again, _ = batches(Schedule(seed=7, async_wait=0.5))
    assert half == again
    assert 0 < t_half.num_async_steps < t_always.num_async_steps
    sync = run(e, ARRIVALS, False)
    assert_bitwise_equal(t_half, sync)
    assert_bitwise_equal(t_always, sync)


def test_schedule_json_keeps_its_old_form():
    assert "async_wait" not in Schedule(seed=3, copy_delay=0.5).to_dict()
    s = Schedule(seed=3, async_wait=0.25)
    assert Schedule.from_dict(s.to_dict()) == s and s.to_dict()["async_wait"] == 0.25
    with pytest.raises(ValueError, match="async_wait"):
        Schedule(async_wait=1.5)


def test_books_hold_placeholders_to_steps_in_flight(engines):
    """Scheduler alone (no ranks): the decode runs ahead of the prefill in flight with one
    placeholder, which the books hold to the steps in flight."""
    e = engines()
    e.reset(scheduler_config=e.cfg)
    e.add_request("x", [1, 2, 3], 8)
    s = e.scheduler
    first, ahead = s.schedule(ahead=True), s.schedule(ahead=True)
    req = s.requests["x"]
    assert ahead.scheduled_cached_reqs.new_token_ids == [[-1]] and first.num_scheduled_tokens == {"x": 3}
    assert req.num_output_placeholders == 1 and req.num_in_flight == 2 and req.num_computed_tokens == 4
    s.check_accounting()
    req.num_output_placeholders = 2
    with pytest.raises(KVAccountingError, match="placeholder"):
        s.check_accounting()
    e.reset(scheduler_config=e.cfg)  # nothing reached the ranks


@pytest.mark.parametrize("schedule", [Schedule(prepare_ahead=1.0, copy_delay=0.5),
                                      Schedule(seed=3, rank_order="random", prepare_ahead=1.0, copy_delay=0.5)],
                         ids=["ahead", "ahead_random_ranks"])
def test_an_abort_while_its_step_ahead_waits_to_execute(engines, schedule):
    """A request aborted while a step run ahead of it (with its placeholder) is prepared but not
    yet executed: the ranks drop its kept sampled token only when the next step executes, after
    that step filled the placeholder (dropped at prepare, with the host ahead, the fill found
    nothing; found by a clean campaign: tp4pp1 and tp1pp3/pp4 with async scheduling and aborts)."""
    e = engines(tensor_parallel_size=4)
    arrivals = [Arrival("r0", (0,), 4, 0), Arrival("r1", (0,), 3, 0)]
    sync = run(e, arrivals, False, schedule=schedule, aborts={2: ["r1"]})
    ahead = run(e, arrivals, True, schedule=schedule, aborts={2: ["r1"]})
    assert_bitwise_equal(ahead, sync)
    assert "r1" in ahead.aborted
