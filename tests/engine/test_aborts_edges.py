"""Aborts: the fault `abort_frees_blocks_in_flight` caught by the books, what it would break,
the scheduler's deferred release on its own, ids that are unknown, finished or aborted twice,
and an engine that serves new requests after everything it held was aborted in flight."""
from __future__ import annotations

import pytest

from engine import ConfigError, LLMEngine
from engine.faults import ABORT_FREES_BLOCKS_IN_FLIGHT
from engine.kv_cache import KVAccountingError
from engine.scheduler import Request, RequestStatus as S, Scheduler
from engine_testutil import Arrival
from test_aborts import (BASE, POINTS, VICTIM, assert_aborted, assert_bitwise, drive, toks, variant_case,
                         workload)

IN_FLIGHT_LOST = rf"block \d+ of request {VICTIM} was released while microbatch \d+, .* is still in flight"


@pytest.fixture(scope="module")
def engines():
    made: dict[str, LLMEngine] = {}

    def get(layout: str) -> LLMEngine:
        if layout not in made:
            made[layout] = LLMEngine(BASE.replace(layout=layout))
        return made[layout]

    yield get
    for e in made.values():
        e.shutdown()


# -- the fault -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,point", [("tp1pp2", "in_flight_decode"), ("tp1pp2", "in_flight_prefill"),
                                          ("tp1pp4", "in_flight_decode")])
def test_abort_frees_blocks_in_flight_is_caught_by_the_books(engines, layout, point):
    """Freed at the abort, the victim's blocks are no longer held while its microbatch is in
    flight: the check that runs after the abort names the block."""
    e = engines(layout)
    cfg, arrivals = variant_case(e, "plain")
    with pytest.raises(KVAccountingError, match=IN_FLIGHT_LOST):
        drive(e, cfg, arrivals, POINTS[point], faults=(ABORT_FREES_BLOCKS_IN_FLIGHT,), check_held=False)
    while e.in_flight:  # collect what the raise left on the ranks: the next test reuses the engine
        e.executor.collect(e.in_flight.popleft()[0].microbatch)


@pytest.mark.parametrize("layout,point", [("tp1pp1", "decode"), ("tp1pp2", "decode"), ("tp1pp2", "mid_prefill")])
def test_the_fault_is_harmless_without_a_microbatch_in_flight(engines, layout, point):
    e = engines(layout)
    cfg, arrivals = variant_case(e, "plain")
    ok = drive(e, cfg, arrivals, POINTS[point])
    bad = drive(e, cfg, arrivals, POINTS[point], faults=(ABORT_FREES_BLOCKS_IN_FLIGHT,))
    assert bad.in_flight_steps[0] is False
    for rid, recs in ok.trace.tokens.items():
        assert_bitwise(recs, bad.trace.tokens[rid], rid)


def test_the_fault_hands_in_flight_blocks_to_another_request(engines, monkeypatch):
    """What the books guard against. With the fault and their in-flight check off, microbatches
    submitted while the victim's is still in flight are handed its blocks. Outputs stay
    bitwise right here: every stage runs microbatches in submission order (engine/worker.py)
    and owns its layers' KV, so the stale write lands before the new owner's. An engine whose
    write into a reused block is not ordered after the in-flight step (vLLM #45357: an RDMA
    KV load) corrupts the new owner."""
    monkeypatch.setattr(Scheduler, "check_accounting", lambda self: self.kv.check_accounting())
    handed: list[tuple[int, str, int]] = []
    emit = Scheduler._emit

    def spy(self, *args):
        out = emit(self, *args)
        victim = self.requests.get(VICTIM)
        if victim is not None and victim.status is S.FINISHED_ABORTED:
            in_flight = {b for mb, held in self._step_blocks.items() if mb != out.microbatch
                         for b in held.get(VICTIM, ())}
            handed.extend((out.microbatch, rid, b) for rid, blocks in self._step_blocks[out.microbatch].items()
                          for b in blocks if b in in_flight)
        return out

    monkeypatch.setattr(Scheduler, "_emit", spy)
    e = engines("tp1pp4")
    cfg, arrivals = variant_case(e, "tight")  # a full pool: freed blocks are reused at once
    ok = drive(e, cfg, arrivals, POINTS["in_flight_prefill"])
    assert handed == []
    bad = drive(e, cfg, arrivals, POINTS["in_flight_prefill"], faults=(ABORT_FREES_BLOCKS_IN_FLIGHT,),
                check_held=False)
    assert handed, "no block of the in-flight victim was handed out: the workload misses the hazard"
    for rid, recs in ok.trace.tokens.items():
        if rid != VICTIM:
            assert_bitwise(recs, bad.trace.tokens[rid], rid)


# -- the scheduler alone ---------------------------------------------------------------------

def test_finish_requests_defers_the_release_to_the_microbatch_return():
    s = Scheduler(BASE)
    for rid in "ab":
        s.add_request(Request(rid, list(range(1, 7)), 4))
    so = s.schedule()
    held = list(s.kv.req_blocks["a"])
    assert s.finish_requests(["a", "nobody"], S.FINISHED_ABORTED) == ["a"]
    assert s.requests["a"].status is S.FINISHED_ABORTED and s.running == [s.requests["b"]]
    assert s.kv.req_blocks["a"] == held  # its microbatch is in flight
    s.check_accounting()
    s.update_from_output(so, {"b": [7]})  # the driver drops a's samples
    assert "a" not in s.kv.req_blocks and set(held) <= set(s.kv.pool.free_block_queue)
    s.check_accounting()
    nxt = s.schedule()
    assert nxt.finished_req_ids == {"a"} and set(nxt.num_scheduled_tokens) == {"b"}


