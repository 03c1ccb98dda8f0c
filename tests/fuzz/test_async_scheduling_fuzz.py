"""Async scheduling on the fuzz side: a clean async Case passes the harness (its reference run
schedules synchronously) and reports its overlap; with async_placeholder_not_replaced the
same Case fails on its logits; the strategies draw it; the minimizer drops it first."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from engine.faults import ASYNC_PLACEHOLDER_NOT_REPLACED
from engine.schedule import Schedule
from fuzz.campaign.summary import CellStats, Summary
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, IMPLEMENTED_MODES, cases
from fuzz.targets.reference import HarnessTarget
from fuzz.targets.simpler import candidates
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import LogitsMismatch

ASYNC = FUZZ_MODEL.replace(max_num_batched_tokens=16, async_scheduling=True)
# reproducers/faults/async_placeholder_not_replaced.json's workload, longer: a 17-token
# prompt's last chunk batched before the decode of a request that arrived a step later.
CASE = Case(ASYNC, Workload((RequestSpec((0,), 2), RequestSpec((0,), 4, 1), RequestSpec(tuple(range(1, 18)), 3))))


@pytest.fixture(scope="module")
def harness():
    h = Harness(4)
    yield h
    h.close()


def test_clean_async_case_passes_and_reports_overlap(harness) -> None:
    v = harness.check(CASE)
    assert 0 < v.async_steps <= v.num_steps
    sync = harness.check(dataclasses.replace(CASE, config=ASYNC.replace(async_scheduling=False)))
    assert sync.async_steps == 0
    target, stats = HarnessTarget(harness), CellStats()
    target.record(stats, v)
    target.record(stats, sync)
    async_notes = {k: n for k, n in stats.notes.items() if k.startswith("async_")}
    assert async_notes == {"async_cases": 1, "async_steps": v.async_steps, "async_all_steps": v.num_steps}
    row = Summary(cells={("tp1pp1", "eager"): stats}).to_json()["per_cell"]["tp1pp1/eager"]
    assert row["async_cases"] == 1 and row["async_overlap"] == round(v.async_steps / v.num_steps, 3)


@pytest.mark.parametrize("layout", ["tp1pp1", "tp1pp2", "tp2pp1"])
def test_placeholder_fault_fails_the_logits(harness, layout) -> None:
    case = dataclasses.replace(CASE, config=ASYNC.replace(layout=layout), faults=(ASYNC_PLACEHOLDER_NOT_REPLACED,),
                               schedule=Schedule(seed=1, async_wait=0.2))
    with pytest.raises(LogitsMismatch):
        Harness(2).check(case)  # its own engines: a fault never shares one with clean runs
    harness.check(dataclasses.replace(case, faults=()))


def test_strategies_draw_async_and_the_minimizer_drops_it_first() -> None:
    drawn = find(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES), lambda c: c.config.async_scheduling,
                 settings=settings(max_examples=200, phases=[Phase.generate], derandomize=True, database=None,
                                   deadline=None, suppress_health_check=list(HealthCheck)))
    first = [c for c in candidates(drawn) if c is not None][:2]  # caching off comes first, when on
    assert any(not c.config.async_scheduling and c.workload == drawn.workload for c in first)
    waits = dataclasses.replace(CASE, schedule=Schedule(seed=3, async_wait=0.5))
    assert any(c is not None and c.schedule.async_wait == 0.0 and c.schedule.seed == 3 for c in candidates(waits))
