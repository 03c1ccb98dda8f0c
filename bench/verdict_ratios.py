"""Error/tolerance ratios of clean runs: N drawn Cases (a fixed seed) checked by the harness
with the engine as it is; prints the distribution of each passing Case's worst logits
error/tolerance and every Case that failed (a false positive: the engine has no fault).

    python bench/verdict_ratios.py --cases 40 --dtype bfloat16 [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

from bench import emit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from fuzz import profiles
    from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, IMPLEMENTED_MODES, cases
    from fuzz.verdict.harness import Harness
    from fuzz.verdict.properties import Violation

    profiles.load()
    h, ratios, false_positives, t0 = Harness(), [], [], time.monotonic()

    @seed(args.seed)
    @settings(max_examples=args.cases, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES, base=FUZZ_MODEL.replace(dtype=args.dtype)))
    def check(case):
        try:
            ratios.append(h.check(case).logits.ratio)
        except Violation as v:
            false_positives.append({"property": v.property, "oracle": v.oracle, "message": str(v)[:300],
                                    "case": case.to_dict()})

    try:
        check()
    finally:
        h.close()
    q = sorted(ratios)
    return emit({"what": f"error/tolerance of clean Cases, CPU {args.dtype}", "cases": args.cases,
                 "passed": len(q), "false_positives": false_positives, "seed": args.seed,
                 "max": round(q[-1], 4) if q else None, "median": round(statistics.median(q), 4) if q else None,
                 "p90": round(q[int(0.9 * (len(q) - 1))], 4) if q else None,
                 "histogram": {f"<{b}": sum(r < b for r in q) for b in (0.01, 0.03, 0.1, 0.3, 1.0)},
                 "seconds": round(time.monotonic() - t0, 1),
                 "command": "python bench/verdict_ratios.py " + " ".join(argv if argv is not None else sys.argv[1:])},
                args.out)


if __name__ == "__main__":
    sys.exit(main())
