"""The target interface: what a campaign (fuzz.campaign), its minimizer and its reproducer
writer need of an engine under test.

A target gives
- `cells()`: the cells a campaign visits, each a Hypothesis strategy of Cases (reference:
  one per layout, modes drawn within; vLLM: one per planned config, one engine each);
- `check(case) -> Verdict` (fuzz.verdict.harness.Verdict), or raises a fuzz.verdict.properties.Violation;
- `simpler(case)`: candidate simpler Cases for the minimizer, most aggressive first;
- `reproducer_meta(case, violation)`: extra top-level JSON fields for its reproducer;
- `keeps_state` and `fresh_check(case, history)`: whether its engine carries state from Case to
  Case, and a replay on a brand-new engine (fuzz.campaign.history, fuzz.targets.fresh);
and the policies a campaign takes from it (defaults: the reference engine's): how it visits
cells, how long it spends on each and on shrinking, which failures it writes, and what its
clock starting means. Targets: `fuzz.targets.reference.HarnessTarget` (the white-box
Harness, wrapped), `fuzz.targets.kernels`' cells and `fuzz.targets.vllm.target.VLLMTarget`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Cell:
    name: str  # progress lines and the nightly database's key
    strategy: Any  # a Hypothesis strategy of Cases
    data: Any = None  # the target's own (vLLM: the config and options the engine starts with)


class Unsupported(Exception):
    """The engine refuses a cell's config by design (not a failure): the cell is skipped."""


class FreshUnavailable(Exception):
    """A fresh replay (`Target.fresh_check`) could not run: no new engine could be had, or it
    did not answer. Nothing is known about the failure on a fresh engine."""


class Target(abc.ABC):
    """Base class: the interface, with the reference engine's policies as defaults."""

    name = "reference"
    sequential = False  # False: one chunk per cell, round robin; True: each cell for a share of the budget
    prestarts = False  # True: `prestart` starts the next cell beside this one's examples (no wait for it)
    hypothesis_shrinks = True  # False where each check is too dear to shrink (an engine restart per crash)
    confirm_before_shrink = True  # re-run a failure once before minimizing (a flaky one has nothing to shrink)
    max_shrink_checks = 80
    unit = "layouts"  # what the progress line counts the cells as
    chunk = 8  # examples a Hypothesis run draws on a cell (the most: short budgets take fewer)
    min_cell_s = 60.0  # a sequential cell's least time once started, whatever its share
    # A sequential cell whose share ran out with fewer checked examples than this goes on, up
    # to STRETCH x its share, while the cells left keep their least time (0: time alone decides).
    min_cell_examples = 0

    max_fresh_checks = 24  # fresh replays a failure's history shrink may spend (fuzz.campaign.history)
    fresh = "process"  # how the last `fresh_check` had its engine (fuzz.targets.fresh: PROCESS, IN_PROCESS, RESTARTED)

    @property
    def keeps_state(self) -> bool:
        """Whether the engine keeps state from one Case to the next (a persistent batch, a
        cache), so that a failure may need an earlier Case: the campaign then keeps each
        cell's history and replays a failure on a fresh engine (`fresh_check`) before it calls
        it reproducible or minimal. By default, a target that can replay that way; the
        reference engine resets (and poisons) between Cases and keeps none. A subclass may
        set it (a class attribute) either way."""
        return type(self).fresh_check is not Target.fresh_check

    def fresh_check(self, case, history=()):
        """Run the Cases `history` (oldest first), then `case`, on a brand-new engine (in a new
        process where the target can): the Violation `case` raises, else None. A history
        Case's own failure is passed over. Sets `fresh` to how the engine was had; raises
        FreshUnavailable when no fresh engine could run them (fuzz.targets.fresh runs them)."""
        raise FreshUnavailable(f"{type(self).__name__} cannot start a fresh engine")

    def shrink_per_failure_s(self, budget_s: float) -> float | None:
        """Seconds to minimize each failure while finding (None: up to the end of finding)."""
        return None

    def shrink_phase_s(self, budget_s: float) -> float:
        """Seconds of the shrink phase after the budget."""
        return max(60.0, budget_s / 4)

    def begin(self, budget_s: float) -> None:
        """The campaign's clock starts now: its budget ends `budget_s` from here."""

    @abc.abstractmethod
    def cells(self) -> list[Cell]:
        """The cells a campaign visits, in order."""

    @abc.abstractmethod
    def check(self, case):
        """Verdict of `case`, or raise the Violation it shows."""

    def simpler(self, case) -> Iterable:
        from fuzz.targets.simpler import candidates

        return candidates(case)

    def reproducer_meta(self, case, violation) -> dict:
        return {}

    def stats_key(self, case) -> tuple:
        """The summary row a Case's examples and failures count in."""
        return case.layout, case.mode

    def start(self, cell: Cell) -> None:
        """Before a cell's examples: raise Unsupported, or a Violation when the engine fails to start."""

    def start_estimate_s(self, cell: Cell) -> float:
        """Seconds `start(cell)` is expected to take (0: nothing to start, or already up): a
        sequential campaign keeps them aside for the cells not yet started."""
        return 0.0

    def prestart(self, cell: Cell) -> None:
        """A sequential campaign's next cell, named while the current one is fuzzed: a target
        may start its engine now, in the background (vLLM: VLLMRunner.prestart)."""

    def starting(self, cell: Cell) -> bool:
        """Whether `cell`'s engine is still starting in the background (`prestart`): the
        campaign goes on fuzzing the current cell meanwhile rather than wait for it."""
        return False

    def triage(self, violation, earlier: list) -> str:
        """'new' (minimize and write it), 'known' (count it, no reproducer) or 'repeat' (a
        property this cell already reported: count it). `earlier`: the cell's Failures."""
        return "new"

    def ends_cell(self, violation) -> bool:
        """Whether a failure ends the cell it was found in (an engine that crashed)."""
        return False

    def checked(self, verdict) -> bool:
        """Whether a passing Verdict counts as an example (False: the Case was not run, e.g.
        past the campaign's deadline; `record` counts it apart)."""
        return True

    def record(self, stats, verdict) -> None:
        """Add what a passing Verdict measured to its row's `stats.notes`."""

    def cell_done(self, cell: Cell, stats) -> None:
        """After a cell: add its costs (engine starts) to `stats.notes`."""

    def describe(self) -> str:
        return self.name

    def summary_json(self, summary) -> dict | None:
        """The campaign's summary (fuzz.campaign.summary.Summary) as this target reports it (None: its own form)."""
        return None

    def summary_table(self, summary) -> str | None:
        return None

    def close(self) -> None:
        pass
