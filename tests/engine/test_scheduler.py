"""Scheduler: token budget, max_num_seqs, chunked prefill, recompute preemption, in-flight
microbatches. Most tests drive `Scheduler` directly (no model) and check every
SchedulerOutput it emits; a few check the same through a real engine."""
from __future__ import annotations

import random
from collections import deque

import pytest

from engine import EngineConfig, LLMEngine
from engine.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from engine_testutil import capture_scheduler_outputs, mixed_arrivals, run_arrivals


class Driver:
    """Runs a Scheduler like LLMEngine does (up to `depth` microbatches in flight) and checks
    every SchedulerOutput against the scheduler's invariants as it goes."""

    def __init__(self, cfg: EngineConfig, depth: int = 1) -> None:
        self.cfg, self.depth = cfg, depth
        self.s = Scheduler(cfg)
        self.outputs: list[SchedulerOutput] = []
        self.in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        self.s.add_request(Request(rid, list(range(1, prompt_len + 1)), max_tokens))

    def step(self) -> None:
        while len(self.in_flight) < self.depth:
            before = {rid: (r.num_computed_tokens, r.status) for rid, r in self.s.requests.items()}
            busy = {rid for so, _ in self.in_flight for rid in so.num_scheduled_tokens}
            so = self.s.schedule()
            if so is None:
                break
            self.check(so, before, busy)
            expect = {rid for rid in so.num_scheduled_tokens
                      if self.s.requests[rid].num_computed_tokens >= self.s.requests[rid].num_tokens}
            self.in_flight.append((so, expect))
            self.outputs.append(so)
        assert self.in_flight, "scheduler stalled with unfinished requests"
        so, expect = self.in_flight.popleft()
        self.s.update_from_output(so, {rid: [7] for rid in expect})  # one verified token each
        self.s.kv.check_accounting()

    def run(self, max_steps: int = 10000) -> None:
        for _ in range(max_steps):
            if not (self.s.has_unfinished() or self.in_flight):
                return
            self.step()
        raise AssertionError("workload did not finish")

    def check(self, so: SchedulerOutput, before: dict, busy: set[str]) -> None:
        cfg, s = self.cfg, self.s
        n = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(n.values()) <= cfg.max_num_batched_tokens, \
            f"microbatch {so.microbatch}: {sum(n.values())} tokens > budget {cfg.max_num_batched_tokens}"
        assert all(v > 0 for v in n.values())
        assert len(n) <= cfg.max_num_seqs and len(s.running) <= cfg.max_num_seqs
        assert not (set(n) & busy), f"microbatch {so.microbatch} reschedules in-flight {set(n) & busy}"
        new_ids = {nr.req_id for nr in so.scheduled_new_reqs}
        cached_ids = set(so.scheduled_cached_reqs.req_ids)
        assert new_ids | cached_ids == set(n) and not (new_ids & cached_ids)
        # A request scheduled as cached must still be scheduled (not preempted under it).
        assert not (cached_ids & so.preempted_req_ids), \
            f"microbatch {so.microbatch} preempts {cached_ids & so.preempted_req_ids} it also schedules"
        for rid, k in n.items():
            req = s.requests[rid]
            assert req.status is RequestStatus.RUNNING and req in s.running
            done_before = 0 if rid in new_ids else before[rid][0]
            assert req.num_computed_tokens == done_before + k <= req.num_tokens
            blocks = s.kv.req_blocks[rid]
            assert len(blocks) * cfg.block_size >= req.num_computed_tokens, f"{rid}: too few blocks"
            assert 0 not in blocks
        for nr in so.scheduled_new_reqs:
            req = s.requests[nr.req_id]
            assert nr.num_computed_tokens == 0
            assert nr.token_ids == req.all_token_ids  # prompt + outputs so far (after preemption)
            assert nr.block_ids == s.kv.req_blocks[nr.req_id]
            if not cfg.enable_chunked_prefill:
                assert n[nr.req_id] == req.num_tokens
        c = so.scheduled_cached_reqs
        for rid, ncomp in zip(c.req_ids, c.num_computed_tokens):
            assert ncomp == before[rid][0]


