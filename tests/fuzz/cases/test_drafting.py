"""fuzz/cases/drafting.py: the stored self-drafting prompts still continue, under the model, as
stored (so their n-gram drafts are what greedy decoding produces), a drawn request of them
drafts and accepts at its first decode, the strategies draw them in n-gram Cases only, and the
class shrinks off when a failure does not need it, to the first prompt at its shortest when it does."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, find, given, seed, settings

from engine.spec_decode import NgramProposer
from fuzz.cases import drafting
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import FUZZ_MODEL, cases, tokens_from_seed
from fuzz.verdict.harness import Harness

NGRAM = FUZZ_MODEL.replace(speculative_method="ngram", num_speculative_tokens=4)
_FAST = dict(database=None, deadline=None, suppress_health_check=list(HealthCheck))


def _model(tab: drafting.Table):
    from fuzz.targets.vllm.configs import VLLM_MODEL

    return {"fuzz": FUZZ_MODEL, "vllm": VLLM_MODEL}[tab.name]


@pytest.mark.parametrize("tab,dtype", [(t, d) for t in drafting.TABLES for d in t.dtypes[:2]],
                         ids=lambda v: getattr(v, "name", v))
def test_stored_prompts_continue_as_stored(tab: drafting.Table, dtype: str) -> None:
    """Greedy decoding of each entry from its shortest cut, on the table's model, gives the
    stored tokens, so at every stored cut the first decode's drafts (under the table's rule) are
    accepted (recomputed from the tokens alone). If the model or its weights change, regenerate
    the table: `python bench/drafting_prompts.py fuzz|vllm 192`."""
    model = _model(tab)
    assert drafting.model_table(model) is tab
    starts = [cuts[0] for _, cuts in tab.prompts]
    longest = max(len(t) - c for (t, _), c in zip(tab.prompts, starts))
    got = drafting.greedy(model.replace(dtype=dtype), [list(t[:c]) for (t, _), c in zip(tab.prompts, starts)], longest)
    for (tokens, cuts), c, out in zip(tab.prompts, starts, got):
        assert tuple(out[:len(tokens) - c]) == tokens[c:], (tokens, c)
        for cut in cuts:
            assert drafting.accepted_at_first_decode(tokens, cut, rule=tab.rule) >= drafting.MIN_ACCEPTED, (tokens, cut)


def test_the_vllm_model_gets_its_own_table() -> None:
    """n-gram Cases on the vLLM target's model get that model's prompts (vLLM's earliest-match
    rule), not the fuzz model's."""
    from fuzz.targets.vllm.configs import VLLM_MODEL

    cfg = VLLM_MODEL.replace(speculative_method="ngram", num_speculative_tokens=3)
    wl = drafting.add_requests(Workload((RequestSpec((1, 2), 2),)), cfg, 2, 0, 8)
    assert [r.prompt_token_ids for r in wl.requests[1:]] == [drafting.prompt(i, drafting.VLLM) for i in (0, 1)]
    assert all(drafting.self_drafting(cfg, r) for r in wl.requests[1:])
    assert not drafting.self_drafting(NGRAM, wl.requests[1])  # a vLLM-model prompt does not draft on the fuzz model


def test_a_repeated_segment_alone_does_not_draft() -> None:
    """Why the prompts are the model's continuation: a prompt of a repeated segment matches
    its own n-grams, but the first sampled token breaks the period, so nothing is proposed."""
    seg = list(tokens_from_seed(7, 3, FUZZ_MODEL.vocab_size))
    (first,) = drafting.greedy(FUZZ_MODEL, [seg * 4], 1)
    assert NgramProposer(4).propose(seg * 4 + first) == []


def _first_decode(trace, rid: str) -> tuple[list[int], int]:
    """`rid`'s first n-gram proposal and the tokens it appended at the decode after it."""
    proposal = next(d for r, _, d in trace.ngram_drafts if r == rid)
    per_step = Counter(t.microbatch for t in trace.tokens[rid])
    second = sorted(per_step)[1]  # the first microbatch sampled the prefill's token
    return proposal, per_step[second]


