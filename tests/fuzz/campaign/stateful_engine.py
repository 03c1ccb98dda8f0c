"""An adapter with a planted bug that needs an earlier Case's state, for the fresh-replay tests.

`StaleRowTarget` runs our reference engine behind a persistent batch, as a long-lived engine
does: one row per request of a call, rows kept from call to call and never cleared. Planted
(the default), a call with fewer rows than the batch holds, and more than one, reads the first
token of its last request from the row past it: what an earlier call's request left there. On
a fresh engine no Case fails (a Case's own calls never shrink the batch below a multi-row
call: its batch run comes first, its solo runs have one row); after a Case with more requests,
a Case with two or more fails.

Importable by name in a new process (the fresh replay imports it as `stateful_engine`, from
this directory on sys.path); run as a script it replays a reproducer on a new instance,
with `llmfuzz replay`'s exit codes:

    python stateful_engine.py FILE
"""
from __future__ import annotations

import sys

import torch

import llmfuzz
from engine.llm_engine import LLMEngine


class StaleRowTarget(llmfuzz.Target):
    name = "stalerow"

    def __init__(self, planted: bool = True) -> None:
        self.planted = planted
        self.engines: dict = {}
        self.rows: list[int] = []  # the persistent batch: per row, the first token its last request generated

    def fresh_init(self) -> dict:
        return {"planted": self.planted}

    def engine(self, config) -> LLMEngine:
        if repr(config) not in self.engines:
            self.engines[repr(config)] = LLMEngine(config)
        return self.engines[repr(config)]

    def generate(self, config, requests):
        eng = self.engine(config)
        eng.reset(scheduler_config=config)
        pending = sorted(requests, key=lambda r: r.arrival_step)
        step = 0
        while pending or eng.has_unfinished_requests():
            while pending and pending[0].arrival_step <= step:
                r = pending.pop(0)
                eng.add_request(r.request_id, list(r.prompt_token_ids), r.max_tokens,
                                cache_salt=r.cache_salt, sampling_params=r.sampling)
            if eng.has_unfinished_requests():
                eng.step()
            step += 1
        out = [self.completion(eng.trace.tokens[r.request_id], r.logprobs) for r in requests]
        n = len(out)
        if self.planted and 1 < n < len(self.rows) and out[-1].token_ids:
            stale = self.rows[n]  # the bug: the last row's read runs one row too far, into a stale one
            last = out[-1]
            out[-1] = llmfuzz.Completion([stale, *last.token_ids[1:]], last.logprobs)
        for i, c in enumerate(out):  # this call's rows; the rows past them keep what they held
            first = c.token_ids[0] if c.token_ids else -1
            if i < len(self.rows):
                self.rows[i] = first
            else:
                self.rows.append(first)
        return out

    @staticmethod
    def completion(records, k):
        tokens, logprobs = [], []
        for rec in records:
            lp = torch.log_softmax(rec.logits.double(), -1)
            top = lp.topk(k)
            position = dict(zip(top.indices.tolist(), top.values.tolist()))
            position[rec.token] = float(lp[rec.token])
            tokens.append(rec.token)
            logprobs.append(position)
        return llmfuzz.Completion(tokens, logprobs)


def main(argv: list[str]) -> int:
    """Replay reproducer argv[0] on a new StaleRowTarget: 1 fails as recorded, 0 passes, 4 differs."""
    from fuzz.targets.blackbox import BlackBoxChecker

    # The campaign's checker (no transformers oracle), on a new instance: a fresh engine.
    r = llmfuzz.replay(argv[0], target=BlackBoxChecker(StaleRowTarget(), "stalerow", transformers=False))
    print(r.report)
    return {"passes": 0, "reproduces": 1, "differs": 4}[r.verdict]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
