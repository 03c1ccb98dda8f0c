"""The scheduler's limits checked on every microbatch (engine/sched_invariants.py): the clean
engine keeps them at their edges, each broken limit is named, and the planted
docs/bug_classes.md#sched_max_num_seqs_off_by_one, #sched_drafts_over_budget and
#async_queue_depth_ignored are caught by this check alone: with it off, their runs equal the
clean ones bit for bit."""
from __future__ import annotations

import re

import pytest
import torch

from engine import EngineInvariantError, LLMEngine
from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched_invariants import ScheduleLimits
from fuzz.cases.strategies import FUZZ_MODEL, tokens_from_seed

OFF_BY_ONE = ("sched_max_num_seqs_off_by_one",)
# tp1pp2, 2 seqs, budget 8: r0 and r1 (4 tokens each) fill microbatch 0; with the fault r2 is
# admitted into microbatch 1 and the two microbatches alternate to the end.
EDGE = FUZZ_MODEL.replace(layout="tp1pp2", max_num_seqs=2, max_num_batched_tokens=8)
EDGE_PROMPTS = (4, 4, 3)


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EDGE)
    yield e
    e.shutdown()


def _run(e: LLMEngine, faults: tuple[str, ...] = (), prompts=EDGE_PROMPTS, max_tokens: int = 4):
    """Run the workload; return the trace and the request ids of each microbatch submitted."""
    e.reset(faults=faults)
    for i, n in enumerate(prompts):
        e.add_request(f"r{i}", list(tokens_from_seed(i, n, e.cfg.vocab_size)), max_tokens)
    batches = []
    submit = e.executor.submit
    e.executor.submit = lambda so: (batches.append(sorted(so.num_scheduled_tokens)), submit(so))
    try:
        while e.has_unfinished_requests():
            e.step()
    finally:
        del e.executor.submit  # back to the class's method
    return e.trace, batches


def _bitwise_equal(a, b) -> bool:
    return a.output_token_ids() == b.output_token_ids() and all(
        torch.equal(x.logits, y.logits) for rid in a.tokens for x, y in zip(a.tokens[rid], b.tokens[rid]))


def test_clean_engine_keeps_the_limits_at_their_edges(engine, monkeypatch):
    """Held requests reach max_num_seqs and microbatches the full budget, with no complaint."""
    held, tokens = [], []
    check = ScheduleLimits.check

    def spy(self, so, *a, **kw):
        broken = check(self, so, *a, **kw)
        held.append(len(self.held))
        tokens.append(sum(so.num_scheduled_tokens.values()))
        return broken

    monkeypatch.setattr(ScheduleLimits, "check", spy)
    _run(engine, prompts=(4, 4, 3, 9, 2))
    assert max(held) == EDGE.max_num_seqs and max(tokens) == EDGE.max_num_batched_tokens


def test_off_by_one_is_caught_by_the_limit_check(engine):
    with pytest.raises(EngineInvariantError,
                       match=r"microbatch 1: the ranks hold 3 requests \(r0, r1, r2\), more than max_num_seqs=2"):
        _run(engine, OFF_BY_ONE)


def test_off_by_one_is_bitwise_invisible_without_it(engine, monkeypatch):
    """With the check off the faulty run completes with every token and logits row equal bit
    for bit to the clean run's, though it batched differently: no output property can see it."""
    clean, clean_batches = _run(engine)
    monkeypatch.setattr(ScheduleLimits, "check", lambda self, so, *a, **kw: None)
    faulty, faulty_batches = _run(engine, OFF_BY_ONE)
    assert ["r2"] in faulty_batches[:2] and faulty_batches != clean_batches  # the fault acted
    assert _bitwise_equal(clean, faulty)


OVER_BUDGET = ("sched_drafts_over_budget",)
NGRAM = FUZZ_MODEL.replace(speculative_method="ngram", num_speculative_tokens=2, max_num_batched_tokens=3)


def _run_fresh(cfg, prompts: list[list[int]], max_tokens: int, faults: tuple[str, ...] = ()):
    """The prompts, arriving together, run to the end on an engine of their own."""
    e = LLMEngine(cfg)
    try:
        e.reset(faults=faults)
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, max_tokens)
        while e.has_unfinished_requests():
            e.step()
        return e.trace
    finally:
        e.shutdown()


