"""GPU figures: examples/s per layout and mode, capture time, and the share of a
fuzz example spent checking FlashAttention invariants, on the current CUDA device.

    PYTHONPATH=. python bench/gpu_suite.py --seconds 20 [--backend torch_flash --dtype bfloat16]

Per cell: a seeded campaign of `--seconds` (in-process Harness, same strategies as
`llmfuzz run`), its examples/s, the graph capture seconds summed over the cell's engines,
and the seconds inside `check_fa_records` against the whole check. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fuzz.verdict.harness as harness_mod
from fuzz import profiles
from fuzz.campaign.loop import Campaign
from fuzz.cases.strategies import FUZZ_MODEL

CELLS = (("tp1pp1", "eager"), ("tp1pp1", "graph"), ("tp1pp2", "eager"), ("tp1pp2", "graph"),
         ("tp2pp4", "eager"), ("tp1pp8", "eager"), ("tp1pp8", "graph"))


def _capture_seconds(h) -> float:
    total = 0.0
    for eng in h.pool.engines.values():
        for w in getattr(eng.executor, "workers", []) or []:
            if w is not None:
                total += w.runner.graphs.capture_seconds
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="torch_flash")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    profiles.load("dev")
    fa_time = [0.0]
    orig = harness_mod.check_fa_records

    def timed(case, records):
        t0 = time.perf_counter()
        try:
            return orig(case, records)
        finally:
            fa_time[0] += time.perf_counter() - t0

    harness_mod.check_fa_records = timed
    base = FUZZ_MODEL.replace(device=args.device, attention_backend=args.backend, dtype=args.dtype)
    out = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "backend": args.backend, "dtype": args.dtype, "cells": {}}
    for layout, mode in CELLS:
        h = harness_mod.Harness()
        fa_time[0] = 0.0
        camp = Campaign(layouts=(layout,), modes=(mode,), seed=1, out_dir="/tmp/gpu_suite_repro",
                        budget_s=args.seconds, progress=False, base=base, harness=h)
        s = camp.run()
        check_s = sum(c.seconds for c in s.cells.values())
        out["cells"][f"{layout}/{mode}"] = {
            "examples": s.examples, "failures": len(s.failures),
            "examples_per_s": round(s.examples / check_s, 2) if check_s else None,
            "capture_seconds": round(_capture_seconds(h), 3),
            "fa_check_seconds": round(fa_time[0], 3),
            "fa_check_share": round(fa_time[0] / check_s, 4) if check_s else None,
            "engine_seconds": round(h.engine_seconds, 2), "check_seconds": round(check_s, 2)}
        print(json.dumps({f"{layout}/{mode}": out["cells"][f"{layout}/{mode}"]}), flush=True)
        h.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
