"""Bitwise invariance (fuzz/verdict/bitwise.py, Harness.check_determinism): where the engine
promises bit-identical runs the harness compares bits, and each of the two planted faults
that break such a promise by an ulp -- far inside every tolerance -- is caught by that
comparison only. The clean engine passes both comparisons."""
from __future__ import annotations

import dataclasses

import pytest

import fuzz.verdict.harness as harness_mod
from engine.schedule import Schedule
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.campaign.selftest import run_selftest
from fuzz.cases.strategies import FUZZ_MODEL, tokens_from_seed
from fuzz.verdict.bitwise import BitwiseViolation, reference_bitwise_due, twin_bitwise_due
from fuzz.verdict.derived import other_schedule, plain_twin
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import DeterminismViolation


def _case(layout="tp1pp1", faults=(), lens=(6, 2), max_tokens=3, schedule=Schedule(), **cfg) -> Case:
    reqs = tuple(RequestSpec(tokens_from_seed(3 + i, n, FUZZ_MODEL.vocab_size), max_tokens, i)
                 for i, n in enumerate(lens))
    return Case(FUZZ_MODEL.replace(layout=layout, **cfg), Workload(reqs), schedule, tuple(faults))


@pytest.fixture(scope="module")
def harness():
    h = Harness(4, frozenset({"determinism"}))  # determinism on every Case
    h.transformers = None  # not what these tests are about, and the slowest oracle
    yield h
    h.close()


def test_the_guarantee_covers_cpu_fp32_at_tp1_only() -> None:
    assert reference_bitwise_due(_case("tp1pp4", cudagraph_mode="FULL", capture_sizes=(4, 8)))
    assert reference_bitwise_due(_case(speculative_method="ngram", num_speculative_tokens=2))
    assert not reference_bitwise_due(_case("tp2pp1"))
    assert not reference_bitwise_due(_case(dtype="bfloat16"))


def test_other_schedule_changes_rank_order_and_copy_landing() -> None:
    for s in (Schedule(), Schedule(7, "random", 0.5, 1.0), Schedule(3, "natural", 0.9, 0.0)):
        o = other_schedule(s)
        assert o.rank_order == "random" and o != s and other_schedule(s) == o
        assert o.copy_delay != s.copy_delay and o.prepare_ahead != s.prepare_ahead
        assert s.rank_order == "natural" or o.seed != s.seed


def test_other_schedule_keeps_the_engines_own_batching_decisions() -> None:
    """async_wait and the seed the engine's driver draws it from decide how requests are batched:
    another batching may round otherwise in bf16 with no bug (a clean 900 s bf16 campaign
    reported that as broken schedule invariance), so the re-run keeps them."""
    s = Schedule(7, "random", 0.5, 1.0, async_wait=0.3)
    o = other_schedule(s)
    assert o.async_wait == 0.3 and o.seed == 7 and (o.copy_delay, o.prepare_ahead) != (s.copy_delay, s.prepare_ahead)


def test_a_bf16_async_case_with_waits_keeps_its_batching_under_another_schedule(harness) -> None:
    """The campaign's Case (tp4pp1 eager, bf16, async scheduling, waits drawn at 0.3): logits
    0.031 apart under another Schedule while it dropped async_wait; the same under this one."""
    wl = Workload((RequestSpec((0,), 2), RequestSpec((0,) * 10, 8), RequestSpec((0,), 1), RequestSpec((0,), 1),
                   RequestSpec((78, 64, 23, 125, 117, 105), 1)))
    case = Case(FUZZ_MODEL.replace(layout="tp4pp1", dtype="bfloat16", async_scheduling=True, max_num_seqs=2), wl,
                Schedule(async_wait=0.3))
    assert harness.check(case).oracles["determinism"] is True


@pytest.mark.parametrize("layout,mode", [("tp1pp1", "eager"), ("tp1pp2", "graph"), ("tp4pp1", "eager"),
                                         ("tp2pp2", "graph")])
def test_clean_engine_is_bitwise_where_promised(harness, layout, mode) -> None:
    graph = dict(cudagraph_mode="FULL", capture_sizes=(4, 8, 16)) if mode == "graph" else {}
    v = harness.check(_case(layout, max_num_batched_tokens=5, schedule=Schedule(5, "random", 0.5, 1.0), **graph))
    assert v.oracles["determinism"] is True
    assert ("bitwise_invariance" in v.oracles) == (layout.startswith("tp1"))
    assert v.oracles["reference"].ratio < 0.1


def test_split_k_by_batch_size_is_caught_bitwise_and_only_bitwise(harness, monkeypatch) -> None:
    case = _case(faults=("split_k_by_batch_size",))
    with pytest.raises(BitwiseViolation) as ei:
        harness.check(case)
    v = ei.value
    assert v.property == "bitwise_invariance" and v.oracle == "reference"
    assert "bitwise invariance broken against the reference" in v.message
    harness.check(dataclasses.replace(case, faults=()))  # the clean engine passes the same Case
    # Without the bitwise comparison every other check passes: its error is an ulp.
    monkeypatch.setattr(harness_mod, "reference_bitwise_due", lambda c: False)
    assert harness.check(case).oracles["reference"].ratio < 0.1


def test_half_precision_runs_at_tp1_are_compared_with_their_plain_twin_bitwise() -> None:
    bf16 = _case("tp1pp4", dtype="bfloat16", cudagraph_mode="FULL", capture_sizes=(4, 8),
                 speculative_method="ngram", num_speculative_tokens=2, enable_prefix_caching=True)
    assert twin_bitwise_due(bf16) and twin_bitwise_due(_case(dtype="float16"))
    assert not twin_bitwise_due(_case("tp2pp1", dtype="bfloat16"))  # a split K rounds to another half
    assert not twin_bitwise_due(_case())  # float32 has the reference itself
    twin = plain_twin(bf16).config
    assert (twin.layout, twin.cudagraph_mode, twin.speculative_method, twin.enable_prefix_caching,
            twin.dtype) == ("tp1pp1", "NONE", "none", False, "bfloat16")


