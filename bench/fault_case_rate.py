"""The share of drawn Cases of one cell in which a registered fault is caught: how often the
strategies draw the Case a fault's bug class needs, apart from how a selftest's time is
spread over the cells (`llmfuzz selftest` time to detection mixes both).

    python bench/fault_case_rate.py --fault F [--layout tp1pp1] [--mode eager] [--cases 80] [--chunk K]

Cases are drawn from fuzz.cases.strategies.cases, each checked once by the harness with the fault
on. Without --chunk: one derandomized Hypothesis run (the same Cases on every run of one tree;
its draws lean to a few corners: on tp1pp2, 52 of 60 Cases drafted with n-gram). With
--chunk K: as a campaign draws them, in Hypothesis runs of K examples, each with its own seed
(0, 1, ...), which estimates a campaign's rate. Prints one JSON object: cases, caught, the
share, and by speculative method where drafts matter; and how the test runs drafted: n-gram
proposals made and non-empty, and spec Cases in which some request accepted 2 or more drafts
in one step (over the spec Cases whose test run finished: a caught Case's raised).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter


def main() -> None:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from fuzz.cases.strategies import cases
    from fuzz.verdict.harness import Harness
    from fuzz.verdict.properties import Violation

    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", required=True)
    ap.add_argument("--layout", default="tp1pp1")
    ap.add_argument("--mode", default="eager")
    ap.add_argument("--cases", type=int, default=80)
    ap.add_argument("--chunk", type=int, default=0, help="examples per seeded Hypothesis run (0: one derandomized run)")
    a = ap.parse_args()
    h, n = Harness(), Counter()
    # The test run of the Case being checked, told apart by its config (the reference's and the
    # oracles' are other configs); Harness.check returns no trace, so its runs are recorded.
    runs = []
    run = h._run

    def traced(c, forced):
        trace = run(c, forced)
        runs.append((c.config, trace))
        return trace

    h._run = traced

    def one(case):
        n["cases"] += 1
        n[f"cases {case.config.speculative_method}"] += 1
        runs.clear()
        try:
            h.check(case)
        except Violation as v:
            n["caught"] += 1
            n[f"caught {case.config.speculative_method}"] += 1
            n[f"by {v.property}"] += 1
        test = next((t for c, t in runs if c == case.config), None)
        if test is not None and case.config.speculative_method != "none":
            drafts(case, test)

    def drafts(case, test):  # a caught Case's run raised: only the runs that finished count
        n["drafts: spec cases run"] += 1
        n["drafts: ngram proposals"] += len(test.ngram_drafts)
        n["drafts: ngram proposals non-empty"] += sum(bool(d) for _, _, d in test.ngram_drafts)
        # Tokens one request appended in one microbatch: 1 + the drafts it accepted there.
        per_step = Counter((rid, r.microbatch) for rid, recs in test.tokens.items() for r in recs)
        if any(k >= 3 for k in per_step.values()):
            n["drafts: spec cases accepting >= 2 in a step"] += 1
            n[f"drafts: {case.config.speculative_method} cases accepting >= 2 in a step"] += 1

    def test(**kw):  # a fresh Hypothesis test each time: settings decorate a function once
        return settings(database=None, deadline=None, suppress_health_check=list(HealthCheck), **kw)(
            given(cases((a.layout,), (a.mode,), (a.fault,)))(one))

    try:
        if not a.chunk:
            test(max_examples=a.cases, derandomize=True)()
        for k in range(-(-a.cases // a.chunk) if a.chunk else 0):
            seed(k)(test(max_examples=a.chunk, phases=(Phase.generate,)))()
    finally:
        h.close()
    tree = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"command": "python bench/fault_case_rate.py " + " ".join(sys.argv[1:]), "tree": tree,
                      "share": round(n["caught"] / max(1, n["cases"]), 3),
                      "ngram_nonempty_share": round(n["drafts: ngram proposals non-empty"]
                                                    / max(1, n["drafts: ngram proposals"]), 3),
                      "spec_accept2_share": round(n["drafts: spec cases accepting >= 2 in a step"]
                                                  / max(1, n["drafts: spec cases run"]), 3),
                      **dict(sorted(n.items()))}, indent=1))


if __name__ == "__main__":
    main()
