"""Speculative decoding acceptance per proposer, as JSON.

    python bench/spec_acceptance.py [--k 3] [--layout tp1pp1] [--requests 8]

Two seeded workloads on the default model (4 layers, vocab 128), greedy, tp1pp1 eager:
`repetitive` (prompts over a 3-token alphabet: n-grams repeat) and `random` (prompts over
the whole vocab). Prompt lengths 8..24, 32 output tokens each. For each proposer (ngram,
eagle) and workload it prints: acceptance_rate = accepted drafts / proposed drafts,
tokens_per_verify = tokens appended per (request, step) that sampled (1 = no gain, 1 + k =
every draft accepted), steps (driver steps) next to plain decoding's steps, and whether the
output tokens equal plain decoding's (they must). The EAGLE head has seeded, near-identity
weights (engine/eagle.py): its rate says how the plumbing behaves, not what a trained head
would reach.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import EngineConfig, LLMEngine  # noqa: E402

WORKLOADS = {"repetitive": 3, "random": 128}  # prompt alphabet size


def workload(alphabet: int, n: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(0)
    return [(f"r{i}", [rng.randrange(alphabet) for _ in range(rng.randint(8, 24))], 32) for i in range(n)]


def run(cfg: EngineConfig, reqs) -> dict:
    e = LLMEngine(cfg)
    try:
        e.reset()
        t0 = time.perf_counter()
        for r in reqs:
            e.add_request(*r)
        while e.has_unfinished_requests():
            e.step()
        t = e.trace
        generated = sum(len(v) for v in t.tokens.values())
        return {"proposed": t.num_draft_tokens, "accepted": t.num_accepted_tokens,
                "acceptance_rate": round(t.num_accepted_tokens / max(t.num_draft_tokens, 1), 4),
                "tokens_per_verify": round(generated / max(generated - t.num_accepted_tokens, 1), 3),
                "steps": t.num_steps, "seconds": round(time.perf_counter() - t0, 2),
                "tokens": t.output_token_ids()}
    finally:
        e.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--layout", default="tp1pp1")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    base = EngineConfig(max_num_batched_tokens=32, max_model_len=96, num_gpu_blocks=256)
    out = []
    for name, alphabet in WORKLOADS.items():
        reqs = workload(alphabet, args.requests)
        plain = run(base, reqs)
        for method in ("ngram", "eagle"):
            res = run(base.replace(layout=args.layout, speculative_method=method,
                                   num_speculative_tokens=args.k), reqs)
            same = res.pop("tokens") == plain["tokens"]
            out.append({"workload": name, "method": method, "k": args.k, "layout": args.layout, **res,
                        "plain_steps": plain["steps"], "equals_plain": same})
    print(json.dumps(out, indent=1))
    return 0 if all(r["equals_plain"] for r in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