@pytest.mark.parametrize("layout,mode", [("tp1pp2", "graph"), ("tp1pp1", "eager")])
def test_clean_bf16_engine_equals_its_plain_twin_bitwise(harness, layout, mode) -> None:
    graph = dict(cudagraph_mode="FULL", capture_sizes=(4, 8, 16)) if mode == "graph" else {}
    v = harness.check(_case(layout, dtype="bfloat16", max_num_batched_tokens=5, enable_prefix_caching=True,
                            speculative_method="ngram", num_speculative_tokens=2, **graph))
    assert v.oracles["bitwise_invariance"] is True


def test_split_k_by_batch_size_in_bf16_is_caught_by_the_plain_twin_only(harness, monkeypatch) -> None:
    """In half precision the float32 reference cannot be compared bit for bit: without the
    twin the split-K reduction passes every check (its error is an ulp of bf16)."""
    case = _case(faults=("split_k_by_batch_size",), dtype="bfloat16")
    with pytest.raises(BitwiseViolation) as ei:
        harness.check(case)
    assert (ei.value.property, ei.value.oracle) == ("bitwise_invariance", "plain twin")
    assert "bitwise invariance broken against its plain twin in the same dtype" in ei.value.message
    harness.check(dataclasses.replace(case, faults=()))
    monkeypatch.setattr(harness_mod, "twin_bitwise_due", lambda c: False)
    assert harness.check(case).oracles["reference"].ratio < 1.0


def test_allreduce_arrival_order_is_caught_under_another_schedule_only(harness, monkeypatch) -> None:
    case = _case("tp4pp1", faults=("allreduce_arrival_order",))
    with pytest.raises(DeterminismViolation) as ei:
        harness.check(case)
    v = ei.value
    assert v.property == "determinism" and v.oracle == "another schedule"
    assert "schedule invariance broken" in v.message
    harness.check(dataclasses.replace(case, faults=()))
    # Re-run under the Case's own Schedule (the oracle as it was): the ranks arrive in the
    # same order, the bits agree, and every check passes.
    monkeypatch.setattr(harness_mod, "rescheduled", lambda c: c)
    assert harness.check(case).oracles["reference"].ratio < 0.2


def test_a_nondeterministic_engine_is_told_from_a_schedule_dependent_one(harness, monkeypatch) -> None:
    """A difference that the Case's own Schedule reproduces is reported as nondeterminism."""
    real = harness_mod.rescheduled
    runs = []

    def wobble(c):
        runs.append(c)
        return real(c)
    monkeypatch.setattr(harness_mod, "rescheduled", wobble)
    import engine.model as model_mod
    # Every run from the determinism oracle's on computes other logits than the test run did,
    # whichever earlier runs (a cached reference or not) this module's harness made.
    logits = model_mod.LlamaForCausalLM.compute_logits
    monkeypatch.setattr(model_mod.LlamaForCausalLM, "compute_logits",
                        lambda self, h: logits(self, h) + (1e-7 if runs else 0.0))
    with pytest.raises(DeterminismViolation) as ei:
        harness.check(_case("tp2pp1"))
    assert ei.value.oracle == "determinism" and runs


def test_the_reference_runs_with_the_cases_poison(harness, monkeypatch) -> None:
    from fuzz.verdict import runner

    seen = []
    real = runner.drive

    def drive(engine, case, *a, **k):
        seen.append((case.config.layout, case.poison))
        return real(engine, case, *a, **k)
    monkeypatch.setattr(runner, "drive", drive)
    harness.clear_caches()
    case = dataclasses.replace(_case("tp1pp2", lens=(5,)), poison="stale")
    harness.check(case)
    assert ("tp1pp1", "stale") in seen and ("tp1pp2", "stale") in seen
    assert all(p == "stale" for _, p in seen)
    key_stale = len(harness.ref_cache)
    harness.check(dataclasses.replace(case, poison="nan"))  # another memory model: another reference
    assert len(harness.ref_cache) == key_stale + 1


@pytest.mark.slow
@pytest.mark.parametrize("fault,layout,prop,oracle,budget", [
    ("split_k_by_batch_size", "tp1pp1", "bitwise_invariance", "reference", 20.0),  # the first example
    ("allreduce_arrival_order", "tp4pp1", "determinism", "another schedule", 45.0)])
def test_selftest_catches_each_bitwise_fault(tmp_path, fault, layout, prop, oracle, budget) -> None:
    """The selftest's campaign (ordinary strategies, the fault in the run under test) on the
    smallest layout that shows the fault (all layouts: `llmfuzz selftest`, bench/results)."""
    # A 2-layer model: the same machinery at half the cost of an example. What is asserted is
    # the detection and its property, so the shrink gets two seconds (it took 20-30 s of 35).
    [r] = run_selftest([fault], budget_per_fault=budget, out_dir=str(tmp_path), progress=False, isolate="off",
                       shrink_grace_s=2.0, shrink_s=2.0, layouts=(layout,),
                       base=FUZZ_MODEL.replace(num_hidden_layers=2))
    assert r.detected, r
    # Arrival order also breaks the bitwise comparison of a prefix-caching Case with its
    # caching-off twin (two runs, two orders): another bitwise check, never the tolerance.
    assert (r.property, r.oracle) == (prop, oracle) or \
        (fault == "allreduce_arrival_order" and r.property == "prefix_cache_invariance"), r
