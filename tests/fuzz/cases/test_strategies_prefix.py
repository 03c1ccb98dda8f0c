"""Prefix caching on the fuzz side: Case JSON with caching and salts (and without them exactly
as before), strategies that draw prefix-sharing workloads and shrink toward none, the
minimizer's candidates, and the harness's checks: the caching-on run bitwise equal to the
same run with caching off (fp32 CPU), the books, and the hit rate a campaign reports."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, seed, settings

from engine.schedule import Schedule
from fuzz.campaign.shrink import minimize_to_fixpoint
from fuzz.campaign.summary import CellStats, Summary
from fuzz.cases.case import PLAIN_FORMAT, PREFIX_FORMAT, Case, CaseFormatError, RequestSpec, Workload, reference_config
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, IMPLEMENTED_MODES, cases, tokens_from_seed
from fuzz.targets.reference import HarnessTarget
from fuzz.targets.simpler import candidates
from fuzz.verdict import runner
from fuzz.verdict.derived import prefix_twin_due
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import EngineViolation, LogitsMismatch, PrefixCacheViolation

CACHING = FUZZ_MODEL.replace(enable_prefix_caching=True)
_FAST = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck))


def toks(s, n: int) -> tuple[int, ...]:
    return tokens_from_seed(s, n, FUZZ_MODEL.vocab_size)


# -- Case JSON --------------------------------------------------------------------------------

def _plain_case() -> Case:
    return Case(FUZZ_MODEL.replace(layout="tp2pp2"),
                Workload((RequestSpec((1, 2, 3, 4, 5), 3), RequestSpec((7,), 1, arrival_step=2))),
                Schedule(seed=3, rank_order="random", copy_delay=0.5, prepare_ahead=1.0),
                ("pp_stale_new_token_ids",))


# sha256 of the JSON these Cases had before prefix caching existed (llmfuzz at 3a61eaf): the
# reproducer ids, the Case keys and the determinism oracle's sample hang on it. A new
# EngineConfig field changes it too: drop that field from Case.to_dict at its default.
_BEFORE = {"plain": ("80326a083c3b6e01d0ba3b4f0ad2725276d66b633f6281e07618b0ba89ecdc7f", 2),
           "stale": ("9c1cf6e5f7fcf33d31d9b06eaef75c66015e9c75bfb1ca2c971e37f9abaf393c", 4),
           "vllm": ("ac4d1e2b072369c45fae5df86e7dd36010e9cd5668c8d48450d7d39666469e9f", 3)}


@pytest.mark.parametrize("kind", sorted(_BEFORE))
def test_json_without_caching_or_salt_is_unchanged(kind: str) -> None:
    case = {"plain": _plain_case(), "stale": dataclasses.replace(_plain_case(), poison="stale"),
            "vllm": dataclasses.replace(_plain_case(), target="vllm",
                                        target_options={"enable_prefix_caching": True})}[kind]
    d = case.to_dict()
    assert "enable_prefix_caching" not in d["config"]
    assert all("cache_salt" not in r for r in d["workload"])
    assert (hashlib.sha256(case.to_json().encode()).hexdigest(), d["format"]) == _BEFORE[kind]


def test_json_round_trip_with_caching_and_salts() -> None:
    case = Case(CACHING.replace(layout="tp1pp2"),
                Workload((RequestSpec(toks(1, 9), 2, 0, "a"), RequestSpec(toks(1, 9), 2, 3, None),
                          RequestSpec(toks(1, 9), 1, 5, "b"))))
    d = case.to_dict()
    assert d["format"] == PREFIX_FORMAT and d["config"]["enable_prefix_caching"] is True
    assert [r.get("cache_salt") for r in d["workload"]] == ["a", None, "b"]
    assert "cache_salt" not in d["workload"][1]  # None is left out, as in a plain Case
    back = Case.from_json(case.to_json())
    assert back == case and back.to_json() == case.to_json()
    assert [r.cache_salt for r in back.workload.requests] == ["a", None, "b"]
    # A salt alone (caching off) is format 5 too: an older llmfuzz would silently drop it.
    salted = dataclasses.replace(case, config=FUZZ_MODEL.replace(layout="tp1pp2"))
    assert salted.to_dict()["format"] == PREFIX_FORMAT and "enable_prefix_caching" not in salted.to_dict()["config"]
    assert Case.from_json(salted.to_json()) == salted
    assert "prefix_caching" in case.describe() and "salts=" in case.describe()


def test_caching_off_written_explicitly_still_loads() -> None:
    d = _plain_case().to_dict()
    d["config"]["enable_prefix_caching"] = False
    d["workload"][0]["cache_salt"] = None
    assert Case.from_dict(d) == _plain_case()


@pytest.mark.parametrize("salt", [3, ["a"], {"a": 1}])
def test_malformed_salt_is_one_line_error(salt) -> None:
    d = _plain_case().to_dict()
    d["workload"][0]["cache_salt"] = salt
    with pytest.raises(CaseFormatError) as ei:
        Case.from_dict(d)
    assert "cache_salt" in str(ei.value) and "\n" not in str(ei.value)


def test_reference_config_turns_caching_off() -> None:
    assert reference_config(CACHING.replace(layout="tp2pp2")).enable_prefix_caching is False


# -- strategies -------------------------------------------------------------------------------

def _shares_block(case: Case) -> bool:
    bs = case.config.block_size
    heads = [r.prompt_token_ids[:bs] for r in case.workload.requests if len(r.prompt_token_ids) > bs]
    return len(heads) > len(set(heads))


def _draw(n: int, s: int = 0) -> list[Case]:
    out: list[Case] = []

    @seed(s)
    @settings(max_examples=n, phases=[Phase.generate], **_FAST)
    @given(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES))
    def draw(case):
        out.append(case)
    draw()
    return out


def test_strategies_draw_prefix_caching_often_with_sharing_and_salts() -> None:
    drawn = _draw(200)
    on = [c for c in drawn if c.config.enable_prefix_caching]
    # Listed one in two; in Hypothesis' draws it moves with the rest of the draw's structure
    # (measured 0.33-0.4, then 0.69 once aborts were drawn more often): often, never always.
    assert 0.2 <= len(on) / len(drawn) <= 0.75, len(on)
    assert sum(map(_shares_block, on)) >= len(on) / 3
    assert sum(any(r.cache_salt for r in c.workload.requests) for c in on) >= len(on) / 4
    # Salts only where they mean something: a Case with caching off has none.
    assert not any(r.cache_salt for c in drawn if not c.config.enable_prefix_caching for r in c.workload.requests)
    for c in drawn:
        Case.from_json(c.to_json()).validate()


def _find(pred, n: int = 2000, shrink: bool = False) -> Case:
    """The first drawn Case that satisfies `pred` (shrunk, with `shrink`); fails past `n`."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return find(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES), pred,
                settings=settings(max_examples=n, phases=phases, derandomize=True, **_FAST))


