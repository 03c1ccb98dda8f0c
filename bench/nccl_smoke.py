"""Same workload on the torch.distributed world with NCCL (one process per GPU) and on the
in-process world on one GPU: the logits must agree. Prints JSON.

    python bench/nccl_smoke.py --layouts tp2pp1,tp1pp2
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from bench.nccl_graph import run
from engine import EngineConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="tp2pp1,tp1pp2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    reqs = [(f"r{i}", [rng.randrange(128) for _ in range(rng.randint(1, 30))], 8) for i in range(8)]
    base = EngineConfig(num_hidden_layers=4, max_num_batched_tokens=16, device="cuda")
    ref, _, _ = run(base, reqs)
    forced = ref.output_token_ids()
    out = {"gpus": torch.cuda.device_count(), "results": []}
    for layout in args.layouts.split(","):
        res = {"layout": layout}
        for world in ("inproc", "torch"):
            tr, dt, _ = run(base.replace(layout=layout, world=world), reqs, forced)
            err = max(float((a.logits - b.logits).abs().max()) for r in ref.tokens
                      for a, b in zip(ref.tokens[r], tr.tokens[r]))
            res[world] = {"steps_per_s": round(tr.num_steps / dt, 2), "max_abs_err_vs_tp1pp1": err}
        out["results"].append(res)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
