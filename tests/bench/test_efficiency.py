"""The efficiency figure of `llmfuzz bench`: its floor is a raw forward of the very model the
engine runs, and its meter counts every forward an example runs and leaves nothing patched."""
from __future__ import annotations

import torch

from bench.efficiency import Meter, RawModel
from fuzz.verdict.oracles.solo import SoloOracle
from fuzz.cases.strategies import FUZZ_MODEL


def test_the_floor_is_a_forward_of_the_same_model():
    ids = torch.randint(0, FUZZ_MODEL.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    raw = RawModel(FUZZ_MODEL).forward(ids)
    solo = SoloOracle()
    ref = solo.forward(solo._model(FUZZ_MODEL), FUZZ_MODEL, ids).float()
    assert raw.shape == ref.shape
    # fp32 SDPA against the engine's fp64-accumulated layers: equal to ~1e-5, not bitwise.
    assert (raw - ref).abs().max().item() < 1e-3


def test_the_meter_counts_each_forward_and_restores_what_it_wrapped():
    from engine.model_runner import GPUModelRunner
    from engine.scheduler import Scheduler
    from fuzz.verdict import harness as harness_mod
    from fuzz.campaign.loop import Campaign
    from fuzz.verdict.harness import Harness

    import os
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fuzz"))
    from fuzz_testutil import FakeClock  # tests/fuzz's (its conftest puts it on the path there)

    before = (GPUModelRunner.prepare, Scheduler.schedule, harness_mod.check_fa_records)
    h = Harness()
    # The campaign runs on a clock each check moves 0.5 s: its budget is about 6 examples however
    # loaded the machine (the meter's figures are on the real clock: `wall`).
    clock, check = FakeClock(), h.check

    def timed_check(case):
        clock.sleep(0.5)
        return check(case)

    h.check = timed_check
    scheduled = []
    try:
        meter = Meter().install()
        real = Scheduler.schedule

        def spy(sched, *a, **kw):
            so = real(sched, *a, **kw)
            if so is not None:
                scheduled.append(so.total_num_scheduled_tokens)
            return so
        Scheduler.schedule = spy
        try:
            t0 = time.monotonic()
            s = Campaign(layouts=("tp1pp1",), modes=("eager",), budget_s=3.0, progress=False, harness=h,
                         out_dir="bench-out/test-meter", clock=clock).run()
            wall = time.monotonic() - t0
        finally:
            Scheduler.schedule = real
            meter.remove()
        report = meter.report(FUZZ_MODEL, s.examples, wall)
    finally:
        h.close()
    assert (GPUModelRunner.prepare, Scheduler.schedule, harness_mod.check_fa_records) == before
    assert s.examples > 0 and scheduled
    engine_forwards = sum(n for k, n in meter.tokens.items())
    assert engine_forwards >= len(scheduled)  # every microbatch, plus the oracles' requests
    assert all(meter.tokens[t] >= scheduled.count(t) for t in set(scheduled))
    assert 0.0 < report["efficiency"] < 1.0
    assert 0.0 < report["efficiency_no_grad_floor"] < 1.0  # the floor as measured before inference mode
    per = report["per_example"]
    assert 0 < per["floor_s"] < per["example_s"]
    # The parts are parts of the whole: the engine runs within the example's time, attention
    # within the forward.
    assert 0 < per["harness"]["engine_runs_s"] <= per["example_s"]
    assert 0 < per["engine"]["attention_s"] < per["engine"]["forward_s"]
