"""Share of drawn Cases that reach each config limit (fuzz.cases.limits.LIMITS), as JSON.

    python bench/draw_limits.py [--cases 2000] [--seed 0] [--out FILE]

Draws `--cases` Cases with the campaign's strategy (`fuzz.cases.strategies.cases`, every layout,
eager and graph) under a fixed Hypothesis seed, runs none of them, and counts per limit the
Cases that reach it (`fuzz.cases.limits.limits_reached`, the function whose names the strategies
label with event("limit: ...") and a campaign counts per cell). Also: the share of Cases in the
class the prefix_hit_mid_block_counted_full fault needs (`mid_block_prefix_class`), and the
drawing time per Case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzz.cases.limits import LIMITS, limits_reached, mid_block_prefix_class  # noqa: E402
from fuzz.cases.strategies import DEFAULT_LAYOUTS, IMPLEMENTED_MODES, cases  # noqa: E402


def draw_cases(n: int, seed_: int) -> list:
    """`n` Cases as a campaign draws them (generation only, no shrinking), reproducibly."""
    drawn: list = []

    @seed(seed_)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(DEFAULT_LAYOUTS, IMPLEMENTED_MODES))
    def collect(case) -> None:
        drawn.append(case)

    collect()
    return drawn


def measure(n: int, seed_: int) -> dict:
    t0 = time.perf_counter()
    drawn = draw_cases(n, seed_)
    seconds = time.perf_counter() - t0
    counts = Counter(name for c in drawn for name in limits_reached(c.config, c.workload.requests))
    mid = sum(mid_block_prefix_class(c.config, c.workload.requests) for c in drawn)
    return {"cases": len(drawn), "seed": seed_, "draw_ms_per_case": round(1000 * seconds / max(len(drawn), 1), 2),
            "share_of_cases": {name: round(counts[name] / len(drawn), 4) for name in LIMITS},
            "cases_at_limit": {name: counts[name] for name in LIMITS},
            "any_limit": round(sum(bool(limits_reached(c.config, c.workload.requests)) for c in drawn) / len(drawn), 4),
            "mid_block_prefix_class": round(mid / len(drawn), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    doc = {"command": " ".join(["python", "bench/draw_limits.py", *sys.argv[1:]]), **measure(a.cases, a.seed)}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