def test_strategies_reach_each_prefix_situation() -> None:
    bs = FUZZ_MODEL.block_size
    # Equal tokens under different salts (the isolation the salt exists for).
    _find(lambda c: c.config.enable_prefix_caching and any(
        a.prompt_token_ids == b.prompt_token_ids and len(a.prompt_token_ids) > bs and a.cache_salt != b.cache_salt
        for i, a in enumerate(c.workload.requests) for b in c.workload.requests[:i]))
    # An exact repeat arriving once the first has finished (a hit on free cached blocks).
    _find(lambda c: c.config.enable_prefix_caching and any(
        a.prompt_token_ids == b.prompt_token_ids and len(a.prompt_token_ids) > bs
        and a.arrival_step >= b.arrival_step + len(b.prompt_token_ids) // c.config.max_num_batched_tokens + b.max_tokens
        for i, a in enumerate(c.workload.requests) for b in c.workload.requests[:i]))
    # A branch: a shared system prompt, then different continuations.
    _find(lambda c: c.config.enable_prefix_caching and any(
        a.prompt_token_ids[:2 * bs] == b.prompt_token_ids[:2 * bs] and a.prompt_token_ids != b.prompt_token_ids
        and min(len(a.prompt_token_ids), len(b.prompt_token_ids)) > 2 * bs
        for i, a in enumerate(c.workload.requests) for b in c.workload.requests[:i]))
    # Whole prompts exactly on, one under and one over a block edge, shared.
    for off in (-1, 0, 1):
        _find(lambda c, off=off: c.config.enable_prefix_caching and _shares_block(c) and any(
            len(r.prompt_token_ids) == 2 * bs + off for r in c.workload.requests))
    # The mid-block fault's ground: PP, a budget that ends chunks inside a block, and a shared
    # prefix of two blocks or more among requests that start together.
    _find(lambda c: c.config.enable_prefix_caching and c.config.pp > 1 and c.config.max_num_batched_tokens % bs
          and any(a.prompt_token_ids[:2 * bs] == b.prompt_token_ids[:2 * bs] and len(a.prompt_token_ids) > 2 * bs
                  and len(b.prompt_token_ids) > 2 * bs and a.arrival_step <= b.arrival_step + 1
                  for i, a in enumerate(c.workload.requests) for b in c.workload.requests[:i]))


