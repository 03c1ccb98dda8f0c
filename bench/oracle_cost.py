"""What the oracles cost: seconds per `Harness.check` on the same Cases, this tree vs another.

Uses only the API every version has (`Harness().check(case)`, `fuzz.cases.strategies.cases`), so
the same script measures an older checkout: run it twice and compare,

    python bench/oracle_cost.py > new.json
    git worktree add /tmp/old <commit> && PYTHONPATH=/tmp/old python bench/oracle_cost.py > old.json

Per cell: a warm-up pass over one set of Cases (engine start-up, graph captures, the
transformers import), then the timed pass over another; examples/s = Cases / seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from hypothesis import HealthCheck, given, seed, settings

CELLS = (("tp1pp1", "eager"), ("tp1pp1", "graph"), ("tp2pp4", "eager"), ("tp1pp8", "graph"), ("tp8pp1", "eager"))


def draw(layout: str, mode: str, n: int, base, s: int) -> list:
    from fuzz.cases.strategies import cases

    out = []

    @seed(s)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases((layout,), (mode,), (), base, 6))
    def collect(case):
        out.append(case)

    collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    import fuzz.verdict.harness as harness_mod
    from fuzz.verdict.harness import Harness
    from fuzz.verdict.properties import Violation
    from fuzz.cases.strategies import FUZZ_MODEL

    base = FUZZ_MODEL.replace(dtype=a.dtype)
    h = Harness()
    out = {"tree": harness_mod.__file__, "dtype": a.dtype, "cells": {}}
    try:
        for layout, mode in CELLS:
            # Warm-up on other Cases than the timed ones: no reference or oracle cache hits
            # in the timed pass, as in a campaign that draws new workloads.
            times = []
            for s in (1, 2):
                cs = draw(layout, mode, a.cases, base, s)
                t0 = time.perf_counter()
                for c in cs:
                    try:
                        h.check(c)
                    except Violation:
                        pass
                times.append(time.perf_counter() - t0)
            out["cells"][f"{layout}/{mode}"] = {"cases": len(cs), "seconds": round(times[1], 3),
                                                 "examples_per_s": round(len(cs) / times[1], 3)}
            print(json.dumps({layout + "/" + mode: out["cells"][f"{layout}/{mode}"]}), file=sys.stderr)
    finally:
        h.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
