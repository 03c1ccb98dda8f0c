"""CUDA graphs with tp > 1 over NCCL: on the torch.distributed world (one process per GPU),
FULL graph replay must give logits bitwise equal to eager for each layout, and both must lie
near the single-GPU tp1pp1 run. Prints JSON.

    python bench/nccl_graph.py --layouts tp2pp1,tp1pp2 --dtype bfloat16 --attention-backend torch_flash
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from engine import EngineConfig, LLMEngine


def run(cfg, reqs, forced=None):
    t_build = time.perf_counter()
    e = LLMEngine(cfg)
    build = time.perf_counter() - t_build
    try:
        e.reset()
        for rid, p, n in reqs:
            e.add_request(rid, p, n, forced[rid] if forced else None)
        t0 = time.perf_counter()
        while e.has_unfinished_requests():
            e.step()
        return e.trace, time.perf_counter() - t0, build
    finally:
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="tp2pp1,tp1pp2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="torch_flash")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: the same check over gloo (a local dry run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    reqs = [(f"r{i}", [rng.randrange(128) for _ in range(rng.randint(1, 30))], 8) for i in range(args.requests)]
    base = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend)
    ref, _, _ = run(base, reqs)
    forced = ref.output_token_ids()  # teacher forcing: every run sees the same tokens
    cuda = args.device.startswith("cuda")
    out = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "torch": torch.__version__,
           "dtype": args.dtype, "attention_backend": args.attention_backend, "world": "torch (NCCL)" if cuda else "torch (gloo)",
           "requests": len(reqs), "results": []}
    ok = True
    for layout in args.layouts.split(","):
        res = {"layout": layout}
        traces = {}
        for mode, extra in (("eager", {}), ("graph", dict(cudagraph_mode="FULL", capture_sizes=(4, 8, 16)))):
            tr, dt, build = run(base.replace(layout=layout, world="torch", **extra), reqs, forced)
            traces[mode] = tr
            err = max(float((a.logits - b.logits).abs().max()) for r in ref.tokens
                      for a, b in zip(ref.tokens[r], tr.tokens[r]))
            res[mode] = {"steps": tr.num_steps, "steps_per_s": round(tr.num_steps / dt, 2),
                         "engine_start_s": round(build, 2), "max_abs_err_vs_tp1pp1_inproc": err}
        pairs = [(a.logits, b.logits) for r in traces["eager"].tokens
                 for a, b in zip(traces["eager"].tokens[r], traces["graph"].tokens[r])]
        res["positions"] = len(pairs)
        res["graph_bitwise_equal_eager"] = all(torch.equal(a, b) for a, b in pairs)
        res["graph_vs_eager_max_abs"] = max(float((a - b).abs().max()) for a, b in pairs)
        ok &= res["graph_bitwise_equal_eager"]
        out["results"].append(res)
    out["all_bitwise_equal"] = ok
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
