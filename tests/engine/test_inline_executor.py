"""A world of one rank runs on the driver's thread (engine/inline_executor.py) and behaves
exactly as the threaded world: same tokens and logits bit for bit under any Schedule, and a
rank that raises, loops forever or is interrupted becomes what it becomes there."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from engine import EngineConfig, LLMEngine, Schedule
from engine.executor import InProcExecutor
from engine.inline_executor import InlineExecutor
from engine.inproc_world import RankFailure

CFG = EngineConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_num_batched_tokens=12, max_model_len=64, num_gpu_blocks=64)


def run(engine: LLMEngine, seed: int, schedule: Schedule | None) -> dict:
    rng = random.Random(seed)
    engine.reset(schedule)
    reqs = [(f"r{i}", [rng.randrange(128) for _ in range(rng.choice([1, 4, 5, 13, 25]))], rng.randint(1, 5),
             rng.randint(0, 2)) for i in range(5)]
    pending, step = sorted(reqs, key=lambda r: r[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, prompt, n)
        if engine.has_unfinished_requests():
            engine.step()
        step += 1
    return engine.trace.tokens


def threaded(cfg: EngineConfig) -> LLMEngine:
    eng = LLMEngine(cfg)
    eng.executor.shutdown()
    eng.executor = InProcExecutor(cfg)
    eng.reset()
    return eng


SCHEDULES = [None, Schedule(seed=3, copy_delay=0.7), Schedule(seed=5, rank_order="random", prepare_ahead=0.5),
             Schedule(seed=9, copy_delay=0.3, prepare_ahead=1.0)]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_inline_world_matches_the_threaded_world_bitwise(mode):
    cfg = CFG if mode == "eager" else CFG.replace(cudagraph_mode="FULL", capture_sizes=(1, 2, 4, 8))
    inline, thread = LLMEngine(cfg), threaded(cfg)
    assert isinstance(inline.executor, InlineExecutor)
    try:
        for seed in range(3):
            for sched in SCHEDULES:
                a, b = run(inline, seed, sched), run(thread, seed, sched)
                assert a.keys() == b.keys()
                for rid in a:
                    assert [t.token for t in a[rid]] == [t.token for t in b[rid]]
                    assert all(torch.equal(x.logits, y.logits) for x, y in zip(a[rid], b[rid])), (seed, sched, rid)
    finally:
        inline.shutdown()
        thread.shutdown()


def test_a_rank_that_raises_is_a_rank_failure(monkeypatch):
    eng = LLMEngine(CFG)
    monkeypatch.setattr(eng.executor.worker.runner, "execute", lambda pb: 1 / 0)
    with pytest.raises(RankFailure) as e:
        run(eng, 0, None)
    assert e.value.kind == "exception" and e.value.ranks == [0] and "ZeroDivisionError" in e.value.detail
    with pytest.raises(RankFailure):  # broken for good, as a threaded world is
        eng.reset()


def test_a_rank_that_never_yields_times_out(monkeypatch):
    eng = LLMEngine(CFG.replace(step_timeout_s=1.0))

    def endless(pb):
        while True:
            pass
    monkeypatch.setattr(eng.executor.worker.runner, "execute", endless)
    with pytest.raises(RankFailure) as e:
        run(eng, 0, None)
    assert e.value.kind == "timeout" and e.value.ranks == [0]


def test_an_interrupt_mid_step_leaves_an_engine_the_next_reset_restores(monkeypatch):
    eng = LLMEngine(CFG)
    want = run(eng, 1, None)
    real = eng.executor.worker.runner.execute

    def interrupted(pb):
        raise KeyboardInterrupt
    monkeypatch.setattr(eng.executor.worker.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(eng, 1, None)
    monkeypatch.setattr(eng.executor.worker.runner, "execute", real)
    got = run(eng, 1, None)
    assert all(torch.equal(x.logits, y.logits) for rid in want for x, y in zip(want[rid], got[rid]))


def test_off_the_main_thread_a_world_of_one_uses_a_rank_thread():
    """SIGALRM, the inline world's watchdog, reaches the main thread only."""
    kinds = []
    t = threading.Thread(target=lambda: kinds.append(type(LLMEngine(CFG).executor)))
    t.start()
    t.join()
    assert kinds == [InProcExecutor]
