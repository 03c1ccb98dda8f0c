"""Where one example's time goes: cProfile over warm `Harness.check` calls, per cell.

    python bench/profile_check.py [--cells tp1pp1/eager,tp2pp4/eager] [--cases 20] > out.json

Per cell: a warm-up pass (engine start-up, graph captures, imports) over one set of drawn
Cases, then the profiled pass over another: the driver thread and, each under its own
profiler, every rank thread's prepare/execute phases (their sum, so own time adds up to
more than wall time; the driver's lock waits are the ranks' work seen from outside). Reports seconds per example and the functions
with the most own time and the most cumulative time, and the own time summed by where the
code lives (engine/, fuzz/, torch, hypothesis, other): the starting point for making a step
cost nearer its forward pass (issue: ten times the examples per second).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_cost import draw  # noqa: E402  (the same Cases, drawn the same way)


def _where(filename: str) -> str:
    for key in ("/engine/", "/fuzz/", "/torch/", "/hypothesis/", "/transformers/"):
        if key in filename:
            return key.strip("/")
    return "builtin" if filename.startswith("~") or filename.startswith("<") else "other"


_local = threading.local()
_rank_profiles: list = []
_on = threading.Event()


def _profiled(fn):
    """Run a rank thread's phase under that thread's own profiler while profiling is on
    (cProfile sees one thread: the driver's profile shows rank work as lock waits)."""
    def wrapper(*a, **kw):
        if not _on.is_set():
            return fn(*a, **kw)
        prof = getattr(_local, "prof", None)
        if prof is None:
            prof = _local.prof = cProfile.Profile()
            _rank_profiles.append(prof)
        return prof.runcall(fn, *a, **kw)
    return wrapper


def profile_cell(layout: str, mode: str, n: int) -> dict:
    from engine.model_runner import GPUModelRunner
    from fuzz.verdict.harness import Harness
    from fuzz.cases.strategies import FUZZ_MODEL

    for name in ("prepare", "execute"):
        if not hasattr(getattr(GPUModelRunner, name), "__wrapped_by_profile__"):
            w = _profiled(getattr(GPUModelRunner, name))
            w.__wrapped_by_profile__ = True
            setattr(GPUModelRunner, name, w)
    _rank_profiles.clear()
    h = Harness()
    try:
        for case in draw(layout, mode, n, FUZZ_MODEL, 1):
            h.check(case)
        cases = draw(layout, mode, n, FUZZ_MODEL, 2)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        _on.set()
        prof.enable()
        for case in cases:
            h.check(case)
        prof.disable()
        _on.clear()
        seconds = time.perf_counter() - t0
    finally:
        h.close()
    st = pstats.Stats(prof)
    for p in _rank_profiles:
        st.add(p)
    rows = [(f"{os.path.relpath(fn) if '/work/' in fn else os.path.basename(fn)}:{line}({name})", tt, ct, nc)
            for (fn, line, name), (_, nc, tt, ct, _) in st.stats.items()]
    by_where: dict[str, float] = {}
    for (fn, _, _), (_, _, tt, _, _) in st.stats.items():
        by_where[_where(fn)] = by_where.get(_where(fn), 0.0) + tt
    total = sum(by_where.values()) or 1.0
    top = lambda i: [{"function": r[0], "own_s": round(r[1], 3), "cum_s": round(r[2], 3), "calls": r[3]}
                     for r in sorted(rows, key=lambda r: -r[i])[:15]]
    return {"layout": layout, "mode": mode, "examples": len(cases), "seconds": round(seconds, 2),
            "s_per_example": round(seconds / max(1, len(cases)), 4),
            "own_time_share": {k: round(v / total, 3) for k, v in sorted(by_where.items(), key=lambda kv: -kv[1])},
            "top_own": top(1), "top_cumulative": top(2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="tp1pp1/eager,tp2pp4/eager,tp1pp8/graph")
    ap.add_argument("--cases", type=int, default=20)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out = [profile_cell(*c.split("/"), args.cases) for c in args.cells.split(",") if c]
    print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "cells": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