def _run_ngram(faults: tuple[str, ...]):
    """Budget 3: r0's decode takes 1 token, r1's drafting decode the 2 left."""
    return _run_fresh(NGRAM, [[5], [1, 2, 1, 2, 1, 2]], 12, faults)


def test_drafts_over_budget_are_caught_and_otherwise_bitwise_invisible(monkeypatch):
    with pytest.raises(EngineInvariantError, match=r"4 tokens scheduled, more than max_num_batched_tokens=3"):
        _run_ngram(OVER_BUDGET)
    clean = _run_ngram(())
    monkeypatch.setattr(ScheduleLimits, "check", lambda self, so, *a, **kw: None)
    faulty = _run_ngram(OVER_BUDGET)
    assert faulty.num_draft_tokens > clean.num_draft_tokens  # the fault acted: more drafts verified
    assert _bitwise_equal(clean, faulty)


@pytest.mark.parametrize("cut", [lambda spec, budget: [], lambda spec, budget: spec[:max(0, budget - 2)]],
                         ids=["never verified", "cut one short"])
def test_drafts_dropped_or_cut_short_are_caught_and_otherwise_bitwise_invisible(monkeypatch, cut):
    """A scheduler that verifies fewer drafts than were proposed and fit (none at all, as a
    flipped decode test in Scheduler.schedule; or one fewer, as `budget - 2`) computes the same
    tokens: only the proposal check sees it."""
    from engine.scheduler import Scheduler

    clean = _run_ngram(())
    monkeypatch.setattr(Scheduler, "_drafts_in_budget", lambda self, req, budget: cut(req.spec_token_ids, budget))
    with pytest.raises(EngineInvariantError, match=r"verifies drafts \[.*\] at its decode; the proposer gave"):
        _run_ngram(())
    monkeypatch.setattr(ScheduleLimits, "_check_proposal", lambda *a: None)
    faulty = _run_ngram(())
    assert faulty.num_draft_tokens < clean.num_draft_tokens  # the bug acted: fewer drafts verified
    assert _bitwise_equal(clean, faulty)


def test_a_decode_verifies_what_was_proposed_up_to_the_budget():
    lim = _limits(("a", 4, 10), ("b", 4, 10))
    assert lim.check(_out(0, new=[("a", [1] * 4, 0, 4), ("b", [2] * 4, 0, 4)])) is None
    lim.propose("a", 5, [6, 7]), lim.propose("b", 5, [8, 9])
    # a takes 3 of the budget of 8 (its token and both drafts); b, after it, has 5 left: both drafts.
    assert lim.check(_out(1, cached=[("a", [5], 4, 3), ("b", [5], 4, 3)], spec={"a": [6, 7], "b": [8, 9]})) is None
    lim.propose("a", 6, [6, 7])
    assert "the proposer gave [6, 7] and 8 tokens of the budget were left, so [6, 7]" in \
        lim.check(_out(2, cached=[("a", [9], 5, 2)], spec={"a": [6]}), in_flight={"b"})
    lim = _limits(("a", 4, 10), ("b", 4, 10))
    lim.check(_out(0, new=[("a", [1] * 7, 0, 6)]))
    lim.propose("a", 8, [6, 7])  # a proposal for another context (8 tokens; the ranks know 7) is not this step's
    assert lim.check(_out(1, cached=[("a", [], 6, 1)])) is None


# -- each limit, broken by hand ---------------------------------------------------------------

CFG = FUZZ_MODEL.replace(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16,
                         speculative_method="ngram", num_speculative_tokens=2)


def _out(mb: int, new=(), cached=(), spec=None, total=None, finished=(), preempted=()) -> SchedulerOutput:
    """new: (id, tokens, computed, scheduled); cached: (id, new tokens, computed, scheduled)."""
    c = CachedRequestData()
    for rid, toks, start, _ in cached:
        c.req_ids.append(rid), c.new_token_ids.append(list(toks)), c.new_block_ids.append([])
        c.num_computed_tokens.append(start)
    counts = {rid: n for rid, _, _, n in (*new, *cached)}
    return SchedulerOutput(mb, [NewRequestData(rid, list(t), [], s) for rid, t, s, _ in new], c, counts,
                           sum(counts.values()) if total is None else total, set(finished), set(preempted),
                           spec or {})


