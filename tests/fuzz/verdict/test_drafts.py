"""N-gram drafts checked against the rule (fuzz/verdict/oracles/drafts.py): a wrong draft is
only rejected by verification, so the outputs stay right and only the `drafts` property can
see a broken drafter."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine.schedule import Schedule
from engine.spec_decode import NgramProposer
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.verdict.oracles.drafts import ngram_rule
from fuzz.verdict.properties import DraftViolation

CASE = Case(FUZZ_MODEL.replace(speculative_method="ngram", num_speculative_tokens=2),
            Workload((RequestSpec((1, 2, 3, 1, 2, 3, 1, 2), 6), RequestSpec((5, 6, 7, 7), 5, arrival_step=1))),
            Schedule())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=14), st.integers(0, 4))
def test_the_rule_and_the_engines_proposer_agree(context, k) -> None:
    """Two implementations of one documented rule, sharing no code."""
    assert ngram_rule(context, k) == NgramProposer(4).propose(context, max_k=k)


def test_a_clean_run_passes_the_draft_check(harness) -> None:
    assert harness.check(CASE).oracles["drafts"] is True


def test_a_drafter_that_skips_the_latest_match_is_seen_only_by_drafts(harness, monkeypatch) -> None:
    """The most recent earlier occurrence skipped (an off-by-one in the scan's start): every
    draft is still a plausible continuation, verification rejects what does not match, and
    tokens and logits equal the reference's; the draft check names the first wrong proposal."""
    def skip_latest(self, tokens, max_k=None):
        k, L = min(self.k, self.k if max_k is None else max_k), len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            for start in range(L - n - 2, -1, -1):
                if k > 0 and tokens[start:start + n] == tokens[L - n:]:
                    return tokens[start + n:start + n + k]
        return []

    monkeypatch.setattr(NgramProposer, "propose", skip_latest)
    with pytest.raises(DraftViolation) as e:
        harness.check(CASE)
    assert e.value.property == "drafts" and e.value.oracle == "ngram rule"
    assert "the n-gram rule gives" in e.value.message
