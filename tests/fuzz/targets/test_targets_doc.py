"""docs/targets.md's adapter, run from the page itself: it keeps the protocol and passes clean;
bugs planted in variants of it are found through `llmfuzz.check` under pytest, by the property
that should see each, and shrunk to a small Case whose reproducer replays."""
from __future__ import annotations

import functools
import json
import re
import types
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402

import llmfuzz  # noqa: E402
from fuzz.cases.case import Case, RequestSpec, Workload  # noqa: E402
from fuzz.cases.strategies import FUZZ_MODEL  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "targets.md"
QUICK = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


def doc_example() -> types.ModuleType:
    """The page's adapter block (the one after "## A complete adapter"), as a module."""
    text = DOC.read_text()
    block = re.search(r"## A complete adapter.*?```python\n(.*?)```", text, re.S).group(1)
    mod = types.ModuleType("targets_doc_example")
    exec(compile(block, str(DOC), "exec"), mod.__dict__)
    return mod


@pytest.fixture(scope="module")
def example():
    """The page's module, its Hypothesis test bound to a short derandomized run (a test's
    settings take what they leave out from the profile loaded when it is decorated)."""
    before = settings.get_current_profile_name()
    settings.register_profile("targets-doc", max_examples=12, **QUICK)
    settings.load_profile("targets-doc")
    try:
        mod = doc_example()
    finally:
        settings.load_profile(before)
    yield mod
    mod.TARGET.close()