def _limits(*reqs: tuple[str, int, int]) -> ScheduleLimits:
    lim = ScheduleLimits(CFG)
    for rid, prompt_len, max_tokens in reqs:
        lim.add_request(rid, prompt_len, max_tokens)
    return lim


def test_a_readmission_after_preemption_owes_no_drafts():
    """A request preempted after its proposal is readmitted as a new one, which verifies no
    drafts (as in vLLM). A prefix-cache hit up to its last token makes the readmission look
    like the decode the proposal was for: a clean bf16 campaign on the H200 reported it."""
    lim = _limits(("a", 4, 10))
    assert lim.check(_out(0, new=[("a", [1] * 4, 0, 4)])) is None
    lim.propose("a", 5, [6])
    assert lim.check(_out(1, preempted={"a"})) is None
    assert lim.check(_out(2, new=[("a", [1] * 4 + [5], 4, 1)])) is None
    lim = _limits(("a", 4, 10))  # the same decode without the preemption owes the draft
    lim.check(_out(0, new=[("a", [1] * 4, 0, 4)]))
    lim.propose("a", 5, [6])
    assert "the proposer gave [6]" in lim.check(_out(1, cached=[("a", [5], 4, 1)]))


def test_a_decode_with_drafts_in_room_passes():
    lim = _limits(("a", 4, 4))
    assert lim.check(_out(0, new=[("a", [1, 2, 3, 4], 0, 4)])) is None
    assert lim.check(_out(1, cached=[("a", [5], 4, 3)], spec={"a": [6, 7]})) is None


@pytest.mark.parametrize("outs,match", [
    ([_out(0, new=[("a", [1] * 5, 0, 5), ("b", [1] * 4, 0, 4)])], "9 tokens scheduled, more than max_num_batched"),
    ([_out(0, new=[("a", [1] * 4, 0, 4)], total=3)], "total_num_scheduled_tokens=3"),
    ([_out(0, new=[("a", [1] * 4, 0, 5)])], "scheduled up to position 5 of its 4 tokens"),
    ([_out(0, new=[("a", [1] * 4, 0, 4)]), _out(1, cached=[("b", [2], 4, 1)])], "the ranks do not hold it"),
    ([_out(0, new=[("a", [1] * 4, 0, 2), ("b", [1] * 6, 0, 6)]), _out(1, cached=[("a", [], 2, 3)], spec={"a": [5]})],
     "not a one-token decode"),
    ([_out(0, new=[("a", [1] * 4, 0, 4)]), _out(1, cached=[("a", [5] * 10, 12, 8)])],
     "computed 12 \\+ scheduled 8 > max_model_len=16"),
])
def test_each_broken_limit_is_named(outs, match):
    lim = _limits(("a", 4, 4), ("b", 4, 4))
    *ok, bad = outs
    assert [lim.check(o) for o in ok] == [None] * len(ok)
    assert re.search(match, lim.check(bad) or ""), lim.check(bad)


def test_budget_left_idle_beside_a_request_with_no_step_in_flight_is_named():
    lim = _limits(("a", 4, 10), ("b", 4, 10))
    assert lim.check(_out(0, new=[("a", [1] * 4, 0, 4), ("b", [2] * 4, 0, 4)])) is None
    # b's step is in flight (PP): a may run alone.
    assert lim.check(_out(1, cached=[("a", [5], 4, 1)]), in_flight={"b"}) is None
    # Both are back; a alone with 7 of the 8 tokens left over: b lost its turn.
    assert "request b has no step in flight and was not scheduled, with 7 tokens" in \
        lim.check(_out(2, cached=[("a", [6], 5, 1)]))
    # A prefill chunk cut short with budget to spare.
    lim = _limits(("a", 12, 4), ("b", 4, 4))
    assert "request a was scheduled 6 of its 12 tokens to compute, with 2 tokens" in \
        lim.check(_out(0, new=[("a", [1] * 12, 0, 6)]))
    # A full microbatch: a's chunk takes the budget, b waits (not held: admission is not checked).
    lim = _limits(("a", 12, 4), ("b", 4, 4))
    assert lim.check(_out(0, new=[("a", [1] * 12, 0, 8)])) is None
    assert lim.check(_out(1, new=[("b", [2] * 4, 0, 4)], cached=[("a", [], 8, 4)])) is None


