"""Shrinking a campaign's failures to a minimum: one failure (`shrink_one`), and the shrink
phase after the campaign budget (`ShrinkPhase`).

A failure found early is minimized at once, within the campaign's budget. One found late
would be cut short there (a 150 s campaign once wrote 8 requests at tp2pp4 for a bug that
shows at tp1pp2 with one), so what the budget left unfinished is finished after it, in a
phase with its own budget (`llmfuzz run --shrink-budget`): failures found fastest first, each
given half a fair share of the time, then, in that order, all the time left. The minimizer is
fuzz.campaign.shrink's, with the target's candidates; it says whether it reached a fixpoint (the
reproducer's `minimal`). A stop (SIGINT/SIGTERM) mid-shrink keeps the smallest failure so far.

The phase is sequential: the in-process world runs one rank at a time on the campaign's one
harness (its engine pool), so two minimizers would only share the same cores.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from fuzz.campaign.shrink import Shrinker, minimize_to_fixpoint


@dataclass
class Shrunk:
    violation: object  # the smallest version that fails the same way (fuzz.verdict.properties.same_failure)
    checks: int
    minimal: bool  # the minimizer's last pass ran whole and nothing in it failed
    stopped: bool = False  # a stop (SIGINT/SIGTERM) cut it short
    reproducible: bool = True  # False: the failure did not happen again when re-run


def shrink_one(v, target, deadline: float | None, max_checks: int, before: Callable[[], None] | None = None,
               confirm: bool = True, check: Callable | None = None) -> Shrunk:
    """Minimize failure `v` on `target` until `deadline` (time.monotonic()) or `max_checks`.
    `confirm`: re-run it first where the target asks (a failure that does not happen again, a
    rank killed from outside, has no simpler version to find). `before` runs ahead of every
    check (the campaign's stop flag). `check`: the target's, as the campaign records it
    (fuzz.campaign.history.recording_check). A target that keeps state across Cases then has
    the result replayed on a fresh engine (`fresh`): only a failure that happens there again,
    alone or after the Cases before it, is minimal."""
    sh = Shrinker(v, check or target.check, before=before)
    try:
        if confirm and target.confirm_before_shrink and not sh.still_fails(v.case):
            # Not again on this engine; one that keeps state may have moved on: a fresh one decides.
            r = Shrunk(v, sh.checks, False, reproducible=False)
        else:
            _, _, minimal = minimize_to_fixpoint(v.case, sh.still_fails, max_checks, deadline, target.simpler)
            r = Shrunk(sh.best, sh.checks, minimal)
    except KeyboardInterrupt:
        return Shrunk(sh.best, sh.checks, False, stopped=True)
    if not getattr(target, "keeps_state", False):
        return r
    try:
        return fresh(r, v, target, deadline)
    except KeyboardInterrupt:  # a stop mid-replay: written as it is, not replayed (the campaign says so)
        return Shrunk(r.violation, r.checks, False, stopped=True)


def fresh(r: Shrunk, first, target, deadline: float | None) -> Shrunk:
    """`r` (the warm engine's smallest version of failure `first`) settled by a fresh replay
    (fuzz.campaign.settle). Where the smaller version does not fail on a fresh engine
    and `first` does, `first` is kept (not minimal): the warm engine's state shrank it, not its Case."""
    from fuzz.campaign.settle import settle

    v = r.violation
    if getattr(v, "history", None) is None:  # checked outside the campaign's record: the nearest one known
        v.history = getattr(first, "history", None)
    res = settle(v, target, deadline, target.max_fresh_checks)
    if not res.fails and v is not first:
        prior = getattr(first, "fresh_replay", None) or settle(first, target, deadline, target.max_fresh_checks)
        if prior.fails:
            return Shrunk(first, r.checks, False)
    return Shrunk(v, r.checks, r.minimal and res.fails and res.history_minimal,
                  reproducible=res.fails or not res.ran)


@dataclass
class Pending:
    """A failure the campaign could not finish minimizing: its summary record (fuzz.targets.base.Failure,
    updated in place) and the smallest version so far."""
    failure: object
    violation: object
    confirmed: bool  # already re-run once: no need to again


class ShrinkPhase:
    """After the budget: minimize every pending failure within `budget_s`. `rewrite(pending,
    shrunk, seconds)` writes each result (the campaign's one writer: fuzz.campaign.recorder); `before`
    is its stop check; `progress`: say what it does on stderr."""

    clock = staticmethod(time.monotonic)  # the campaign's (Campaign.clock): its budget is read on it

    def __init__(self, target, budget_s: float, rewrite: Callable, before: Callable[[], None] | None = None,
                 max_checks: int = 10_000, progress: bool = False, check: Callable | None = None) -> None:
        self.target, self.budget_s, self.rewrite, self.before = target, budget_s, rewrite, before
        self.check = check  # the target's, as the campaign records it (shrink_one)
        self.max_checks, self.progress = max_checks, progress
        self.seconds = 0.0
        self.stopped = False

    def _say(self, line: str) -> None:
        if self.progress:
            sys.stderr.write(f"llmfuzz: {line}\n")
            sys.stderr.flush()

    def run(self, pending: list[Pending]) -> bool:
        """Fastest found first. A first pass gives each failure half its fair share of the time
        (every one gets smaller soon); later passes give each, in that order, all the time
        left (the earliest found end minimal first), while a failure is not minimal and time
        remains. True when a stop ended it."""
        t0 = self.clock()
        end = t0 + self.budget_s
        todo = sorted(pending, key=lambda p: (p.failure.seconds_to_find is None, p.failure.seconds_to_find or 0.0))
        self._say(f"shrink phase: {len(todo)} failure(s) not minimal yet, budget {self.budget_s:.0f}s")
        try:
            first_pass = True
            while todo and self.clock() < end:
                cut, checked = [], 0
                for i, p in enumerate(todo):
                    now = self.clock()
                    if now >= end:
                        break
                    share_end = now + 0.5 * (end - now) / (len(todo) - i) if first_pass else end
                    self._say(f"shrinking {p.failure.property} found at {p.failure.seconds_to_find or 0:.0f}s "
                              f"({p.failure.case_desc}) for up to {share_end - now:.0f}s")
                    # The minimizer reads time.monotonic(): the time left on this clock, there.
                    r = shrink_one(p.violation, self.target, time.monotonic() + (share_end - now), self.max_checks,
                                   self.before, confirm=not p.confirmed, check=self.check)
                    p.confirmed, checked = True, checked + r.checks
                    if r.checks or r.stopped:
                        self.rewrite(p, r, self.clock() - now)
                    if r.stopped:
                        self.stopped = True
                        return True
                    if not r.minimal and r.reproducible and r.checks < self.max_checks:
                        cut.append(p)  # its share ran out: another pass, if time is left
                if not checked:  # shares too short for one check: nothing more to gain
                    break
                todo, first_pass = cut, False
        finally:
            self.seconds = self.clock() - t0
        return False

    def report(self, pending: list[Pending]) -> dict:
        """What `llmfuzz run --json` says of the phase (`shrink_phase`)."""
        return {"budget_s": round(self.budget_s, 1), "seconds": round(self.seconds, 2), "failures": len(pending),
                "minimal": sum(bool(p.failure.minimal) for p in pending), "interrupted": self.stopped}
