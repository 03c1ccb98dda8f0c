"""Calibrate the half-precision logits rule |test - oracle32| <= k * noise + atol on clean runs.

For each (layout, mode) cell, Cases drawn by the campaign's strategy (no faults) run through
the harness's own pieces: the float32 reference, the run under test in --dtype, and the solo
oracle in float32 and in --dtype (the noise baseline: the largest |solo_dtype - solo32| of
each request). Every generated position gives one sample per oracle. The script prints JSON:
sample counts, the largest error/noise seen, the k and atol it suggests (the smallest atol
that covers every clean sample at the chosen k, times a safety factor), and the largest
ratio clean runs reach under the rule in fuzz/verdict/tolerance.py.

    python bench/calibrate_tolerance.py --dtype bfloat16 --examples 12 --jobs 2 > out.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import zlib

from hypothesis import HealthCheck, given, seed, settings


def _cell(args) -> list[dict]:
    layout, mode, dtype, n, device, backend, s = args
    s = s * 1000 + zlib.crc32(f"{layout}/{mode}".encode()) % 1000  # other Cases in every cell
    from fuzz.verdict.harness import Harness
    from fuzz.cases.strategies import FUZZ_MODEL, cases

    h = Harness(4)
    base = FUZZ_MODEL.replace(dtype=dtype, device=device, attention_backend=backend)
    rows: list[dict] = []

    @seed(s)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases((layout,), (mode,), (), base, 8))
    def body(case):
        ref = h.reference(case)
        test = h.run_case(case)  # teacher-forced with the reference's tokens
        traces, tol = h.oracle_traces(case, ref.output_token_ids(), transformers=True)
        for name, o in {"reference": ref, **traces}.items():
            for rid, recs in o.tokens.items():
                for r, t in zip(recs, test.tokens[rid]):
                    err = float((t.logits - r.logits).abs().max())
                    rows.append({"cell": f"{layout}/{mode}", "oracle": name, "noise": tol.noise.get(rid, 0.0),
                                 "err": err, "ratio": err / tol.bound(rid, r.logits),
                                 "bound": tol.bound(rid, r.logits),
                                 "greedy_flip": t.sampled != r.sampled,
                                 "margin": float(r.logits.topk(2).values.diff().abs()[0])})

    body()
    h.close()
    return rows


def suggest(rows: list[dict], k: float, safety: float) -> float:
    """The atol that covers every clean sample at k, times the safety factor."""
    return safety * max(max(r["err"] - k * r["noise"], 0.0) for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--examples", type=int, default=12, help="Cases per (layout, mode) cell")
    ap.add_argument("--layouts", default="tp1pp1,tp2pp1,tp1pp2,tp2pp2,tp1pp3,tp2pp4,tp1pp8,tp8pp1,tp4pp2")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default="reference")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--k", type=float, default=4.0)
    ap.add_argument("--safety", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    jobs = [(lay, mode, a.dtype, a.examples, a.device, a.attention_backend, a.seed)
            for lay in a.layouts.split(",") for mode in a.modes.split(",")]
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        rows = [r for part in pool.map(_cell, jobs) for r in part]
    from fuzz.verdict.tolerance import HALF_RULES

    rule = HALF_RULES.get(a.dtype)  # None: the float32 rule (no measured noise)
    ratios = [r["ratio"] for r in rows]
    flips = [r for r in rows if r["greedy_flip"]]
    out = {
        "dtype": a.dtype, "device": a.device, "attention_backend": a.attention_backend,
        "command": "python " + " ".join(sys.argv), "seconds": round(time.time() - t0, 1),
        "cells": len(jobs), "positions": len(rows) // max(1, len({r["oracle"] for r in rows})),
        "samples": len(rows), "samples_by_oracle": {o: sum(r["oracle"] == o for r in rows)
                                                    for o in sorted({r["oracle"] for r in rows})},
        "max_err": max(r["err"] for r in rows), "median_noise": sorted(r["noise"] for r in rows)[len(rows) // 2],
        "max_err_over_noise": max((r["err"] / r["noise"] for r in rows if r["noise"] > 0), default=None),
        "suggested": {"k": a.k, "atol": suggest(rows, a.k, a.safety), "safety": a.safety} if rule else None,
        "rule_in_use": {"k": rule.k, "atol": rule.atol} if rule else "float32: 32 eps sqrt(hidden) max(1, |ref|)",
        "clean_max_ratio_by_oracle": {o: max(r["ratio"] for r in rows if r["oracle"] == o)
                                      for o in sorted({r["oracle"] for r in rows})},
        "clean_max_ratio_under_rule": max(ratios),
        "clean_ratio_p99": sorted(ratios)[int(0.99 * (len(ratios) - 1))],
        "greedy_flips": len(flips),
        "greedy_flips_past_bound": sum(f["margin"] > f["bound"] for f in flips),
        "per_cell_max_ratio": {c: max(x for r, x in zip(rows, ratios) if r["cell"] == c)
                               for c in sorted({r["cell"] for r in rows})},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