def test_the_books_name_a_block_released_under_a_microbatch_in_flight():
    s = Scheduler(BASE)
    s.add_request(Request(VICTIM, list(range(1, 10)), 4))
    s.schedule()
    s.check_accounting()
    s.kv.free(VICTIM)  # released with microbatch 0 in flight
    s.kv.check_accounting()  # the pool's own books still balance
    with pytest.raises(KVAccountingError, match=IN_FLIGHT_LOST):
        s.check_accounting()


def test_a_waiting_or_preempted_request_is_dropped_from_the_queue():
    s = Scheduler(BASE)
    for rid in "ab":
        s.add_request(Request(rid, [1, 2, 3], 4))
    s.requests["b"].status = S.PREEMPTED  # as _preempt leaves it: waiting, no blocks
    assert s.finish_requests("a", S.FINISHED_ABORTED) == ["a"] and list(s.waiting) == [s.requests["b"]]
    assert s.finish_requests("b", S.FINISHED_ABORTED) == ["b"] and not s.has_unfinished()
    assert s.schedule() is None and s._finished_since_last == {"a", "b"}
    s.check_accounting()


# -- the engine ------------------------------------------------------------------------------

def test_unknown_finished_and_repeated_aborts_are_ignored(engines):
    e = engines("tp1pp1")
    e.reset()
    e.abort_request("nobody")
    e.add_request("a", [1, 2, 3], 2)
    e.add_request("b", [4, 5, 6, 7, 8], 6)
    while len(e.trace.tokens["a"]) < 2:
        e.step()
    e.abort_request(["a", "nobody"])  # finished, unknown: vLLM ignores both
    assert e.scheduler.requests["a"].status is S.FINISHED and e.trace.aborted == {}
    e.abort_request("b")
    e.abort_request("b")
    assert e.trace.aborted == {"b": e.step_count} and not e.has_unfinished_requests()
    with pytest.raises(ConfigError, match="duplicate id"):
        e.add_request("b", [1], 1)
    e.add_request("c", [1, 2], 3)
    while e.has_unfinished_requests():
        e.step()
    assert len(e.trace.tokens["c"]) == 3 and len(e.trace.tokens["a"]) == 2


@pytest.mark.parametrize("layout", ["tp1pp2", "tp1pp4"])
def test_the_engine_serves_after_everything_is_aborted_in_flight(engines, layout):
    """Abort every request with a microbatch in flight: the driver drains it, sampling
    nothing, every block returns; new requests then give bitwise what they give on a fresh
    engine (nothing reads what the aborted requests left in the KV cache)."""
    e = engines(layout)
    cfg, arrivals = variant_case(e, "plain")
    e.reset()
    for a in arrivals[:5]:
        e.add_request(a.req_id, list(a.prompt), a.max_tokens)
    while not e.in_flight:
        e.step()
    before = {rid: len(recs) for rid, recs in e.trace.tokens.items()}
    e.abort_request(list(e.scheduler.requests))
    assert e.has_unfinished_requests()  # the microbatch in flight has yet to return
    while e.has_unfinished_requests():
        assert e.step() == []
    assert {rid: len(recs) for rid, recs in e.trace.tokens.items()} == before
    assert e.trace.aborted.keys() == {a.req_id for a in arrivals[:5]}
    fresh = [Arrival("n0", toks("n0", 13), 5), Arrival("n1", toks("n1", 22), 4)]
    traces = []
    for reset in (False, True):
        if reset:
            e.reset()
        for a in fresh:
            e.add_request(a.req_id, list(a.prompt), a.max_tokens)
        while e.has_unfinished_requests():
            e.step()
        traces.append(e.trace)
        kv = e.scheduler.kv
        assert kv.req_blocks == {} and kv.pool.num_free_blocks == kv.pool.num_blocks - 1
    for a in fresh:
        assert len(traces[1].tokens[a.req_id]) == a.max_tokens
        assert_bitwise(traces[1].tokens[a.req_id], traces[0].tokens[a.req_id], a.req_id)


def test_eagle_drafts_are_dropped_with_the_request():
    """EAGLE drafts come from the last rank's runner: an aborted request's are never
    scheduled, pending or proposed by its microbatch in flight."""
    e = LLMEngine(BASE.replace(layout="tp1pp2", speculative_method="eagle", num_speculative_tokens=2))
    try:
        arrivals = workload(6)
        without = drive(e, e.cfg, [a for a in arrivals if a.req_id != VICTIM])
        for point in ("drafts_pending", "in_flight_drafts"):
            got = drive(e, e.cfg, arrivals, POINTS[point])
            assert got.fired is not None and got.trace.num_draft_tokens > 0
            assert_aborted(e, got)
            for rid, recs in without.trace.tokens.items():
                assert_bitwise(recs, got.trace.tokens[rid], rid)
    finally:
        e.shutdown()


def test_an_abort_at_arrival_never_reaches_the_ranks(engines):
    e = engines("tp1pp2")
    cfg, arrivals = variant_case(e, "plain")
    run = drive(e, cfg, arrivals, POINTS["waiting"])
    assert run.n_before == 0 and run.in_flight_steps[0] is False
    assert not any(VICTIM in so.num_scheduled_tokens for so in run.outputs)
    assert_aborted(e, run)
