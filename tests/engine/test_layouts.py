"""Every tp x pp layout (in-process world) gives tp1pp1's logits, under any Schedule."""
from __future__ import annotations

import random

import pytest
import torch

from engine import ConfigError, EngineConfig, LLMEngine, Schedule
from engine.inproc_world import RankFailure

# 8 layers so pp8 and an uneven pp3 exist; 8 heads / 2 kv heads so tp8 replicates kv heads.
BASE = EngineConfig(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    max_num_batched_tokens=12, max_model_len=64, num_gpu_blocks=64)
LAYOUTS = ["tp2pp1", "tp4pp1", "tp8pp1", "tp1pp2", "tp1pp3", "tp1pp4", "tp1pp8", "tp2pp2", "tp2pp4", "tp4pp2",
           "tp2pp3"]


def workload(seed: int = 0, n: int = 5):
    rng = random.Random(seed)
    # Prompts around the block size (4) and the token budget (12): chunked prefill happens.
    return [(f"r{i}", [rng.randrange(128) for _ in range(rng.choice([1, 3, 4, 5, 11, 13, 25]))],
             rng.randint(1, 5), rng.randint(0, 2)) for i in range(n)]


def run(engine: LLMEngine, reqs, forced=None, schedule=None) -> dict:
    engine.reset(schedule)
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, prompt, n, forced[rid] if forced else None)
        if engine.has_unfinished_requests():
            engine.step()
        step += 1
    return engine.trace.tokens


@pytest.fixture(scope="module")
def reference():
    eng = LLMEngine(BASE)
    out = {s: run(eng, workload(s)) for s in range(2)}
    eng.shutdown()
    return out


def assert_close(ref: dict, got: dict, atol: float = 1e-5) -> None:
    assert ref.keys() == got.keys()
    for rid in ref:
        assert len(ref[rid]) == len(got[rid]), rid
        for a, b in zip(ref[rid], got[rid]):
            err = float((a.logits - b.logits).abs().max())
            assert err <= atol, f"{rid}: max |diff| {err}"


# Sequence parallelism is a TP mode: with tp1 the second variant checks broadcast_pp_output alone.
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sp,bcast", [(False, False), (True, True)])
def test_layout_matches_tp1pp1(layout, sp, bcast, reference):
    cfg = BASE.replace(layout=layout)
    cfg = cfg.replace(sequence_parallel=sp and cfg.tp > 1, broadcast_pp_output=bcast and cfg.pp > 1)
    eng = LLMEngine(cfg)
    try:
        for seed, ref in reference.items():
            forced = {rid: [t.token for t in recs] for rid, recs in ref.items()}
            assert_close(ref, run(eng, workload(seed), forced))
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout", ["tp1pp2", "tp2pp2", "tp1pp4", "tp2pp4", "tp1pp8", "tp1pp3"])
def test_schedule_invariance(layout, reference):
    """A correct engine gives the same logits under 20 random Schedules (order, copy
    landing, host running ahead)."""
    eng = LLMEngine(BASE.replace(layout=layout))
    ref = reference[0]
    forced = {rid: [t.token for t in recs] for rid, recs in ref.items()}
    rng = random.Random(layout)
    try:
        for _ in range(20):
            sched = Schedule(seed=rng.randrange(2 ** 16), rank_order=rng.choice(["natural", "random"]),
                             copy_delay=rng.choice([0.0, 0.5, 0.9, 1.0]), prepare_ahead=rng.choice([0.0, 0.5, 1.0]))
            assert_close(ref, run(eng, workload(0), forced, sched))
    finally:
        eng.shutdown()


def test_pp_keeps_microbatches_in_flight():
    eng = LLMEngine(BASE.replace(layout="tp1pp4", max_num_batched_tokens=4))
    try:
        run(eng, workload(1, n=6))
        assert eng.trace.max_in_flight >= 2
    finally:
        eng.shutdown()


@pytest.mark.parametrize("layout,field", [("tp3pp1", "num_attention_heads"), ("tp16pp1", "num_attention_heads"),
                                          ("tp1pp9", "more stages"), ("tp4pp1x", "layout")])
def test_impossible_layout_rejected_before_ranks(layout, field):
    with pytest.raises(ConfigError) as e:
        BASE.replace(layout=layout)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_rank_that_raises_fails_step_naming_it(monkeypatch):
    """A rank raising inside a collective-heavy step is reported within seconds, by rank."""
    from engine.model_runner import GPUModelRunner

    orig = GPUModelRunner.execute

    def boom(self, pb):
        if self.g.rank == 3:
            raise RuntimeError("injected failure")
        return orig(self, pb)

    eng = LLMEngine(BASE.replace(layout="tp2pp2", step_timeout_s=10))
    monkeypatch.setattr(GPUModelRunner, "execute", boom)
    eng.add_request("a", [1, 2, 3], 2)
    with pytest.raises(RankFailure) as e:
        while eng.has_unfinished_requests():
            eng.step()
    assert e.value.ranks == [3] and "injected failure" in str(e.value)
    eng.shutdown()


def test_hung_rank_times_out_naming_it(monkeypatch):
    import threading

    from engine.model_runner import GPUModelRunner

    orig = GPUModelRunner.execute
    release = threading.Event()

    def hang(self, pb):
        if self.g.rank == 1:
            release.wait(30)  # never hands the baton back in time
        return orig(self, pb)

    eng = LLMEngine(BASE.replace(layout="tp1pp2", step_timeout_s=1.5))
    monkeypatch.setattr(GPUModelRunner, "execute", hang)
    eng.add_request("a", [1, 2, 3], 2)
    with pytest.raises(RankFailure) as e:
        while eng.has_unfinished_requests():
            eng.step()
    release.set()
    assert e.value.kind == "timeout" and e.value.ranks == [1]
    eng.shutdown()


def test_reductions_do_not_depend_on_thread_timing(reference):
    """Two runs of tp4pp2 with different rank orders are bitwise identical."""
    eng = LLMEngine(BASE.replace(layout="tp4pp2"))
    try:
        a = run(eng, workload(0), schedule=Schedule(seed=1, rank_order="random"))
        b = run(eng, workload(0), schedule=Schedule(seed=2, rank_order="random"))
        for rid in a:
            assert all(torch.equal(x.logits, y.logits) for x, y in zip(a[rid], b[rid]))
    finally:
        eng.shutdown()
