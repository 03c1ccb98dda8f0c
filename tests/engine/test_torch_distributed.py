"""The torch.distributed world (gloo processes) against the in-process world.

Both worlds run the same worker code and reduce in rank order, so on one workload they must
give bitwise the same logits; a rank that dies, raises or stalls must become a RankFailure
naming it within the step bound; and workers must survive across Cases.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, Schedule
from engine.inproc_world import RankFailure

pytestmark = pytest.mark.distributed

BASE = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Ranks compute with one intra-op thread; CPU GEMMs round differently with more, so the
    in-process reference must use one too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def workload(seed: int) -> list[tuple[str, list[int], int]]:
    """8 requests, prompts from 1 token to several chunks of the 16-token budget."""
    rng = random.Random(seed)
    lengths = [1, 3, 7, 12, 16, 20, 33, 41]
    rng.shuffle(lengths)
    return [(f"r{i}", [rng.randrange(BASE.vocab_size) for _ in range(n)], rng.randint(2, 6))
            for i, n in enumerate(lengths)]


def run(engine: LLMEngine, wl, schedule: Schedule | None = None):
    engine.reset(schedule)
    for rid, prompt, max_tokens in wl:
        engine.add_request(rid, prompt, max_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.trace


def inproc_trace(cfg: EngineConfig, wl, record_fa: bool = False):
    engine = LLMEngine(cfg.replace(world="inproc"), record_fa=record_fa)
    try:
        trace = run(engine, wl)
        fa = engine.collect_fa_records() if record_fa else []
        return trace, fa
    finally:
        engine.shutdown()


def assert_same(a, b) -> None:
    assert a.tokens.keys() == b.tokens.keys()
    for rid in a.tokens:
        ra, rb = a.tokens[rid], b.tokens[rid]
        assert len(ra) == len(rb), rid
        for i, (x, y) in enumerate(zip(ra, rb)):
            assert (x.sampled, x.token) == (y.sampled, y.token), (rid, i)
            assert torch.equal(x.logits, y.logits), (rid, i, (x.logits - y.logits).abs().max().item())


def assert_dead(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.fixture(scope="module")
def tp2pp2():
    engine = LLMEngine(BASE.replace(layout="tp2pp2", world="torch"), record_fa=True)
    yield engine
    pids = engine.executor.pids
    engine.shutdown()
    assert_dead(pids)


def test_tp2pp2_matches_inproc_bitwise(tp2pp2):
    cfg = BASE.replace(layout="tp2pp2")
    ref, ref_fa = inproc_trace(cfg, workload(0), record_fa=True)
    got = run(tp2pp2, workload(0))
    assert got.num_steps == ref.num_steps and got.max_in_flight == 2
    assert_same(ref, got)
    fa = tp2pp2.collect_fa_records()
    assert len(fa) == len(ref_fa) > 0
    for x, y in zip(ref_fa, fa):
        assert (x.rank, x.layer, x.microbatch, x.max_seqlen_q, x.max_seqlen_k) == \
               (y.rank, y.layer, y.microbatch, y.max_seqlen_q, y.max_seqlen_k)
        assert torch.equal(x.cu_seqlens_q, y.cu_seqlens_q) and torch.equal(x.slot_mapping, y.slot_mapping)


def test_reset_reuses_workers(tp2pp2):
    """A second workload (with a racy-looking but correct schedule) on the same processes,
    then the first again: same results, no respawn."""
    cfg = BASE.replace(layout="tp2pp2")
    pids = tp2pp2.executor.pids
    first = run(tp2pp2, workload(0))
    ref1, _ = inproc_trace(cfg, workload(1))
    second = run(tp2pp2, workload(1), Schedule(seed=3, prepare_ahead=0.5, copy_delay=0.5))
    assert_same(ref1, second)
    assert_same(first, run(tp2pp2, workload(0)))
    assert tp2pp2.executor.pids == pids


def test_pp4_matches_inproc_bitwise():
    cfg = BASE.replace(layout="pp4")
    ref, _ = inproc_trace(cfg, workload(2))
    engine = LLMEngine(cfg.replace(world="torch"))
    pids = engine.executor.pids
    try:
        got = run(engine, workload(2))
        assert got.max_in_flight == 4
        assert_same(ref, got)
    finally:
        engine.shutdown()
    assert_dead(pids)


@pytest.mark.parametrize("variant", [
    # reduce-scatter, scattered PP sends and the logits broadcast
    dict(layout="tp2pp2", sequence_parallel=True, broadcast_pp_output=True),
    # a graph captured in each process; its all-reduce op runs gloo at replay
    dict(layout="tp2", cudagraph_mode="FULL", capture_sizes=(18,)),
], ids=["tp2pp2-sp-broadcast", "tp2-graph"])
def test_variants_match_inproc_bitwise(variant):
    cfg = BASE.replace(**variant)
    ref, _ = inproc_trace(cfg, workload(4))
    engine = LLMEngine(cfg.replace(world="torch"))
    try:
        assert_same(ref, run(engine, workload(4)))
    finally:
        engine.shutdown()


def test_rank_failures_are_named_and_engine_recovers():
    """SIGKILL mid-run -> crash; a stopped rank -> timeout; a raising rank -> exception.
    Each failure kills the whole set and the next reset spawns a fresh one."""
    cfg = BASE.replace(layout="pp2", world="torch", step_timeout_s=3.0)
    engine = LLMEngine(cfg)
    seen: list[int] = []
    try:
        # A rank killed with microbatches in flight.
        engine.reset()
        for rid, prompt, max_tokens in workload(3):
            engine.add_request(rid, prompt, max_tokens)
        engine.step()
        assert engine.in_flight
        victim = engine.executor.pids[1]
        seen += engine.executor.pids
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 3.0
        assert (err.value.kind, err.value.ranks) == ("crash", [1])
        assert "exit code -9" in err.value.detail
        assert_dead(seen)

        # A rank that stops answering (SIGSTOP) is named by the time bound.
        engine.reset()
        seen += engine.executor.pids
        engine.add_request("a", list(range(20)), 4)
        engine.step()
        os.kill(engine.executor.pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as err:
            while engine.has_unfinished_requests():
                engine.step()
        assert err.value.kind == "timeout" and 0 in err.value.ranks
        assert time.monotonic() - t0 < cfg.step_timeout_s + 2.0
        assert_dead(seen)

        # A rank that raises sends its traceback.
        engine.reset()
        seen += engine.executor.pids
        engine.executor._broadcast(("no-such-message",))
        with pytest.raises(RankFailure) as err:
            engine.executor.collect(0)
        assert err.value.kind == "exception" and "unknown message" in err.value.detail

        # Fresh ranks after the failures still agree with the in-process world.
        ref, _ = inproc_trace(cfg, workload(3))
        got = run(engine, workload(3))
        seen += engine.executor.pids
        assert_same(ref, got)
    finally:
        engine.shutdown()
    assert_dead(seen)