def test_every_prefix_toggle_shrinks_to_off() -> None:
    simplest = _find(lambda c: True, 50, shrink=True)
    assert not simplest.config.enable_prefix_caching
    assert len(simplest.workload.requests) == 1 and simplest.workload.requests[0].cache_salt is None
    caching = _find(lambda c: c.config.enable_prefix_caching, shrink=True)
    assert len(caching.workload.requests) == 1 and caching.workload.requests[0].cache_salt is None
    assert caching.config.layout == "tp1pp1" and caching.mode == "eager"
    # A salted request: one-token requests on tp1pp1, arriving at once; the salted one alone, or
    # beside its unsalted twin (a shared workload's local minimum, which the shrinker may keep
    # depending on the path it took).
    salted = _find(lambda c: c.config.enable_prefix_caching and any(r.cache_salt for r in c.workload.requests),
                   shrink=True)
    reqs = salted.workload.requests
    assert len(reqs) <= 2 and sum(r.cache_salt is not None for r in reqs) == 1, reqs
    assert all(r.arrival_step == 0 and len(r.prompt_token_ids) == r.max_tokens == 1 for r in reqs), reqs
    assert salted.config.layout == "tp1pp1" and salted.mode == "eager"


# -- the minimizer's candidates ------------------------------------------------------------------

def _sharing_case() -> Case:
    sys_prompt = toks("sys", 9)
    return Case(CACHING.replace(layout="tp1pp2"),
                Workload((RequestSpec(sys_prompt + toks(1, 3), 2, 0, "a"), RequestSpec(sys_prompt + toks(2, 2), 2),
                          RequestSpec(sys_prompt, 2, 6, "b"), RequestSpec(toks(3, 5), 1), RequestSpec(toks(4, 2), 1))))


def test_simpler_drops_caching_salts_and_sharing_before_requests() -> None:
    case = _sharing_case()
    cands = [c for c in candidates(case) if c is not None]
    first_drop = next(i for i, c in enumerate(cands) if len(c.workload.requests) < len(case.workload.requests))
    head = cands[:first_drop]
    assert len(head) == 3
    assert not head[0].config.enable_prefix_caching and head[0].workload == case.workload
    assert head[1].config == case.config and all(r.cache_salt is None for r in head[1].workload.requests)
    assert not _shares_block(head[2]) and head[2].config == case.config
    assert [len(r.prompt_token_ids) for r in head[2].workload.requests] == \
        [len(r.prompt_token_ids) for r in case.workload.requests]
    # Nothing to drop in a plain Case: its candidates are what they were.
    plain = dataclasses.replace(case, config=FUZZ_MODEL.replace(layout="tp1pp2"),
                                workload=Workload(tuple(dataclasses.replace(r, cache_salt=None)
                                                        for r in case.workload.requests)))
    assert len(next(c for c in candidates(plain) if c is not None).workload.requests) == 2  # a half


def test_minimizer_keeps_only_what_a_prefix_failure_needs() -> None:
    """A failure that needs caching and one salted request shrinks to exactly that; zeroing
    prompts never re-shares what unsharing split (which would go round and round)."""
    case = _sharing_case()

    def still_fails(c: Case) -> bool:
        return c.config.enable_prefix_caching and any(r.cache_salt for r in c.workload.requests)

    small, checks, minimal = minimize_to_fixpoint(case, still_fails, max_checks=400)
    assert minimal and checks < 150
    assert small.config.enable_prefix_caching and len(small.workload.requests) == 1
    assert small.workload.requests[0].cache_salt is not None

    def needs_sharing(c: Case) -> bool:
        return c.config.enable_prefix_caching and _shares_block(c)

    small, checks, minimal = minimize_to_fixpoint(case, needs_sharing, max_checks=400)
    assert minimal and len(small.workload.requests) == 2 and _shares_block(small)
    assert all(r.cache_salt is None for r in small.workload.requests)


# -- harness: the twin run, the books, the hit rate ------------------------------------------

@pytest.fixture(scope="module")
def harness():
    h = Harness(4)
    yield h
    h.close()


def _repeat_case(**cfg) -> Case:
    p = toks("rep", 13)
    return Case(CACHING.replace(**cfg), Workload((RequestSpec(p, 2), RequestSpec(p, 2, 5),
                                                  RequestSpec(p[:9] + toks(5, 3), 2, 1, "a"))))


