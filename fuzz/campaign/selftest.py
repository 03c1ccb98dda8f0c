"""`llmfuzz selftest`: prove the harness catches every fault in the registry.

For each fault, a campaign with that fault switched on and the ordinary strategies (no
fault-specific generation: the strategies must reach the fault on their own) runs until
the first failure or its budget; the shrunk reproducer is written and measured.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from engine.faults import FAULTS
from fuzz.campaign.loop import Campaign
from fuzz.verdict.engine_pool import pool_capacity_for
from fuzz.verdict.isolated import make_harness
from fuzz.stop import check_stop, clear_stop, stop_requested
from fuzz.cases.strategies import CAMPAIGN_ORDER, FUZZ_MODEL

# Once a fault is found, the seconds its failure is shrunk while finding (Hypothesis, then the
# minimizer; the shrink phase goes on if it is not minimal yet), at least: without a bound,
# Hypothesis shrank up to the fault's budget, so a fault found at 5 s took its whole budget.
SHRINK_WHILE_FINDING_S = 10.0


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
    minimal: bool | None = None  # the reproducer is minimal as far as the minimizer tried
    shrink_seconds: float | None = None  # spent minimizing it (campaign and shrink phase)


def run_selftest(faults: list[str] | None = None, budget_per_fault: float = 60.0, out_dir: str = "reproducers/faults",
                 seed: int = 0, progress: bool = True, base=FUZZ_MODEL, isolate: str = "auto",
                 shrink_grace_s: float | None = None, everywhere: bool = False,
                 oracles: frozenset[str] = frozenset(), poison: str | None = None,
                 layouts: tuple[str, ...] = CAMPAIGN_ORDER, shrink_s: float | None = None) -> list[FaultResult]:
    """`poison`: what every reset leaves in memory ("nan" or "stale", engine/poison.py;
    None: each Case draws one). With `everywhere`, each fault is on in every run the harness makes (reference
    included), as a real bug in shared code would be: only the oracles that do not share
    the faulty code (solo, transformers) and the run-alone checks can then see it.
    `shrink_grace_s`: each fault's shrink phase (fuzz.campaign.loop; default max(60 s, budget/4));
    `shrink_s`: its shrink while finding (default max(SHRINK_WHILE_FINDING_S, budget/4)).
    `layouts`: those the campaigns visit, round robin (default: all, in the campaign's order).

    A stop (SIGINT/SIGTERM) at any point, inside a fault's campaign or between two, ends the
    selftest with the faults run so far, the last one marked interrupted: never an exception."""
    names = faults or list(FAULTS)
    clear_stop()  # from here on a stop is this selftest's: the campaigns below leave the flag set
    results: list[FaultResult] = []
    current, t0, harness = names[0] if names else None, time.monotonic(), None
    try:
        # Engines are shared across faults: reset switches faults per Case.
        harness = make_harness(base.device, isolate, pool_capacity_for(len(layouts), 2), oracles)
        for name in names:
            check_stop()
            current, t0 = name, time.monotonic()
            camp = Campaign(layouts=layouts, modes=("eager", "graph"), faults=(name,), seed=seed,
                            out_dir=out_dir, budget_s=budget_per_fault, chunk=3, stop_on_failure=True,
                            shrink_s=max(SHRINK_WHILE_FINDING_S, budget_per_fault / 4) if shrink_s is None else shrink_s,
                            progress=progress, base=base, harness=harness, shrink_budget_s=shrink_grace_s,
                            fault_scope="everywhere" if everywhere else "test", keep_stop=True, poison=poison)
            s = camp.run()
            results.append(_result(name, s))
            current = None
            if s.interrupted or stop_requested():
                results[-1].interrupted = True
                break  # the faults after it are not run: the caller reports the selftest as stopped
    except KeyboardInterrupt:
        _mark_interrupted(results, current, t0)
    except Exception:
        if not stop_requested():  # after a stop, an error is the interrupt's (fuzz.campaign.loop._find)
            raise
        _mark_interrupted(results, current, t0)
    finally:
        try:
            if harness is not None:
                harness.close()
        except KeyboardInterrupt:  # a signal while the engines shut down: the results stand
            _mark_interrupted(results, None, t0)
    return results


def _result(name: str, s) -> FaultResult:
    """One fault's row from its campaign's summary."""
    if not s.failures:
        return FaultResult(name, False, None, None, None, None, None, None, None, None, round(s.seconds, 2))
    f = s.failures[0]
    size = f.size or {}
    return FaultResult(name, True, round(s.first_failure_s, 2), s.first_failure_examples, f.property,
                       size.get("requests"), size.get("tokens"), size.get("layout"), size.get("mode"),
                       f.path, round(s.seconds, 2), oracle=f.oracle, second_opinion=f.second_opinion,
                       minimal=f.minimal, shrink_seconds=f.shrink_seconds)


def _mark_interrupted(results: list[FaultResult], current: str | None, t0: float) -> None:
    """A stop outside a campaign's own handling: the fault in progress (if any) is reported as
    interrupted, not detected; otherwise the last fault run is the interrupted one."""
    if current is not None:
        results.append(FaultResult(current, False, None, None, None, None, None, None, None, None,
                                   round(time.monotonic() - t0, 2), interrupted=True))
    elif results:
        results[-1].interrupted = True


def summary_json(results: list[FaultResult]) -> dict:
    found = [r for r in results if r.detected]
    return {"faults": [asdict(r) for r in results], "detected": len(found), "total": len(results),
            "median_seconds_to_detection": statistics.median([r.seconds for r in found]) if found else None}


def table(results: list[FaultResult]) -> str:
    rows = [f"{'fault':<30}{'found':>6}{'secs':>7}{'ex':>5}  {'property':<18}{'oracle':<13}{'reqs':>5}{'toks':>5}"
            f"  {'layout/mode':<14}minimal"]
    for r in results:
        if r.interrupted and not r.detected:
            rows.append(f"{r.name:<30}{'-':>6}{'-':>7}{'-':>5}  (interrupted after {r.total_seconds:.0f}s)")
        elif r.detected:
            rows.append(f"{r.name:<30}{'yes':>6}{r.seconds:>7.1f}{r.examples:>5}  {r.property:<18}"
                        f"{r.oracle or '-':<13}{r.requests:>5}{r.tokens:>5}  {f'{r.layout}/{r.mode}':<14}"
                        f"{'yes' if r.minimal else 'no'}")
        else:
            rows.append(f"{r.name:<30}{'NO':>6}{'-':>7}{'-':>5}  (not detected in {r.total_seconds:.0f}s)")
    return "\n".join(rows)