def test_wasted_budget_is_caught_and_otherwise_bitwise_invisible(engine, monkeypatch):
    """A scheduler that spends one token less than its budget on running requests (a budget
    decremented twice, as a run-ahead step counted as two) computes the very same tokens in
    more steps: only the idle-budget check sees it."""
    from engine.scheduler import Scheduler

    clean, clean_batches = _run(engine, prompts=(4, 4, 3, 9, 2))
    run = Scheduler._schedule_running
    monkeypatch.setattr(Scheduler, "_schedule_running", lambda self, budget, *a: run(self, budget - 1, *a))
    with pytest.raises(EngineInvariantError, match=r"request r1 was scheduled 3 of its 4 tokens to compute, with 1 "):
        _run(engine, prompts=(4, 4, 3, 9, 2))
    monkeypatch.setattr(ScheduleLimits, "_check_work_conserving", lambda *a: None)
    faulty, faulty_batches = _run(engine, prompts=(4, 4, 3, 9, 2))
    assert faulty_batches != clean_batches  # the bug acted
    assert _bitwise_equal(clean, faulty)


def test_blocks_past_the_furthest_position_are_named():
    lim = _limits(("a", 4, 10))  # block size 4 (FUZZ_MODEL)
    new = NewRequestData("a", [1] * 6, [1, 2], 0)
    ok = SchedulerOutput(0, [new], CachedRequestData(), {"a": 6}, 6, set(), set(), {})
    assert lim.check(ok) is None
    over = CachedRequestData(["a"], [[7]], [[3, 4]], [6])  # 2 more blocks for 1 more token: 7 needs 2
    assert "holds 4 KV blocks; position 7 (+0 lookahead) needs 2 of 4 tokens" in \
        lim.check(SchedulerOutput(1, [], over, {"a": 1}, 1, set(), set(), {}), in_flight=set())


def test_over_allocation_is_caught_and_otherwise_bitwise_invisible(engine, monkeypatch):
    """Every allocation taking one slot more than its tokens and lookahead (the off-by-one in
    Scheduler._with_lookahead) computes the same tokens holding more blocks: only the blocks
    check sees it."""
    from engine.scheduler import Scheduler

    clean, _ = _run(engine, prompts=(4, 4, 3, 9, 2))
    with_la = Scheduler._with_lookahead
    monkeypatch.setattr(Scheduler, "_with_lookahead", lambda self, n: with_la(self, n + 1))
    with pytest.raises(EngineInvariantError, match=r"holds \d+ KV blocks; position \d+ \(\+0 lookahead\) needs"):
        _run(engine, prompts=(4, 4, 3, 9, 2))
    monkeypatch.setattr(ScheduleLimits, "_check_blocks", lambda *a: None)
    faulty, _ = _run(engine, prompts=(4, 4, 3, 9, 2))
    assert _bitwise_equal(clean, faulty)


def test_drafts_past_max_tokens_or_k_are_named():
    """Room for drafts: 3 of 4 max_tokens generated leaves none; k=2 caps it everywhere."""
    lim = _limits(("a", 4, 4))
    lim.check(_out(0, new=[("a", [1] * 4, 0, 4)]))
    assert "room for 0" in lim.check(_out(1, cached=[("a", [5, 6, 7], 6, 2)], spec={"a": [8]}))
    lim = _limits(("a", 4, 10))
    lim.check(_out(0, new=[("a", [1] * 4, 0, 4)]))
    assert "3 drafts, room for 2" in lim.check(_out(1, cached=[("a", [5], 4, 4)], spec={"a": [6, 7, 8]}))