def test_the_documented_adapter_is_about_sixty_lines_and_defines_a_target() -> None:
    block = re.search(r"## A complete adapter.*?```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    assert 45 <= len(block.splitlines()) <= 75
    mod = doc_example()
    assert issubclass(mod.ReferenceEngineTarget, llmfuzz.Target)


@pytest.mark.slow
def test_the_documented_adapter_keeps_the_protocol_and_passes_clean(example, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLMFUZZ_REPRODUCERS", str(tmp_path))
    llmfuzz.check_protocol(example.TARGET)
    example.test_reference_engine_as_a_black_box()
    assert not list(tmp_path.rglob("*.json"))  # nothing failed, nothing written


def _corrupted(completion, shift: float):
    return llmfuzz.Completion(completion.token_ids, [{t: v + shift for t, v in p.items()} for p in completion.logprobs])


def _variant(example, name: str, generate):
    return type(name, (example.ReferenceEngineTarget,), {"name": name.lower(), "generate": generate})


@pytest.mark.slow
def test_a_bug_of_one_batch_composition_is_found_shrunk_and_written(example, tmp_path) -> None:
    """Planted: with a 9-token-or-longer prompt in a batch of two or more, every other
    request's logprobs are 0.01 off (a kernel path only that mix takes). Greedy tokens stay right."""
    def generate(self, config, requests):
        out = example.ReferenceEngineTarget.generate(self, config, requests)
        if len(requests) >= 2 and any(len(r.prompt_token_ids) >= 9 for r in requests):
            return [c if len(r.prompt_token_ids) >= 9 else _corrupted(c, 0.01) for r, c in zip(requests, out)]
        return out

    buggy = _variant(example, "Mixed_Batch", generate)()

    @settings(max_examples=80, **QUICK)
    @given(llmfuzz.cases(layouts=["tp1pp1"], max_requests=4))
    def test_mine(case):
        llmfuzz.check(buggy, case, out_dir=str(tmp_path))

    with pytest.raises(llmfuzz.Violation) as ei:
        test_mine()
    v = ei.value
    assert v.property == "mixed_batch_vs_reference"
    reqs = v.case.workload.requests
    # Shrunk to the composition itself: two requests of one token each, one prompt of exactly 9.
    assert len(reqs) == 2 and all(r.max_tokens == 1 for r in reqs)
    assert sorted(len(r.prompt_token_ids) for r in reqs)[-1] == 9
    written = list(tmp_path.rglob("*.json"))
    assert [str(p) for p in written] == [v.reproducer]  # only the final, shrunk failure
    doc = json.loads(Path(v.reproducer).read_text())
    assert doc["property"] == v.property and doc["blackbox_target"] == "mixed_batch"
    assert Case.from_dict(doc["case"]) == v.case
    assert llmfuzz.replay(v.reproducer, target=buggy).verdict == "reproduces"
    assert llmfuzz.replay(v.reproducer, target=example.TARGET).verdict == "passes"
    with pytest.raises(llmfuzz.BadInput, match="mixed_batch"):
        llmfuzz.replay(v.reproducer)  # an adapter's reproducer needs its target
    buggy.close()


def _case(*reqs, **cfg) -> Case:
    return Case(FUZZ_MODEL.replace(**cfg) if cfg else FUZZ_MODEL, Workload(tuple(reqs)))


def test_a_dropped_logit_bias_is_seen_only_by_the_sampling_property(example, tmp_path) -> None:
    """Planted: the adapter drops the logit bias. Teacher-forced on its own tokens the
    reference agrees on every raw logprob; only the independent sampler sees the choice."""
    def generate(self, config, requests):
        unbiased = [llmfuzz.Request(r.request_id, r.prompt_token_ids, r.max_tokens,
                                    replace(r.sampling, logit_bias=()), r.arrival_step, r.cache_salt, r.logprobs)
                    for r in requests]
        return example.ReferenceEngineTarget.generate(self, config, unbiased)

    prompt = (5, 9, 5, 9)
    first = example.TARGET.run(_case(RequestSpec(prompt, 1))).results["r0"].token_ids[0]
    biased = RequestSpec(prompt, 3, sampling=llmfuzz.SamplingParams(logit_bias={(first + 1) % 128: 100.0}))
    case = _case(RequestSpec(prompt, 3), biased)
    llmfuzz.check(example.TARGET, case, out_dir=str(tmp_path))  # the clean adapter passes
    buggy = _variant(example, "No_Bias", generate)()
    with pytest.raises(llmfuzz.Violation) as ei:
        llmfuzz.check(buggy, case, out_dir=str(tmp_path))
    assert ei.value.property == "no_bias_sampling", ei.value
    assert ei.value.oracle == "sampling" and "request r1 position 0" in str(ei.value)
    buggy.close()


def test_an_ignored_stop_token_is_a_length_difference_against_the_reference(example, tmp_path) -> None:
    def generate(self, config, requests):
        free = [llmfuzz.Request(r.request_id, r.prompt_token_ids, r.max_tokens, llmfuzz.SamplingParams(),
                                r.arrival_step, r.cache_salt, r.logprobs) for r in requests]
        return example.ReferenceEngineTarget.generate(self, config, free)

    clean_tokens = example.TARGET.run(_case(RequestSpec((3, 4, 5), 6))).results["r0"].token_ids
    stop = RequestSpec((3, 4, 5), 6, sampling=llmfuzz.SamplingParams(stop_token_ids=(clean_tokens[1],)))
    llmfuzz.check(example.TARGET, _case(stop), out_dir=str(tmp_path))
    buggy = _variant(example, "No_Stop", generate)()
    with pytest.raises(llmfuzz.Violation, match="generated 6 tokens") as ei:
        llmfuzz.check(buggy, _case(stop), out_dir=str(tmp_path))
    assert ei.value.property == "no_stop_vs_reference"
    buggy.close()


def test_the_fa_guard_in_the_engine_is_the_fa_invariants_property(example, tmp_path) -> None:
    """Planted: our engine's stale_query_start_loc_tail fault (padded query_start_loc entries
    left stale in graph mode), which changes no logits on CPU: the adapter passes without the
    guard, and with it every check fails with <name>_fa_invariants, not a crash."""
    from fuzz import guard

    def engine(self, config):
        new = repr(config) not in self.engines
        eng = example.ReferenceEngineTarget.engine(self, config)
        if new:
            eng.reset = functools.partial(eng.reset, faults=("stale_query_start_loc_tail",))
        return eng

    faulty = type("Stale_Tail", (example.ReferenceEngineTarget,), {"name": "stale_tail", "engine": engine})()
    case = _case(RequestSpec((0,), 1), cudagraph_mode="FULL", capture_sizes=(4, 8, 16, 32))
    llmfuzz.check(faulty, case, out_dir=str(tmp_path))  # unseen without the guard
    guard.install(mode="raise")
    try:
        with pytest.raises(llmfuzz.Violation) as ei:
            llmfuzz.check(faulty, case, out_dir=str(tmp_path))
        llmfuzz.check(example.TARGET, case, out_dir=str(tmp_path))  # the clean engine, guarded, passes
    finally:
        guard.uninstall()
    assert ei.value.property == "stale_tail_fa_invariants"
    assert "cu_seqlens_q" in str(ei.value)
    faulty.close()


def test_a_bf16_error_below_the_dtype_formula_is_seen_by_the_measured_noise_rule(example, tmp_path) -> None:
    """Planted: in bf16 the adapter's logprobs are 1 nat off (a normalizer computed on the
    wrong row, say). The dtype formula's bound (tens of nats in bf16) passes it; the black-box
    half-precision rule (k x our engine's own bf16 noise + atol) does not. In fp32 nothing changes."""
    from fuzz.targets.blackbox import BlackBoxChecker

    def generate(self, config, requests):
        out = example.ReferenceEngineTarget.generate(self, config, requests)
        return [_corrupted(c, 1.0) for c in out] if config.dtype == "bfloat16" else out

    case = _case(RequestSpec((5, 9, 5, 9, 2), 4), RequestSpec((7, 1), 3), dtype="bfloat16")
    v = llmfuzz.check(example.TARGET, case, out_dir=str(tmp_path))  # clean bf16 passes the rule
    assert 0.1 <= v.logits.tolerance < 1.0 and v.logits.ratio < 0.5, v.logits
    buggy = _variant(example, "Off_By_A_Nat", generate)()
    formula = BlackBoxChecker(buggy, "off_by_a_nat", half_rule=False, transformers=False, batch_invariance=False)
    assert formula.check(case).logits.tolerance > 10  # unseen by the dtype formula
    with pytest.raises(llmfuzz.Violation) as ei:
        llmfuzz.check(buggy, case, out_dir=str(tmp_path))
    assert ei.value.property == "off_by_a_nat_vs_reference" and ei.value.error_ratio > 1, ei.value
    llmfuzz.check(buggy, _case(RequestSpec((5, 9, 5, 9, 2), 4)), out_dir=str(tmp_path))  # fp32: untouched
    buggy.close()
