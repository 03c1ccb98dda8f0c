"""The n-gram drafts of a run, checked against the rule the engine documents
(engine/spec_decode.py), written here again from that text and sharing no code with it.

Under greedy verification a wrong draft is only rejected: the output tokens stay right and only
acceptance suffers, so no logits or token comparison sees a broken drafter, nor one that
drafts past the room a request has left. The engine records each proposal (Trace.ngram_drafts:
the request, how many of its tokens the proposer looked at, the draft); the request's final
tokens (prompt and output, teacher-forced) hold that context as their first tokens.

The rule: for n from min(MAX_N, L - 1) down to MIN_N (L the context's length), the context's
last n tokens looked up earlier in it, the most recent occurrence first; the draft is the up
to k tokens that followed it. k is the room the request has: the configured number of
speculative tokens, at most the tokens it may still sample after the next one
(max_tokens - outputs - 1) and the positions left before max_model_len.
"""
from __future__ import annotations

MIN_N, MAX_N = 1, 3  # the engine's NgramProposer defaults


def ngram_rule(context: list[int], k: int) -> list[int]:
    """The draft for `context` with room for `k` tokens."""
    L = len(context)
    if k <= 0:
        return []
    for n in range(min(MAX_N, L - 1), MIN_N - 1, -1):
        tail = context[L - n:]
        for start in reversed(range(L - n)):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def check_drafts(trace, prompts: dict[str, list[int]], max_tokens: dict[str, int], k: int,
                 max_model_len: int) -> str | None:
    """The first recorded draft that is not the rule's, as one line; None when all are."""
    finals = {rid: prompts[rid] + [t.token for t in trace.tokens.get(rid, [])] for rid in prompts}
    for i, (rid, n, draft) in enumerate(trace.ngram_drafts):
        tokens, plen = finals[rid], len(prompts[rid])
        if not plen <= n <= len(tokens):
            return (f"request {rid}: drafted after {n} tokens, but it has a {plen}-token prompt and "
                    f"{len(tokens) - plen} outputs")
        room = min(k, max_tokens[rid] - (n - plen) - 1, max_model_len - n)
        want = ngram_rule(tokens[:n], room)
        if draft != want:
            return (f"request {rid}, proposal {i}: after {n} tokens (room {room}) it drafted {draft}, "
                    f"the n-gram rule gives {want}")
    return None