def test_held_requests_leave_with_finished_ids():
    """A finished request's slot is free in the very microbatch that announces it."""
    lim = _limits(("a", 4, 4), ("b", 4, 4), ("c", 4, 4))
    assert lim.check(_out(0, new=[("a", [1] * 4, 0, 4), ("b", [1] * 4, 0, 4)])) is None
    assert "the ranks hold 3 requests" in lim.check(_out(1, new=[("c", [1] * 4, 0, 4)]))
    lim = _limits(("a", 4, 4), ("b", 4, 4), ("c", 4, 4))
    lim.check(_out(0, new=[("a", [1] * 4, 0, 4), ("b", [1] * 4, 0, 4)]))
    assert lim.check(_out(1, new=[("c", [1] * 4, 0, 4)], finished={"a"}), in_flight={"b"}) is None


def test_an_engine_built_with_more_seats_serves_a_smaller_max_num_seqs(engine):
    """The campaign's pool builds engines with max_num_seqs rounded up (it only sizes the ranks'
    buffers) and gives each Case its own at reset: the limit, its outputs and the off-by-one's
    detection are those of an engine built with the Case's max_num_seqs; a larger one than the
    ranks were built for is refused before anything runs."""
    from engine import ConfigError

    big = LLMEngine(EDGE.replace(max_num_seqs=8))
    try:
        want, _ = _run(engine)
        big.reset(scheduler_config=EDGE)
        reset = big.reset
        big.reset = lambda faults=(): reset(faults=faults, scheduler_config=EDGE)
        got, batches = _run(big)
        assert _bitwise_equal(want, got) and max(len(b) for b in batches) <= 2
        with pytest.raises(EngineInvariantError, match="more than max_num_seqs=2"):
            _run(big, OFF_BY_ONE)
        del big.reset
        with pytest.raises(ConfigError, match="max_num_seqs exceed"):
            big.reset(scheduler_config=EDGE.replace(max_num_seqs=16))
    finally:
        big.shutdown()


SHALLOW = ("async_queue_depth_ignored",)


def _run_async(cfg, faults: tuple[str, ...] = ()):
    """Three requests arriving together, each decoding 6 tokens, every step scheduled ahead."""
    return _run_fresh(cfg, [list(tokens_from_seed(i, n, cfg.vocab_size)) for i, n in enumerate((1, 3, 2))], 6, faults)


def test_async_queue_depth_ignored_is_caught_and_otherwise_bitwise_invisible(monkeypatch):
    cfg = FUZZ_MODEL.replace(async_scheduling=True)
    with pytest.raises(EngineInvariantError, match=r"pipeline depth: 1 microbatch\(es\) in flight, the pipeline "
                                                   r"holds 2 \(async scheduling"):
        _run_async(cfg, SHALLOW)
    clean = _run_async(cfg)
    monkeypatch.setattr(ScheduleLimits, "check_depth", lambda *a: None)
    faulty = _run_async(cfg, SHALLOW)
    assert clean.num_async_steps > 0 and faulty.num_async_steps == 0  # the fault acted: no overlap
    assert clean.max_in_flight == 2 and faulty.max_in_flight == 1
    assert _bitwise_equal(clean, faulty)


def test_a_queue_capped_below_a_deeper_pipeline_is_named(monkeypatch):
    """At pp4, a step scheduled ahead keeps 4 microbatches in flight; a queue capped at two
    (`min(pp, 2)` for `max(pp, 2)`, a mutant that survived every output check) is named. The
    clean engine fills its queue at every step."""
    from engine.llm_engine import LLMEngine as Engine

    cfg = FUZZ_MODEL.replace(layout="tp1pp4", async_scheduling=True, max_num_batched_tokens=3)
    assert _run_async(cfg).max_in_flight == 4
    monkeypatch.setattr(Engine, "_queue_depth", lambda self, ahead: min(self.cfg.pp, 2) if ahead else self.cfg.pp)
    with pytest.raises(EngineInvariantError, match=r"pipeline depth: 2 microbatch\(es\) in flight, the pipeline holds 4"):
        _run_async(cfg)


def test_a_drained_scheduler_excuses_a_short_queue():
    limits = ScheduleLimits(FUZZ_MODEL.replace(layout="tp1pp4"))
    assert limits.check_depth(1, ahead=False, drained=True) is None
    assert limits.check_depth(4, ahead=True, drained=False) is None
    assert "the pipeline holds 4" in limits.check_depth(3, ahead=False, drained=False)
