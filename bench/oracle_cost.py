"""What a check costs: seconds per `Harness.check` on the same Cases, this tree vs another.

    python bench/oracle_cost.py [--cases 12] [--dtype bfloat16] > new.json
    git worktree add /tmp/old <commit> && PYTHONPATH=/tmp/old python bench/oracle_cost.py > old.json

Per cell: a warm-up pass over one set of Cases (engine start-up, graph captures, the
transformers import), then the timed pass over another; examples/s = Cases / seconds.

Each tree draws with its own strategies, so once they draw bigger Cases (more limits,
sharing, sampling) examples/s falls with nothing slower. For the same Cases in both trees,
one tree writes them (`--write DIR`: Case JSON, no checks) and each checks those files
(`--from DIR`). Write with the older tree: a newer one loads older Cases, not the reverse.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hypothesis import HealthCheck, given, seed, settings

CELLS = (("tp1pp1", "eager"), ("tp1pp1", "graph"), ("tp2pp4", "eager"), ("tp1pp8", "graph"), ("tp8pp1", "eager"))


def _api():
    """(strategies, Case, harness) modules of the tree on PYTHONPATH, before or after fuzz/ was
    split by role. Asked of the tree on disk: another tree's editable install would answer a
    failed import."""
    import importlib

    import fuzz

    split = os.path.isdir(os.path.join(os.path.dirname(fuzz.__file__), "cases"))
    names = ("fuzz.cases.strategies", "fuzz.cases.case", "fuzz.verdict.harness") if split else \
        ("fuzz.strategies", "fuzz.case", "fuzz.harness")
    return tuple(importlib.import_module(n) for n in names)


def draw(layout: str, mode: str, n: int, base, s: int) -> list:
    strategies = _api()[0]
    out = []

    @seed(s)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategies.cases((layout,), (mode,), (), base, 6))
    def collect(case):
        out.append(case)

    collect()
    return out[:n]


def case_sets(layout: str, mode: str, a, base) -> list[list]:
    """The warm-up and the timed Cases of a cell: drawn (seeds 1 and 2) or read from --from."""
    if not a.from_dir:
        return [draw(layout, mode, a.cases, base, s) for s in (1, 2)]
    Case = _api()[1].Case
    sets = []
    for part in ("warm", "timed"):
        d = os.path.join(a.from_dir, f"{layout}-{mode}", part)
        sets.append([Case.from_json(open(os.path.join(d, f)).read()) for f in sorted(os.listdir(d))])
    return sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--write", metavar="DIR", help="write each cell's warm-up and timed Cases as JSON; check nothing")
    ap.add_argument("--from", dest="from_dir", metavar="DIR", help="check the Cases --write wrote")
    a = ap.parse_args()
    strategies, _, harness_mod = _api()
    base = strategies.FUZZ_MODEL.replace(dtype=a.dtype)
    if a.write:
        for layout, mode in CELLS:
            for part, cs in zip(("warm", "timed"), case_sets(layout, mode, a, base)):
                os.makedirs(d := os.path.join(a.write, f"{layout}-{mode}", part), exist_ok=True)
                for i, c in enumerate(cs):
                    with open(os.path.join(d, f"{i:03d}.json"), "w") as f:
                        f.write(c.to_json())
        return 0
    h = harness_mod.Harness()
    out = {"tree": harness_mod.__file__, "dtype": a.dtype, "cases_from": a.from_dir or "drawn", "cells": {}}
    try:
        for layout, mode in CELLS:
            # Warm-up on other Cases than the timed ones: no reference or oracle cache hits
            # in the timed pass, as in a campaign that draws new workloads.
            times, failures = [], 0
            for cs in case_sets(layout, mode, a, base):
                t0, failures = time.perf_counter(), 0
                for c in cs:
                    try:
                        h.check(c)
                    except Exception:  # noqa: BLE001 - a Violation (or a crash) took its time too
                        failures += 1
                times.append(time.perf_counter() - t0)
            out["cells"][f"{layout}/{mode}"] = {"cases": len(cs), "seconds": round(times[1], 3),
                                                 "examples_per_s": round(len(cs) / times[1], 3),
                                                 "failures": failures}
            print(json.dumps({layout + "/" + mode: out["cells"][f"{layout}/{mode}"]}), file=sys.stderr)
    finally:
        h.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
