"""Calibrate the bf16/fp16 logits tolerance on a GPU: over fuzz Cases of each layout and
mode, how large is max |logits - reference| relative to `fuzz.verdict.tolerance.logits_tolerance`?

    PYTHONPATH=. python bench/gpu_tolerance.py --examples 12 [--backend torch_flash]

The reference is tp1pp1 eager in the same dtype and backend, so the ratio measures what
layouts and graph replay change (reduction order across TP ranks, padded shapes), which
the tolerance must absorb on a correct engine. Prints JSON: per dtype and cell, the number
of Cases, the largest and median error/tolerance ratio and the largest absolute error.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from hypothesis import HealthCheck, given, settings

from fuzz.verdict.harness import Harness
from fuzz.cases.strategies import FUZZ_MODEL, cases

CELLS = (("tp1pp1", "graph"), ("tp2pp1", "eager"), ("tp1pp2", "eager"), ("tp1pp2", "graph"),
         ("tp2pp4", "eager"), ("tp1pp8", "graph"), ("tp4pp2", "eager"))


def measure(base, layout: str, mode: str, n: int, harness: Harness) -> dict:
    ratios, errors = [], []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases((layout,), (mode,), base=base))
    def run(case):
        v = harness.check(case)
        ratios.append(v.logits.ratio)
        errors.append(v.logits.max_error)

    run()
    return {"cases": len(ratios), "max_ratio": round(max(ratios), 4), "median_ratio": round(statistics.median(ratios), 4),
            "max_abs_error": max(errors)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=12)
    ap.add_argument("--backend", default="torch_flash")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "backend": args.backend, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        base = FUZZ_MODEL.replace(device="cuda", attention_backend=args.backend, dtype=dtype)
        h = Harness()
        try:
            out["dtypes"][dtype] = {f"{lay}/{mode}": measure(base, lay, mode, args.examples, h) for lay, mode in CELLS}
        finally:
            h.close()
        print(json.dumps({dtype: out["dtypes"][dtype]}), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
