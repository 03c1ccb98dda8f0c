"""Graph vs eager on the current device: steps/s, capture count and capture time (JSON).

    python bench/graph_mode.py [--device cuda] [--layouts tp1pp1,tp1pp2]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine import EngineConfig, LLMEngine


def workload(seed: int = 0):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(128) for _ in range(rng.randint(1, 40))], rng.randint(8, 16))
            for i in range(16)]


def run_once(eng: LLMEngine) -> tuple[float, int]:
    eng.reset()
    for rid, prompt, n in workload():
        eng.add_request(rid, prompt, n)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0, eng.trace.num_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layouts", default="tp1pp1,tp1pp2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = EngineConfig(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                        max_num_batched_tokens=32, max_model_len=64, device=args.device)
    results = []
    for layout in args.layouts.split(","):
        for mode in ("NONE", "FULL"):
            cfg = base.replace(layout=layout, cudagraph_mode=mode,
                               capture_sizes=(4, 8, 16, 32) if mode == "FULL" else ())
            eng = LLMEngine(cfg)
            t_first, steps = run_once(eng)  # includes graph captures
            times = [run_once(eng)[0] for _ in range(args.repeats)]
            workers = getattr(eng.executor, "workers", [])
            graphs = sum(w.runner.graphs.num_graphs for w in workers if w is not None)
            capture_s = sum(w.runner.graphs.capture_seconds for w in workers if w is not None)
            eng.shutdown()
            med = statistics.median(times)
            results.append({"layout": cfg.layout, "mode": "graph" if mode == "FULL" else "eager",
                            "device": args.device, "steps": steps, "steps_per_s": round(steps / med, 2),
                            "first_run_s": round(t_first, 3), "graphs_captured": graphs,
                            "capture_s": round(capture_s, 3)})
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
