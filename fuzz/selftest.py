"""`llmfuzz selftest`: prove the harness catches every fault in the registry.

For each fault, a campaign with that fault switched on and the ordinary strategies (no
fault-specific generation: the strategies must reach the fault on their own) runs until
the first failure or its budget; the shrunk reproducer is written and measured.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from engine.faults import FAULTS
from fuzz.campaign import Campaign
from fuzz.harness import pool_capacity_for
from fuzz.isolated import make_harness
from fuzz.reproduce import load_reproducer
from fuzz.strategies import CAMPAIGN_ORDER, FUZZ_MODEL


@dataclass(slots=True)
class FaultResult:
    name: str
    detected: bool
    seconds: float | None  # to the first failure (before shrinking)
    examples: int | None  # examples run until the first failure
    property: str | None
    requests: int | None  # of the shrunk reproducer
    tokens: int | None  # prompt tokens of the shrunk reproducer
    layout: str | None
    mode: str | None
    reproducer: str | None
    total_seconds: float  # including shrinking
    interrupted: bool = False  # SIGINT/SIGTERM stopped this fault's campaign (and the selftest)
    oracle: str | None = None  # what the failing run was compared against (None: a check of the run alone)
    second_opinion: str | None = None  # the transformers oracle on the same Case


def run_selftest(faults: list[str] | None = None, budget_per_fault: float = 60.0, out_dir: str = "reproducers/faults",
                 seed: int = 0, progress: bool = True, base=FUZZ_MODEL, isolate: str = "auto",
                 shrink_grace_s: float | None = None, everywhere: bool = False,
                 oracles: frozenset[str] = frozenset()) -> list[FaultResult]:
    """With `everywhere`, each fault is on in every run the harness makes (reference
    included), as a real bug in shared code would be: only the oracles that do not share
    the faulty code (solo, transformers) and the run-alone checks can then see it."""
    names = faults or list(FAULTS)
    # Engines are shared across faults: reset switches faults per Case.
    harness = make_harness(base.device, isolate, pool_capacity_for(len(CAMPAIGN_ORDER), 2), oracles)
    results = []
    try:
        for name in names:
            camp = Campaign(layouts=CAMPAIGN_ORDER, modes=("eager", "graph"), faults=(name,), seed=seed,
                            out_dir=out_dir, budget_s=budget_per_fault, chunk=3, stop_on_failure=True,
                            progress=progress, base=base, harness=harness, shrink_grace_s=shrink_grace_s,
                            fault_scope="everywhere" if everywhere else "test")
            s = camp.run()
            if s.failures:
                f = s.failures[0]
                case = load_reproducer(f.path).case
                results.append(FaultResult(
                    name, True, round(s.first_failure_s, 2), s.first_failure_examples, f.property,
                    len(case.workload.requests), case.workload.num_prompt_tokens, case.layout, case.mode,
                    f.path, round(s.seconds, 2), oracle=f.oracle, second_opinion=f.second_opinion))
            else:
                results.append(FaultResult(name, False, None, None, None, None, None, None, None, None,
                                           round(s.seconds, 2)))
            if s.interrupted:
                results[-1].interrupted = True
                break  # the faults after it are not run: the caller reports the selftest as stopped
    finally:
        harness.close()
    return results


def summary_json(results: list[FaultResult]) -> dict:
    found = [r for r in results if r.detected]
    return {"faults": [asdict(r) for r in results], "detected": len(found), "total": len(results),
            "median_seconds_to_detection": statistics.median([r.seconds for r in found]) if found else None}


def table(results: list[FaultResult]) -> str:
    rows = [f"{'fault':<30}{'found':>6}{'secs':>7}{'ex':>5}  {'property':<18}{'oracle':<13}{'reqs':>5}{'toks':>5}"
            f"  layout/mode"]
    for r in results:
        if r.interrupted and not r.detected:
            rows.append(f"{r.name:<30}{'-':>6}{'-':>7}{'-':>5}  (interrupted after {r.total_seconds:.0f}s)")
        elif r.detected:
            rows.append(f"{r.name:<30}{'yes':>6}{r.seconds:>7.1f}{r.examples:>5}  {r.property:<18}"
                        f"{r.oracle or '-':<13}{r.requests:>5}{r.tokens:>5}  {r.layout}/{r.mode}")
        else:
            rows.append(f"{r.name:<30}{'NO':>6}{'-':>7}{'-':>5}  (not detected in {r.total_seconds:.0f}s)")
    return "\n".join(rows)
