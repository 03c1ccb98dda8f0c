"""The logits check's margin in one dtype: how close clean runs come to the bound, and how
far past it each registry fault lands.

Clean: Cases drawn by the campaign's strategy over a few layouts and modes, the largest
error/tolerance over every oracle. Faults: each committed minimal reproducer
(`reproducers/faults/<fault>.json`) replayed in the dtype; a fault caught by a check of the
run alone (FA invariants, engine invariants, a crash) has no ratio and says which check.
A ratio above 1 fails; the margin is the smallest fault ratio over the largest clean one.
"""
from __future__ import annotations

import glob
import os

from hypothesis import HealthCheck, given, seed, settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLEAN_CELLS = (("tp1pp1", "eager"), ("tp2pp2", "eager"), ("tp1pp3", "graph"), ("tp2pp4", "eager"))


def clean_max_ratio(harness, base, examples: int, s: int = 0) -> float:
    from fuzz.cases.strategies import cases

    worst = [0.0]
    for i, (layout, mode) in enumerate(CLEAN_CELLS):
        @seed(s + i)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(cases((layout,), (mode,), (), base, 6))
        def run(case):
            v = harness.check(case)
            worst[0] = max([worst[0]] + [r.ratio for r in v.oracles.values() if hasattr(r, "ratio")])
        run()
    return worst[0]


def fault_ratios(harness, base) -> dict:
    """fault -> {"property", "oracle", "ratio"} of its minimal reproducer in base's dtype."""
    from fuzz.cases.case import Case
    from fuzz.verdict.properties import Violation
    from fuzz.campaign.reproduce import load_reproducer

    out = {}
    for path in sorted(glob.glob(os.path.join(REPO, "reproducers", "faults", "*.json"))):
        rep = load_reproducer(path).case
        cfg = rep.config.replace(dtype=base.dtype, device=base.device, attention_backend=base.attention_backend)
        case = Case(cfg, rep.workload, rep.schedule, rep.faults, rep.fault_scope)
        name = os.path.basename(path)[:-5]
        try:
            v = harness.check(case)
            out[name] = {"property": None, "oracle": v.logits.oracle, "ratio": v.logits.ratio}
        except Violation as e:
            r = e.error_ratio
            out[name] = {"property": e.property, "oracle": e.oracle,
                         "ratio": None if r is None else (r if r != float("inf") else "inf")}
    return out


def measure_margin(base, examples: int = 4) -> dict:
    from fuzz.verdict.harness import Harness

    h = Harness(8)
    try:
        clean = clean_max_ratio(h, base, examples)
        faults = fault_ratios(h, base)
    finally:
        h.close()
    finite = [f["ratio"] for f in faults.values() if isinstance(f["ratio"], float) and f["property"] == "logits"]
    return {"dtype": base.dtype, "device": base.device, "clean_max_ratio": clean,
            "clean_cells": [f"{lay}/{mode}" for lay, mode in CLEAN_CELLS], "clean_examples_per_cell": examples,
            "faults": faults, "smallest_logits_fault_ratio": min(finite, default=None),
            "margin": (min(finite) / clean) if finite and clean else None}
