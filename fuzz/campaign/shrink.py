"""Case-level minimizer for reproducers (`llmfuzz minimize FILE`).

Hypothesis shrinks what it generated; a reproducer from a nightly run, a user or another
llmfuzz version is a plain Case, so this greedy pass shrinks Cases directly: drop requests,
simplify the layout, default the schedule, switch options off, shorten prompts. A
candidate is kept only when it fails with the same property.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from fuzz.cases.case import Case, CaseFormatError
from fuzz.targets.simpler import candidates


def minimize(case: Case, still_fails: Callable[[Case], bool], max_checks: int = 400,
             deadline: float | None = None,
             simpler: Callable[[Case], Iterable[Case | None]] = candidates) -> tuple[Case, int]:
    """Greedy fixpoint: take the first simpler candidate that still fails, repeat. Stops after
    `max_checks` checks or at `deadline` (time.monotonic()), keeping the smallest so far.
    `simpler` gives the candidates (a target's own: fuzz.targets.base.Target.simpler)."""
    small, checks, _ = minimize_to_fixpoint(case, still_fails, max_checks, deadline, simpler)
    return small, checks


def minimize_to_fixpoint(case: Case, still_fails: Callable[[Case], bool], max_checks: int = 400,
                         deadline: float | None = None,
                         simpler: Callable[[Case], Iterable[Case | None]] = candidates) -> tuple[Case, int, bool]:
    """`minimize`, also saying whether the result is minimal as far as the minimizer can tell:
    one whole pass over its candidates ran and none failed (no request, token, rank, chunk or
    schedule event of `simpler`'s could go). False when the check budget or the deadline cut
    the last pass short. Calling it again on the result continues where it stopped.

    After a candidate is taken, the search resumes at the same place in the new Case's
    candidates, not at the top: restarting cost a failing check per earlier candidate for
    every token a prompt lost (a 27-token prompt shortened one token at a time took 294
    checks). Only a pass from the top that takes nothing makes the result minimal."""
    checks, start = 0, 0

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() > deadline

    while True:
        cands, taken = list(simpler(case)), None
        for j in range(start, len(cands)):
            cand = cands[j]
            if cand is None or cand == case:
                continue
            try:
                cand.validate()
            except CaseFormatError:
                continue
            if out_of_time() or checks >= max_checks:
                return case, checks, False
            checks += 1
            if still_fails(cand):
                taken = j
                break
        if taken is not None:
            case, start = cands[taken], taken
        elif start == 0:
            return case, checks, True  # a whole pass from the top, and nothing could go
        else:
            start = 0  # the candidates before where it resumed: once more from the top


class Shrinker:
    """The predicate a minimizer runs for a failure `first`: `still_fails(case)` checks `case`
    (`check`: a target's, fuzz.targets.base) and is True when it fails the same way (`same`,
    default fuzz.verdict.properties.same_failure); `best` is the smallest such Violation seen, kept when
    a stop or a deadline cuts the search short. `before` runs ahead of every check (the
    campaign's stop flag)."""

    def __init__(self, first, check: Callable, same: Callable | None = None,
                 before: Callable[[], None] | None = None) -> None:
        from fuzz.verdict.properties import same_failure

        self.first, self.best, self.check = first, first, check
        self.same, self.before = same or same_failure, before
        self.checks = 0  # cases checked (a stop mid-search still knows how many)

    def still_fails(self, case: Case) -> bool:
        from fuzz.verdict.properties import Violation

        if self.before is not None:
            self.before()
        self.checks += 1
        try:
            self.check(case)
        except Violation as w:
            if self.same(w, self.first):
                self.best = w
                return True
        return False
