"""Speculative decoding: n-gram drafting and greedy verification
(docs/bug_classes.md#spec_rollback_missing).

`NgramProposer` looks up the request's last n tokens (longest n first, between min_n and
max_n) earlier in its own tokens and proposes the k tokens that followed. The scheduler
then schedules 1 + k tokens for that request; the last rank returns one logits row per
scheduled position; `verify_greedy` accepts the longest prefix of drafts that matches the
target tokens plus one bonus token. Rejected drafts are rolled back in
`num_computed_tokens` by the scheduler (their KV slots lie past the new sequence length and
are overwritten later, never read).

`EagleProposer` (engine/eagle.py) is the other proposer: a draft head on the last PP rank,
fed with the target's hidden states; verification and rollback are the same for both.
"""
from __future__ import annotations


class NgramProposer:
    """Prompt-lookup drafting over a request's own tokens."""

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: list[int], max_k: int | None = None) -> list[int]:
        k = self.k if max_k is None else min(self.k, max_k)
        if k <= 0:
            return []
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = tokens[L - n:]
            # The most recent earlier occurrence wins (it reflects the latest context).
            for start in range(L - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []


def verify_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Tokens to append: the drafts that match their targets, then one bonus target.
    `targets[i]` is the token the model (or teacher forcing) puts at draft position i."""
    assert len(targets) == len(drafts) + 1, (drafts, targets)
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return targets[:a + 1]
