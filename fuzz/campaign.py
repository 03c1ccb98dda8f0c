"""Campaign: a time-budgeted Hypothesis run over Cases, with progress, stats and reproducers.

Hypothesis runs in chunks of a few examples with fresh seeds until the budget is spent.
A failure is shrunk by Hypothesis, written atomically as a reproducer, and the campaign
goes on (or stops, with `stop_on_failure`, as selftest does).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from hypothesis import given, seed as hseed, settings, target

from fuzz.harness import Harness, pool_capacity_for
from fuzz.isolated import make_harness
from fuzz.properties import Violation
from fuzz.reproduce import write_reproducer
from fuzz.shrink import minimize
from fuzz.strategies import FUZZ_MODEL, cases


# Set by the signal handler next to the KeyboardInterrupt it raises. The exception alone can be
# lost: a signal that lands inside a gc callback (Hypothesis >= 6.170 installs one) or a
# __del__ is printed as "Exception ignored" and dropped, and the campaign ran on to its budget.
# Every example and shrink step checks the flag, so a lost interrupt costs at most one Case.
_STOP = threading.Event()


def request_stop() -> None:
    _STOP.set()


def check_stop() -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt


@dataclass
class CellStats:
    examples: int = 0
    seconds: float = 0.0
    engine_seconds: float = 0.0
    failures: int = 0


@dataclass
class Failure:
    property: str
    message: str
    case_desc: str
    path: str
    error_ratio: float | None
    oracle: str | None = None  # what the failing run was compared against
    second_opinion: str | None = None


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

    def to_json(self) -> dict:
        return {
            "examples": self.examples, "failures": len(self.failures),
            "layouts": sorted({k[0] for k in self.cells}), "modes": sorted({k[1] for k in self.cells}),
            "seconds": round(self.seconds, 2), "reproducers": [f.path for f in self.failures],
            "failure_details": [f.__dict__ for f in self.failures],
            "per_cell": {f"{k[0]}/{k[1]}": {"examples": c.examples, "failures": c.failures,
                                             "examples_per_s": round(c.examples / c.seconds, 2) if c.seconds else None}
                         for k, c in sorted(self.cells.items())},
            "interrupted": self.interrupted, "write_errors": self.write_errors,
            "duplicates_skipped": self.duplicates,
        }

    def table(self) -> str:
        rows = [f"{'layout':<10}{'mode':<7}{'examples':>9}{'ex/s':>8}{'failures':>10}"]
        for (lay, mode), c in sorted(self.cells.items()):
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            rows.append(f"{lay:<10}{mode:<7}{c.examples:>9}{rate:>8}{c.failures:>10}")
        rows.append(f"{'total':<17}{self.examples:>9}{self.examples / max(self.seconds, 1e-9):>8.2f}"
                    f"{len(self.failures):>10}")
        return "\n".join(rows)


def _leaves(g: BaseExceptionGroup | None) -> list:
    """The Violations inside a (possibly nested) exception group, first of each property."""
    out, seen = [], set()
    stack = list(g.exceptions) if g is not None else []
    while stack:
        e = stack.pop(0)
        if isinstance(e, BaseExceptionGroup):
            stack[:0] = list(e.exceptions)
        elif isinstance(e, Violation) and (e.property, e.message) not in seen:
            seen.add((e.property, e.message))
            out.append(e)
    return out


class Campaign:
    def __init__(self, *, layouts, modes=("eager",), faults=(), seed: int = 0, out_dir: str = "reproducers",
                 budget_s: float = 60.0, chunk: int = 8, stop_on_failure: bool = False,
                 progress: bool = True, base=FUZZ_MODEL, max_requests: int = 10,
                 harness: Harness | None = None, use_database: bool = False,
                 shrink_grace_s: float | None = None, isolate: str = "auto",
                 oracles: frozenset[str] = frozenset(), fault_scope: str = "test") -> None:
        self.fault_scope = fault_scope  # "everywhere": the faults are in every run (selftest --everywhere)
        self.shrink_grace_s = shrink_grace_s  # shrinking past the budget; None: max(60 s, budget / 2)
        self.use_database = use_database
        self.layouts, self.modes, self.faults = tuple(layouts), tuple(modes), tuple(faults)
        # Short budgets take short chunks, so the round robin reaches every layout.
        chunk = max(2, min(chunk, int(budget_s / (4 * max(1, len(self.layouts))))))
        self.seed, self.out_dir, self.budget_s, self.chunk = seed, out_dir, budget_s, chunk
        self.stop_on_failure, self.progress = stop_on_failure, progress
        self.base, self.max_requests = base, max_requests
        self.summary = Summary()
        # Without a harness given, one of our own (isolated on CUDA, as `make_harness` says),
        # its engine pool sized for these layouts and modes.
        self.harness = harness or make_harness(base.device, isolate,
                                               pool_capacity_for(len(self.layouts), len(self.modes)), oracles)
        self._own_harness = harness is None
        self._last_print = 0.0
        # Cases that passed, by their JSON. Each chunk's Hypothesis run starts from the
        # simplest Case again and mutates earlier draws, so a short campaign draws many Cases
        # twice; a Case's verdict is deterministic, so a passed one is not run again. Failing
        # Cases are never skipped: Hypothesis's shrinker must see them fail.
        self._passed: set[bytes] = set()

    def _body(self, case) -> None:
        check_stop()
        if self.fault_scope != case.fault_scope:
            case = dataclasses.replace(case, fault_scope=self.fault_scope)
        now = time.monotonic()
        if now > self._hard_deadline or (now > self._deadline and self._smallest is None):
            # Out of time: the rest of the chunk passes untested (not counted); a shrink in
            # progress stops and keeps the smallest failure seen so far.
            return
        key = hashlib.sha1(case.key().encode()).digest()  # 20 bytes a Case: flat over long runs
        if key in self._passed:
            self.summary.duplicates += 1
            return
        t0 = time.perf_counter()
        cell = self.summary.cells.setdefault((case.layout, case.mode), CellStats())
        try:
            v = self.harness.check(case)
            target(min(v.logits.ratio, 1e6), label="error/tolerance")
            self._passed.add(key)
        except Violation as v:
            self._on_failure(v)
            raise
        finally:
            cell.examples += 1
            cell.seconds += time.perf_counter() - t0
            self.summary.examples += 1
            self._print_progress()

    def _write(self, v: Violation) -> str | None:
        """Write a reproducer; when the disk is full or the directory unwritable, print the
        Case in full instead, so the failure is not lost, and remember it for the exit code."""
        try:
            return write_reproducer(self.out_dir, v.case, v.property, v.message, v.error_ratio,
                                    v.oracle, v.second_opinion)
        except OSError as e:
            self.summary.write_errors += 1
            sys.stderr.write(f"\nllmfuzz: cannot write reproducer to {self.out_dir} ({e.strerror or e}); "
                             f"the failing Case follows as JSON:\n{v.case.to_json()}\n")
            sys.stderr.flush()
            return None

    def _on_failure(self, v: Violation) -> None:
        """A failure is on disk the moment it is seen, before shrinking: nothing is lost if
        the campaign is killed mid-shrink. Shrunk versions replace it."""
        if self.summary.first_failure_s is None:
            self.summary.first_failure_s = time.monotonic() - self._t0
            self.summary.first_failure_examples = self.summary.examples + 1
        if self._first_path is None:
            self._first_path = self._write(v)
        self._smallest = v

    def _print_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        tty = sys.stderr.isatty()
        if not self.progress or (not force and now - self._last_print < (1.0 if tty else 15.0)):
            return
        self._last_print = now
        s, el = self.summary, now - self._t0
        done = min(20, int(20 * el / self.budget_s)) if self.budget_s else 20
        line = (f"[{'#' * done}{'.' * (20 - done)}] {el:5.0f}s/{self.budget_s:.0f}s "
                f"{s.examples} examples ({s.examples / max(el, 1e-9):.2f}/s) "
                f"layouts {len({k[0] for k in s.cells})}/{len(self.layouts)} failures {len(s.failures)}")
        sys.stderr.write("\r" + line if tty else line + "\n")
        sys.stderr.flush()

    def _record(self, v: Violation, minimize: bool = True) -> None:
        """Finish a failure: simplify the layout and the rest further, write it, drop the
        unshrunk file. An interrupt during minimizing writes the smallest case so far."""
        interrupted = False
        if minimize and time.monotonic() < self._hard_deadline:
            self._min_best = v
            try:
                v = self._minimize(v)
            except KeyboardInterrupt:
                v, interrupted = self._min_best, True
        case = v.case
        path = self._write(v)
        if self._first_path and self._first_path != path and os.path.exists(self._first_path):
            os.unlink(self._first_path)
        self._first_path, self._smallest = None, None
        if path is None or not any(f.path == path for f in self.summary.failures):
            self.summary.failures.append(Failure(v.property, v.message, case.describe(), path, v.error_ratio,
                                                 v.oracle, v.second_opinion))
            self.summary.cells.setdefault((case.layout, case.mode), CellStats()).failures += 1
        if self.progress:
            by = f" (against {v.oracle})" if v.oracle else ""
            sys.stderr.write(f"\nFOUND {v.property}{by}: {v.message}\n  {case.describe()}\n  -> {path}\n")
        if interrupted:
            raise KeyboardInterrupt

    def _minimize(self, v: Violation) -> Violation:
        """Hypothesis shrank within one layout; try simpler layouts and options too."""
        best = {"v": v}

        def still_fails(case) -> bool:
            check_stop()
            if time.monotonic() > self._hard_deadline:
                return False
            try:
                self.harness.check(case)
            except Violation as w:
                if (w.property, w.oracle) == (v.property, v.oracle):
                    best["v"] = self._min_best = w
                    return True
            return False

        # A failure that does not happen again (a rank killed from outside, a flaky host) has
        # no simpler version to find: one re-run instead of up to 80 passing candidates.
        if not still_fails(v.case):
            return v
        minimize(v.case, still_fails, max_checks=80)
        return best["v"]

    def run(self) -> Summary:
        self._t0 = time.monotonic()
        deadline = self._deadline = self._t0 + self.budget_s
        # Shrinking may run past the budget by a bounded grace, then stops with what it has.
        grace = self.shrink_grace_s if self.shrink_grace_s is not None else max(60.0, 0.5 * self.budget_s)
        self._hard_deadline = deadline + grace
        self._first_path, self._smallest = None, None
        i = 0
        _STOP.clear()  # a stop belongs to the run it interrupted (tests call main() in-process)
        try:  # from here on, an interrupt still prints the summary and closes our harness
            sys.stderr.write(f"llmfuzz: campaign started: {len(self.layouts)} layout(s), "
                             f"modes {','.join(self.modes)}, budget {self.budget_s:.0f}s\n")
            sys.stderr.flush()
            while time.monotonic() < deadline:
                check_stop()
                # One layout per chunk, round robin: every layout gets its turn early.
                layout = self.layouts[i % len(self.layouts)]
                strat = cases((layout,), self.modes, self.faults, self.base, self.max_requests)
                # Hypothesis runs the simplest Case first in every run (one short request,
                # tp-only options off): one extra example per chunk keeps `chunk` drawn ones.
                # After the first rotation the simplest Case is a skipped duplicate.
                n = self.chunk + 1
                def body(case):
                    return self._body(case)
                if settings.default.database is not None and self.use_database:
                    # Nightly: random, and the example database replays earlier failures first.
                    # One database key per layout/modes/faults, so a saved example is only ever
                    # replayed as the kind of Case it was drawn as.
                    body._hypothesis_internal_add_digest = repr((layout, self.modes, self.faults)).encode()
                    test = settings(max_examples=n)(given(strat)(body))
                else:
                    # Reproducible campaigns: a seed per chunk (which turns the database off).
                    test = hseed(self.seed * 100003 + i)(settings(max_examples=n)(given(strat)(body)))
                i += 1
                try:
                    test()
                except Violation as v:
                    self._record(v)
                except BaseExceptionGroup as g:  # several failures, or Hypothesis's FlakyFailure
                    vs, rest = g.split(Violation)
                    if vs is None and rest is not None:
                        raise
                    for v in _leaves(vs):
                        self._record(v)
                    self._smallest = None
                    if rest is not None and rest.subgroup(KeyboardInterrupt) is not None:
                        raise KeyboardInterrupt  # a Ctrl-C grouped with failures still stops the run
                except Exception:
                    # Hypothesis gave up mid-shrink (our time limit makes late replays pass,
                    # which it calls flaky): keep the smallest failure seen.
                    if self._smallest is None:
                        raise
                    self._record(self._smallest)
                if self._smallest is not None:
                    self._record(self._smallest)
                if self.stop_on_failure and self.summary.failures:
                    break
        except KeyboardInterrupt:
            self.summary.interrupted = True
            if self._smallest is not None:
                self._record(self._smallest, minimize=False)
        finally:
            self.summary.seconds = time.monotonic() - self._t0
            self._print_progress(force=True)
            if self.progress:
                sys.stderr.write("\n")
            if self._own_harness:
                self.harness.close()
        return self.summary
