"""Drafts checked: vLLM's n-gram proposals against the ones the token history implies.

Under greedy verification a broken drafter is invisible in the output tokens: a wrong draft
is only rejected, so the output stays right and only speed suffers. So the worker records
what the proposer drafted, per request and step (site/sitecustomize.py wraps the v1
model runner's `propose_draft_token_ids`: the request, n = the tokens it had, k and the
draft), and this module recomputes each draft from the request's final tokens (prompt +
output: the first n of them are exactly what the proposer saw) with the n-gram rule vLLM
documents (`vllm/v1/spec_decode/ngram_proposer.py`): the longest suffix of the context of
length in [prompt_lookup_min, prompt_lookup_max] that also occurs earlier; among equally
long matches the earliest; the draft is up to k tokens that followed it, never past the
context's end nor max_model_len. A difference is the property `vllm_draft`.

Acceptance: a draft token is accepted when it equals the greedy token at its position
(the output), up to the first that does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's documented rule, kept with the stored prompts searched under it (fuzz.cases.drafting).
from fuzz.cases.drafting import expected_draft


@dataclass
class DraftStats:
    """Per cell: the drafts that differ from the rule (a few kept for the message; the first
    one's `mismatch_kind` is the bug's signature), steps with a draft asked for, tokens
    drafted, tokens accepted, and the acceptance distribution: Cases with a proposal by the
    most drafts one step of theirs accepted (`best`: {accepted: Cases}). Multi-token accept,
    the bonus token and rollback run only in Cases accepting 2 or more in a step."""

    examples: list = field(default_factory=list)
    first_kind: str = ""
    mismatches: int = 0
    proposals: int = 0
    drafted: int = 0
    accepted: int = 0
    best: dict = field(default_factory=dict)

    def add(self, other: "DraftStats") -> None:
        self.proposals += other.proposals
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.mismatches += other.mismatches
        for a, n in other.best.items():
            self.best[a] = self.best.get(a, 0) + n

    def to_json(self) -> dict:
        return {"proposals": self.proposals, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "cases": sum(self.best.values()),
                "cases_accepting_2plus": sum(n for a, n in self.best.items() if a >= 2),
                "most_accepted_in_a_step": {str(a): self.best[a] for a in sorted(self.best)},
                "draft_mismatches": self.mismatches}


def mismatch_kind(draft: list, want: list) -> str:
    """How a draft differs from the rule's, as a signature: one drafter bug gives one kind
    whatever the config, so it is written once, not once per cell."""
    if not want:
        return "drafted-without-match" if draft else "none"
    if not draft:
        return "no-draft-for-match"
    n = min(len(draft), len(want))
    if draft[:n] == want[:n]:
        return "too-long" if len(draft) > len(want) else "too-short"
    return "wrong-tokens-at-start" if draft[0] != want[0] else "wrong-tokens-later"


def check_drafts(drafts: dict, full_tokens: dict, k_max: int, min_n: int, max_n: int,
                 max_model_len: int) -> DraftStats:
    """drafts: {rid: [[n, k, draft], ...]} (the worker's); full_tokens: {rid: prompt + output}.
    Counts acceptance (`best`: this Case's most drafts accepted in one step) and records every
    draft that differs from `expected_draft`."""
    st, best = DraftStats(), 0
    for rid, recs in drafts.items():
        toks = full_tokens.get(rid)
        if toks is None:
            continue
        for n, k, draft in recs:
            if n > len(toks):
                continue  # drafted past what the request kept (cannot happen unless tokens were lost)
            want = expected_draft(toks, n, min(k, k_max), min_n, max_n, max_model_len)
            st.proposals += 1
            st.drafted += len(draft)
            acc = 0
            for i, t in enumerate(draft):
                if n + i < len(toks) and toks[n + i] == t:
                    acc += 1
                else:
                    break
            st.accepted += acc
            best = max(best, acc)
            if list(draft) != want:
                st.mismatches += 1
                st.first_kind = st.first_kind or mismatch_kind(list(draft), want)
                if len(st.examples) < 3:
                    st.examples.append(f"{rid} at {n} tokens (…{list(toks[max(0, n - 6):n])}): vLLM drafted "
                                       f"{list(draft)}, the n-gram rule gives {want}")
    if st.proposals:
        st.best = {best: 1}
    return st