def cfg_(**kw) -> EngineConfig:
    base = dict(block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=16,
                max_model_len=128)
    return EngineConfig(**{**base, **kw})


def random_workload(d: Driver, rng: random.Random, n: int, max_prompt: int, max_out: int) -> None:
    for i in range(n):
        d.add(f"r{i}", rng.randint(1, max_prompt), rng.randint(1, max_out))


def assert_all_finished(d: Driver) -> None:
    for rid, req in d.s.requests.items():
        assert req.status is RequestStatus.FINISHED, f"{rid} is {req.status}"
        assert len(req.output_token_ids) == req.max_tokens
    assert d.s.kv.req_blocks == {} and d.s.kv.pool.num_free_blocks == d.cfg.num_gpu_blocks - 1


# -- budget, seats, chunking ---------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_token_budget_respected_every_step(budget):
    d = Driver(cfg_(max_num_batched_tokens=budget, max_model_len=64))
    random_workload(d, random.Random(budget), 12, 50, 8)
    d.run()
    assert max(so.total_num_scheduled_tokens for so in d.outputs) == budget  # the budget is used
    assert_all_finished(d)


def test_chunked_prefill_splits_a_long_prompt():
    d = Driver(cfg_(max_num_batched_tokens=16))
    d.add("long", 50, 3)
    d.run()
    sizes = [so.num_scheduled_tokens["long"] for so in d.outputs]
    assert sizes == [16, 16, 16, 2, 1, 1]
    assert_all_finished(d)


def test_chunks_of_several_prompts_share_a_step():
    d = Driver(cfg_(max_num_batched_tokens=16))
    d.add("a", 10, 2)
    d.add("b", 20, 2)
    d.run()
    first, second = d.outputs[:2]
    assert first.num_scheduled_tokens == {"a": 10, "b": 6}
    assert second.num_scheduled_tokens == {"a": 1, "b": 14}