def test_added_requests_draft_and_accept_at_their_first_decode() -> None:
    plain = RequestSpec(tokens_from_seed(3, 6, FUZZ_MODEL.vocab_size), 8)
    wl = drafting.add_requests(Workload((plain,)), NGRAM, 2, 0, max_requests=10)
    assert [r.prompt_token_ids for r in wl.requests[1:]] == [drafting.prompt(0), drafting.prompt(1)]
    assert all(r.arrival_step == 1 and drafting.self_drafting(NGRAM, r) for r in wl.requests[1:])
    case = Case(NGRAM, wl)
    h = Harness()
    try:
        h.check(case)  # the drafts change nothing the oracles see
        trace = h.run_case(case)
    finally:
        h.close()
    for rid in ("r1", "r2"):
        proposal, appended = _first_decode(trace, rid)
        assert len(proposal) >= drafting.MIN_ACCEPTED and appended >= 1 + drafting.MIN_ACCEPTED, (rid, proposal)


def test_drawn_self_drafting_request_drafts_and_accepts() -> None:
    """A drawn Case of the class (tp1pp1, a budget that cuts nothing, in step): its request's first
    decode proposes drafts and accepts MIN_ACCEPTED of them or more."""
    drawn = find(cases(("tp1pp1",)), lambda c: any(drafting.self_drafting(c.config, r) for r in c.workload.requests),
                 settings=settings(max_examples=500, phases=[Phase.generate], derandomize=True, **_FAST))
    # The budget and overlap set after the draw: a narrower condition made the find depend on
    # what the other strategies draw first.
    case = replace(drawn, config=drawn.config.replace(max_num_batched_tokens=64, async_scheduling=False))
    h = Harness()
    try:
        trace = h.run_case(case)
    finally:
        h.close()
    rids = [f"r{i}" for i, r in enumerate(case.workload.requests) if drafting.self_drafting(case.config, r)]
    for rid in rids:
        proposal, appended = _first_decode(trace, rid)
        assert len(proposal) >= drafting.MIN_ACCEPTED and appended >= 1 + drafting.MIN_ACCEPTED, (case.describe(), rid)


def test_added_only_with_ngram_on_the_searched_model_and_within_max_requests() -> None:
    wl = Workload((RequestSpec((1, 2), 2, arrival_step=3),))
    for cfg in (FUZZ_MODEL, FUZZ_MODEL.replace(speculative_method="eagle", num_speculative_tokens=2),
                NGRAM.replace(seed=1), NGRAM.replace(vocab_size=256)):
        assert drafting.add_requests(wl, cfg, 2, 0, 10) == wl
    assert drafting.add_requests(wl, NGRAM, 0, 0, 10) == wl
    assert len(drafting.add_requests(wl, NGRAM, 2, 0, 2).requests) == 2  # max_requests holds
    (added,) = drafting.add_requests(wl, NGRAM, 1, 5, 10).requests[1:]
    assert added.arrival_step == 4 and added.prompt_token_ids == drafting.prompt(5)
    assert added.max_tokens == drafting.MAX_TOKENS and len(added.prompt_token_ids) + added.max_tokens <= NGRAM.max_model_len


def test_drawn_in_ngram_cases_only() -> None:
    """The share of drawn Cases of the class: about a third of the n-gram Cases (the requests join
    two in three where max_requests leaves room; with k = 1 a decode drafts one token; measured
    24-35 %: Hypothesis mixes in constants of the modules loaded, so it varies with the run),
    no other."""
    n = Counter()

    @seed(0)
    @settings(max_examples=200, phases=[Phase.generate], **_FAST)
    @given(cases(("tp1pp1", "tp1pp2")))
    def count(case) -> None:
        drafted = any(drafting.self_drafting(case.config, r) for r in case.workload.requests)
        n[case.config.speculative_method, drafted] += 1

    count()
    assert n["none", True] == n["eagle", True] == 0
    assert n["ngram", True] >= 0.15 * (n["ngram", True] + n["ngram", False]), n


def test_the_class_shrinks_off_and_to_the_first_prompt() -> None:
    off = find(cases(("tp1pp1",)), lambda c: c.config.speculative_method == "ngram",
               settings=settings(max_examples=200, derandomize=True, **_FAST))
    assert not any(drafting.self_drafting(off.config, r) for r in off.workload.requests), off.describe()
    assert len(off.workload.requests) == 1, off.describe()
    on = find(cases(("tp1pp1",)), lambda c: any(drafting.self_drafting(c.config, r) for r in c.workload.requests),
              settings=settings(max_examples=500, derandomize=True, **_FAST))
    drafted = [r for r in on.workload.requests if drafting.self_drafting(on.config, r)]
    assert [r.prompt_token_ids for r in drafted] == [drafting.prompt(0)], on.describe()
    assert len(on.workload.requests) == 2 and on.config.speculative_method == "ngram", on.describe()
