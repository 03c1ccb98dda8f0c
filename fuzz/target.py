"""The target interface: what one campaign (fuzz.campaign), one minimizer (fuzz.shrink) and
one reproducer writer (fuzz.reproduce) need of an engine under test.

A target gives
- `cells()`: the cells a campaign visits, each a Hypothesis strategy of Cases (reference:
  one per layout, modes drawn within; vLLM: one per planned config, one engine each);
- `check(case) -> Verdict` (fuzz.harness.Verdict), or raises a fuzz.properties.Violation;
- `simpler(case)`: candidate simpler Cases for the minimizer, most aggressive first;
- `reproducer_meta(case, violation)`: extra top-level JSON fields for its reproducer;
and a few policies a campaign asks about (defaults: the reference engine's). Targets:
`HarnessTarget` here (the white-box Harness, wrapped; its behaviour is the Harness's) and
`fuzz.targets.vllm_fuzz.VLLMFuzzTarget`.
"""
from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from hypothesis.database import ExampleDatabase


@dataclass(frozen=True)
class Cell:
    name: str  # progress lines and the nightly database's key
    strategy: Any  # a Hypothesis strategy of Cases
    data: Any = None  # the target's own (vLLM: the config and options the engine starts with)


# -- what a campaign reports (targets add their measurements: Target.record, cell_done) -------

@dataclass
class CellStats:
    examples: int = 0
    seconds: float = 0.0
    engine_seconds: float = 0.0
    failures: int = 0
    stopped: str = ""  # why the cell ended early (a crash, a known failure, an engine that refused it)
    unsupported: str = ""  # the engine refused the cell's config by design
    known: list = field(default_factory=list)  # signatures of known failures met
    repeats: int = 0  # failures of a property the cell had already reported (not written again)
    notes: dict = field(default_factory=dict)  # what the target measured (Target.record, cell_done)


@dataclass
class Failure:
    property: str
    message: str
    case_desc: str
    path: str
    error_ratio: float | None
    oracle: str | None = None  # what the failing run was compared against
    second_opinion: str | None = None
    cell: str | None = None  # the cell it was found in
    meta: dict = field(default_factory=dict)  # the target's: signature, shrink checks
    # When and how small (fuzz.findings): seconds from the campaign's start and examples run
    # before the first failing example; the reproducer's size; whether the minimizer reached
    # a fixpoint; seconds spent minimizing it (in the campaign and the shrink phase).
    seconds_to_find: float | None = None
    examples_before: int | None = None
    size: dict | None = None
    minimal: bool | None = None
    shrink_seconds: float = 0.0


@dataclass
class Summary:
    examples: int = 0
    seconds: float = 0.0
    cells: dict = field(default_factory=dict)  # (layout, mode) -> CellStats
    failures: list = field(default_factory=list)
    interrupted: bool = False
    first_failure_s: float | None = None  # time and examples until the first failure was seen
    first_failure_examples: int | None = None
    write_errors: int = 0  # failures that could not be written (their Case went to stderr)
    duplicates: int = 0  # Cases drawn again after they passed: skipped, not counted as examples
    planned: list = field(default_factory=list)  # the target's cells, in visiting order
    budget_s: float = 0.0
    seed: int = 0
    target: Any = field(default=None, repr=False)  # renders it where it has its own form (vLLM's)
    # `run --jobs N` (fuzz.jobs): the worker processes, and failures a worker found whose
    # reproducer another had already written (counted, not written twice). Per worker: its
    # cells, examples, exit and, for one that crashed, its error and the files it left.
    jobs: int = 1
    repeats: int = 0
    workers: list = field(default_factory=list)

    def to_json(self) -> dict:
        own = self.target.summary_json(self) if self.target is not None else None
        if own is not None:
            return own
        return {
            "examples": self.examples, "failures": len(self.failures),
            "layouts": sorted({k[0] for k in self.cells}), "modes": sorted({k[1] for k in self.cells}),
            "seconds": round(self.seconds, 2), "reproducers": [f.path for f in self.failures],
            "failure_details": [{k: v for k, v in f.__dict__.items() if k not in ("cell", "meta")}
                                for f in self.failures],
            "per_cell": {f"{k[0]}/{k[1]}": {"examples": c.examples, "failures": c.failures,
                                             "examples_per_s": round(c.examples / c.seconds, 2) if c.seconds else None}
                         for k, c in sorted(self.cells.items())},
            "interrupted": self.interrupted, "write_errors": self.write_errors,
            "duplicates_skipped": self.duplicates, "jobs": self.jobs, "repeats": self.repeats,
            **({"workers": self.workers} if self.workers else {}),
        }

    def table(self) -> str:
        own = self.target.summary_table(self) if self.target is not None else None
        if own is not None:
            return own
        rows = [f"{'layout':<10}{'mode':<7}{'examples':>9}{'ex/s':>8}{'failures':>10}"]
        for (lay, mode), c in sorted(self.cells.items()):
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            rows.append(f"{lay:<10}{mode:<7}{c.examples:>9}{rate:>8}{c.failures:>10}")
        rows.append(f"{'total':<17}{self.examples:>9}{self.examples / max(self.seconds, 1e-9):>8.2f}"
                    f"{len(self.failures):>10}")
        return "\n".join(rows)