def test_twin_passes_on_a_clean_case_and_reports_hits(harness) -> None:
    case = _repeat_case()
    assert prefix_twin_due(case)
    v = harness.check(case)
    assert v.oracles["prefix_cache_invariance"] is True
    assert v.prefix_hit_tokens > 0 and 0 < v.prefix_hit_rate < 1
    assert v.prefix_queried_tokens >= sum(len(r.prompt_token_ids) for r in case.workload.requests)
    # Caching off: no twin, no counters.
    off = harness.check(dataclasses.replace(case, config=FUZZ_MODEL))
    assert "prefix_cache_invariance" not in off.oracles and off.prefix_hit_rate is None
    # The row a campaign reports.
    target, stats = HarnessTarget(harness), CellStats()
    target.record(stats, v)
    target.record(stats, off)
    prefix = {k: stats.notes[k] for k in ("prefix_caching_cases", "prefix_queried_tokens", "prefix_hit_tokens")}
    assert prefix == {"prefix_caching_cases": 1, "prefix_queried_tokens": v.prefix_queried_tokens,
                      "prefix_hit_tokens": v.prefix_hit_tokens}
    assert stats.notes["cases"] == 2  # both Cases counted in the row's reach (fuzz.cases.limits)
    summary = Summary(cells={("tp1pp1", "eager"): stats})
    row = summary.to_json()["per_cell"]["tp1pp1/eager"]
    assert row["prefix_caching_cases"] == 1 and row["prefix_hit_rate"] == round(v.prefix_hit_rate, 3)


def test_twin_runs_only_where_bitwise_is_promised() -> None:
    assert not prefix_twin_due(_repeat_case(dtype="bfloat16"))
    assert not prefix_twin_due(dataclasses.replace(_repeat_case(), config=FUZZ_MODEL))
    assert prefix_twin_due(_repeat_case(layout="tp2pp2", cudagraph_mode="FULL", capture_sizes=(8,)))


def test_twin_catches_one_ulp_only_in_the_caching_run(harness, monkeypatch) -> None:
    """One ulp on one logit of the caching-on run is within the reference's tolerance: at
    tp > 1, where the reference is not compared bitwise, only the bitwise twin sees it."""
    real_drive = runner.drive

    def drive(engine, case, *a, **k):
        trace = real_drive(engine, case, *a, **k)
        if case.config.enable_prefix_caching:
            rec = trace.tokens["r1"][1]
            rec.logits = rec.logits.clone()
            rec.logits[3] = torch.nextafter(rec.logits[3], rec.logits[3] + 1)
        return trace
    monkeypatch.setattr(runner, "drive", drive)
    with pytest.raises(PrefixCacheViolation) as ei:  # tp2: the reference is not compared bitwise
        harness.check(_repeat_case(layout="tp2pp1"))
    v = ei.value
    assert v.property == "prefix_cache_invariance" and v.oracle == "caching off"
    assert "request r1 position 1" in v.message


def test_a_books_violation_is_an_engine_invariant_failure() -> None:
    """check_accounting runs after every step; what it raises surfaces as engine_invariants."""
    h = Harness(2)
    try:
        with pytest.raises(EngineViolation, match="both free and owned"):
            h.check(dataclasses.replace(_repeat_case(), faults=("cached_block_evicted_while_referenced",)))
        with pytest.raises(EngineViolation, match="cached under a hash"):
            h.check(Case(CACHING, Workload((RequestSpec(toks(1, 5), 2, 0, "a"),)),
                         faults=("prefix_hash_ignores_extra_key",)))
    finally:
        h.close()


def test_mid_block_hit_is_a_logits_failure() -> None:
    a = toks("inflight", 14)
    case = Case(CACHING.replace(layout="tp1pp2", max_num_batched_tokens=6),
                Workload((RequestSpec(a, 3), RequestSpec(a[:10] + toks("B", 3), 3))),
                faults=("prefix_hit_mid_block_counted_full",))
    h = Harness(2)
    try:
        with pytest.raises(LogitsMismatch) as ei:
            h.check(case)
        assert "request r1" in ei.value.message
        h.check(dataclasses.replace(case, faults=()))
    finally:
        h.close()


def test_verdict_hit_counters_cross_the_isolated_worker() -> None:
    from fuzz.verdict.isolated import IsolatedHarness

    h = IsolatedHarness(pool_capacity=2)
    try:
        v = h.check(_repeat_case())
    finally:
        h.close()
    assert v.prefix_hit_tokens > 0 and v.prefix_queried_tokens > 0
    assert json.loads(json.dumps({"r": v.prefix_hit_rate}))["r"] == v.prefix_hit_rate
