"""examples/s (and, where this tree measures it, efficiency) per in-process cell, for any tree.

    PYTHONPATH=<tree> python bench/speed_cells.py [--cells tp1pp1/eager,...] [--budget 10] > out.json

Uses `bench.cells._speed_cells` when the tree has it (efficiency, where the time goes) and
`bench.cells._examples_per_s` otherwise (older trees), so one command measures a before and
an after on the same machine in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ALL = "tp1pp1/eager,tp1pp1/graph,tp2pp4/eager,tp2pp4/graph,tp1pp8/eager,tp1pp8/graph,tp8pp1/eager"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default=ALL)
    ap.add_argument("--budget", type=float, default=10.0)
    a = ap.parse_args()
    import bench.cells as fb
    from fuzz import profiles
    from fuzz.verdict.harness import Harness

    profiles.load("dev")
    cells = tuple((c.split("/")[0], c.split("/")[1], "inproc") for c in a.cells.split(","))
    h = Harness()
    t0 = time.perf_counter()
    try:
        if hasattr(fb, "_speed_cells"):
            rows, _ = fb._speed_cells(h, cells, a.budget, False)
        else:
            rows = []
            for layout, mode, where in cells:
                fb._examples_per_s(layout, mode, where, 1.0, h)  # warm-up, as the bench does
                rows.append(fb._examples_per_s(layout, mode, where, a.budget, h)[0])
    finally:
        h.close()
    print(json.dumps({"tree": os.path.dirname(os.path.dirname(fb.__file__)), "budget_s": a.budget,
                      "cells": rows, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