class CellDatabase(ExampleDatabase):
    """The example database as one (layout, modes, faults) cell sees it. Hypothesis keys
    saved examples by the test function, the same for every cell; here every key also
    carries the cell's digest, so a saved failure is replayed only in its own cell, as the
    kind of Case it was drawn as. Any database works underneath (the nightly's directory)."""

    def __init__(self, db: ExampleDatabase, cell: bytes) -> None:
        super().__init__()
        self.db, self.prefix = db, hashlib.sha256(cell).hexdigest()[:20].encode() + b"/"

    def save(self, key: bytes, value: bytes) -> None:
        self.db.save(self.prefix + key, value)

    def fetch(self, key: bytes):
        return self.db.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.db.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.db.move(self.prefix + src, self.prefix + dest, value)


class Unsupported(Exception):
    """The engine refuses a cell's config by design (not a failure): the cell is skipped."""


class Target(abc.ABC):
    """Base class: the interface, with the reference engine's policies as defaults."""

    name = "reference"
    sequential = False  # False: one chunk per cell, round robin; True: each cell for a share of the budget
    hypothesis_shrinks = True  # False where each check is too dear to shrink (an engine restart per crash)
    confirm_before_shrink = True  # re-run a failure once before minimizing (a flaky one has nothing to shrink)
    max_shrink_checks = 80
    unit = "layouts"  # what the progress line counts the cells as

    @abc.abstractmethod
    def cells(self) -> list[Cell]:
        """The cells a campaign visits, in order."""

    @abc.abstractmethod
    def check(self, case):
        """Verdict of `case`, or raise the Violation it shows."""

    def simpler(self, case) -> Iterable:
        from fuzz.shrink import candidates

        return candidates(case)

    def reproducer_meta(self, case, violation) -> dict:
        return {}

    def stats_key(self, case) -> tuple:
        """The summary row a Case's examples and failures count in."""
        return case.layout, case.mode

    def start(self, cell: Cell) -> None:
        """Before a cell's examples: raise Unsupported, or a Violation when the engine fails to start."""

    def triage(self, violation, earlier: list) -> str:
        """'new' (minimize and write it), 'known' (count it, no reproducer) or 'repeat' (a
        property this cell already reported: count it). `earlier`: the cell's Failures."""
        return "new"

    def ends_cell(self, violation) -> bool:
        """Whether a failure ends the cell it was found in (an engine that crashed)."""
        return False

    def record(self, stats, verdict) -> None:
        """Add what a passing Verdict measured to its row's `stats.notes`."""

    def cell_done(self, cell: Cell, stats) -> None:
        """After a cell: add its costs (engine starts) to `stats.notes`."""

    def describe(self) -> str:
        return self.name

    def summary_json(self, summary: Summary) -> dict | None:
        """The campaign's summary as this target reports it (None: Summary's own form)."""
        return None

    def summary_table(self, summary: Summary) -> str | None:
        return None

    def close(self) -> None:
        pass


class HarnessTarget(Target):
    """Our engine through the white-box Harness (fuzz.harness), which it leaves as it is."""

    def __init__(self, harness, layouts=(), modes=("eager",), faults=(), base=None, max_requests: int = 10) -> None:
        self.harness = harness
        self.layouts, self.modes, self.faults = tuple(layouts), tuple(modes), tuple(faults)
        self.base, self.max_requests = base, max_requests

    def cells(self) -> list[Cell]:
        from fuzz.strategies import cases

        # The database key is the (layout, modes, faults) cell as repr'd since nightly began:
        # saved failures stay where they were saved.
        return [Cell(repr((lay, self.modes, self.faults)),
                     cases((lay,), self.modes, self.faults, self.base, self.max_requests), lay)
                for lay in self.layouts]

    def check(self, case):
        return self.harness.check(case)

    def describe(self) -> str:
        return f"{len(self.layouts)} layout(s), modes {','.join(self.modes)}"

    def close(self) -> None:
        self.harness.close()