def test_without_chunked_prefill_a_prompt_is_never_split():
    d = Driver(cfg_(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False))
    random_workload(d, random.Random(3), 10, 40, 5)
    d.run()  # check() asserts every new request gets its whole prompt
    assert_all_finished(d)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_max_num_seqs_respected(max_num_seqs):
    d = Driver(cfg_(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
    random_workload(d, random.Random(max_num_seqs), 12, 10, 6)
    d.run()
    assert max(len(so.num_scheduled_tokens) for so in d.outputs) == max_num_seqs
    assert_all_finished(d)


def test_engine_steps_respect_budget_seats_and_chunks():
    cfg = cfg_(max_num_seqs=3, max_num_batched_tokens=12, max_model_len=64)
    e = LLMEngine(cfg)
    try:
        seen = capture_scheduler_outputs(e)
        arrivals = mixed_arrivals(2, [50, 3, 27, 1, 12, 9], cfg.vocab_size, (2, 6))
        run_arrivals(e, arrivals)
        assert all(so.total_num_scheduled_tokens <= 12 and len(so.num_scheduled_tokens) <= 3 for so in seen)
        chunks = [so.num_scheduled_tokens["r0"] for so in seen if "r0" in so.num_scheduled_tokens]
        assert sum(chunks[:-(arrivals[0].max_tokens - 1) or None]) == 50 and max(chunks) <= 12
        # r0 samples its first token only in the step that completes its prompt.
        first = e.trace.tokens["r0"][0]
        done = next(i for i, so in enumerate(seen) if so.num_scheduled_tokens.get("r0")
                    and sum(x.num_scheduled_tokens.get("r0", 0) for x in seen[:i + 1]) >= 50)
        assert first.microbatch == seen[done].microbatch
        assert all(len(e.trace.tokens[a.req_id]) == a.max_tokens for a in arrivals)
    finally:
        e.shutdown()


# -- preemption ------------------------------------------------------------------------------------

def test_preemption_never_takes_a_request_scheduled_in_the_same_step():
    """A and B fill the pool; B, last in the running list, needs a new block while A (already
    in this microbatch) needs none. Preempting A would ship a microbatch that schedules a
    request whose blocks were just freed (regression: the ranks crashed with KeyError)."""
    d = Driver(cfg_(block_size=4, num_gpu_blocks=5, max_model_len=16))
    d.add("A", 7, 8)  # 2 blocks
    d.add("B", 8, 8)  # 2 blocks: the pool is full
    d.step()
    d.run()  # check() asserts no cached request is preempted in its own microbatch
    assert d.s.num_preemptions > 0
    assert_all_finished(d)


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_preemption_frees_blocks_and_requests_complete(depth, seed):
    """A cache of max_model_len tokens for 8 requests: preemptions free their blocks (the
    accounting holds after every step) and every request completes."""
    rng = random.Random(seed)
    d = Driver(cfg_(block_size=rng.choice([2, 4]), num_gpu_blocks=17, max_model_len=32,
                    max_num_batched_tokens=rng.choice([4, 8, 16])), depth=depth)
    random_workload(d, rng, 8, 24, 8)
    freed_ok = []
    orig = d.s._preempt

    def preempt(req):
        free_before = d.s.kv.pool.num_free_blocks
        held = len(d.s.kv.req_blocks.get(req.req_id, ()))
        orig(req)
        freed_ok.append(d.s.kv.pool.num_free_blocks == free_before + held
                        and req.req_id not in d.s.kv.req_blocks and req.num_computed_tokens == 0
                        and d.s.waiting[0] is req)

    d.s._preempt = preempt
    d.run()
    assert d.s.num_preemptions > 0 and freed_ok and all(freed_ok)
    assert_all_finished(d)


def test_preempted_request_is_resent_whole_with_its_outputs():
    d = Driver(cfg_(block_size=2, num_gpu_blocks=9, max_model_len=16, max_num_batched_tokens=8))
    d.add("a", 6, 8)
    d.add("b", 5, 8)
    d.add("c", 4, 8)
    d.run()
    assert d.s.num_preemptions > 0
    resent = [nr for so in d.outputs for nr in so.scheduled_new_reqs
              if d.s.requests[nr.req_id].num_preemptions and len(nr.token_ids) > len(
                  d.s.requests[nr.req_id].prompt_token_ids)]
    assert resent, "no preempted request came back with generated tokens"
    assert_all_finished(d)


@pytest.mark.parametrize("layout", ["tp1pp1", "pp2"])
def test_engine_preemption_completes_every_request(layout):
    cfg = cfg_(num_gpu_blocks=17, max_model_len=64).replace(layout=layout)
    e = LLMEngine(cfg)
    try:
        seen = capture_scheduler_outputs(e)
        arrivals = mixed_arrivals(4, [30, 25, 28, 20, 12, 18, 27, 9], cfg.vocab_size, (4, 10))
        run_arrivals(e, arrivals)
        assert e.trace.num_preemptions > 0
        assert any(so.preempted_req_ids for so in seen)
        for a in arrivals:
            assert len(e.trace.tokens[a.req_id]) == a.max_tokens
        kv = e.scheduler.kv
        assert kv.req_blocks == {} and kv.pool.num_free_blocks == cfg.num_gpu_blocks - 1
    finally:
        e.shutdown()


# -- in flight ---------------------------------------------------------------------------------------

def test_a_request_is_never_in_two_microbatches_at_once():
    d = Driver(cfg_(max_num_batched_tokens=8), depth=4)
    random_workload(d, random.Random(9), 6, 30, 6)
    d.run()  # check() asserts no scheduled request is already in flight
    assert_all_finished(d)
    assert max(so.microbatch for so in d.outputs) + 1 == len(d.outputs)
