"""Reference-engine throughput on a fixed mixed workload, as JSON.

    python bench/engine_throughput.py [--json] [--layouts tp1pp1,pp8,tp2pp4] [--runs 3]

Workload: 16 requests, prompt lengths 1..60, max_tokens 8..16 (seeded), chunked prefill on
(a 32-token budget, below the longest prompt), on CPU, default model dims. Each layout gets
one engine, one warm-up run, then `--runs` timed runs (reset between them); the median run
is reported. With --layouts every layout uses 8 layers (pp8 needs 8) and head counts that
every listed tp divides, so the layouts run the same model. Output: one JSON object per
layout (a list when several layouts are measured): steps_per_s, tokens_per_s (generated
tokens), prompt_tokens_per_s, num_steps, layout, plus the run times and the config.
`--json` prints compact JSON only; without it the JSON is indented.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import EngineConfig, LLMEngine, parse_layout  # noqa: E402

NUM_REQUESTS = 16
PROMPT_LENS = (1, 60)
MAX_TOKENS = (8, 16)


def workload(seed: int, vocab: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_LENS))],
             rng.randint(*MAX_TOKENS)) for i in range(NUM_REQUESTS)]


def base_config(layouts: list[str] | None) -> EngineConfig:
    """Default model dims; a cache that holds the whole workload (no preemption noise)."""
    cfg = EngineConfig(max_num_batched_tokens=32, num_gpu_blocks=320, max_num_seqs=16)
    if layouts is None:
        return cfg
    tps = [parse_layout(name)[0] for name in layouts]
    heads = math.lcm(cfg.num_attention_heads, *tps)
    # kv heads: the largest divisor of `heads` (at most the default) that each tp divides or
    # is divided by, so every layout splits or replicates them.
    kv = max(k for k in range(1, cfg.num_key_value_heads + 1) if heads % k == 0
             and all((tp <= k and k % tp == 0) or (tp > k and tp % k == 0) for tp in tps))
    return cfg.replace(num_hidden_layers=8, num_attention_heads=heads, num_key_value_heads=kv,
                       vocab_size=math.lcm(cfg.vocab_size, *tps),
                       intermediate_size=math.lcm(cfg.intermediate_size, *tps))


def run_once(e: LLMEngine, reqs) -> tuple[float, int, int]:
    e.reset()
    for rid, prompt, max_tokens in reqs:
        e.add_request(rid, prompt, max_tokens)
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        e.step()
    dt = time.perf_counter() - t0
    generated = sum(len(recs) for recs in e.trace.tokens.values())
    assert generated == sum(m for _, _, m in reqs), "workload did not finish"
    return dt, e.trace.num_steps, e.trace.num_preemptions


def measure(cfg: EngineConfig, runs: int, seed: int) -> dict:
    reqs = workload(seed, cfg.vocab_size)
    e = LLMEngine(cfg)
    try:
        run_once(e, reqs)  # warm-up
        results = [run_once(e, reqs) for _ in range(runs)]
    finally:
        e.shutdown()
    times = [r[0] for r in results]
    med = statistics.median(times)
    num_steps = results[0][1]
    generated = sum(m for _, _, m in reqs)
    prompt = sum(len(p) for _, p, _ in reqs)
    return {
        "layout": cfg.layout,
        "steps_per_s": round(num_steps / med, 2),
        "tokens_per_s": round(generated / med, 2),
        "prompt_tokens_per_s": round(prompt / med, 2),
        "num_steps": num_steps,
        "generated_tokens": generated,
        "prompt_tokens": prompt,
        "num_preemptions": results[0][2],
        "median_s": round(med, 4),
        "run_s": [round(t, 4) for t in times],
        "config": {k: getattr(cfg, k) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "block_size", "num_gpu_blocks",
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "dtype", "device")},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="compact JSON only")
    ap.add_argument("--layouts", default=None, help="comma-separated layouts, e.g. tp1pp1,pp8,tp2pp4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()] if args.layouts else None
    base = base_config(layouts)
    if layouts is None:
        out: dict | list = measure(base, args.runs, args.seed)
    else:
        out = [measure(base.replace(layout=name), args.runs, args.seed) for name in layouts]
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
