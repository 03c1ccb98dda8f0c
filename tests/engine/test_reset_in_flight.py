"""An engine reused after a run that ended with microbatches in flight (a violation raised
mid-run, a campaign's shrink moving on) serves the next run as a fresh engine would: the
results of the abandoned microbatches are never collected as the new run's."""
from __future__ import annotations

import pytest

from engine import LLMEngine
from fuzz.cases.strategies import FUZZ_MODEL

# Three 12-token prompts under a 16-token budget: with pp2, microbatch 1 is still in flight
# after the first step.
CFG = FUZZ_MODEL.replace(layout="tp1pp2", num_hidden_layers=2, max_num_batched_tokens=16)


def _run(e: LLMEngine) -> dict:
    e.reset()
    e.add_request("b0", [5, 6, 7, 8], 4)
    e.add_request("b1", [9, 10], 4)
    while e.has_unfinished_requests():
        e.step()
    return e.trace.output_token_ids()


@pytest.mark.parametrize("world", ["inproc", pytest.param("torch", marks=pytest.mark.distributed)])
def test_a_run_abandoned_in_flight_leaves_nothing_for_the_next(world):
    fresh = LLMEngine(CFG.replace(world=world))
    try:
        want = _run(fresh)
    finally:
        fresh.shutdown()
    e = LLMEngine(CFG.replace(world=world))
    try:
        e.reset()
        for i, start in enumerate((1, 20, 40)):
            e.add_request(f"a{i}", list(range(start, start + 12)), 6)
        e.step()
        assert len(e.in_flight) == 1  # the run is abandoned with a microbatch in flight
        assert _run(e) == want
    finally:
        e.shutdown()
