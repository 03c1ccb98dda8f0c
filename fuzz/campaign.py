"""Campaign: a time-budgeted Hypothesis run over Cases, with progress, stats and reproducers.

The campaign goes round the layouts, one chunk of a few examples each. `_find` runs
Hypothesis on one chunk (a fresh seed each, or the example database in nightly mode) and
returns the failures it found, shrunk as far as Hypothesis got; `_finish` minimizes each one
further, writes it, records it and prints it. The campaign goes on (or stops, with
`stop_on_failure`, as selftest does). `_persist` is the one writer of reproducers: the first
failure of a chunk is on disk the moment it is seen, so nothing is lost if the campaign is
killed mid-shrink, and the final version replaces it.
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
from hypothesis.database import ExampleDatabase

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
        # The clock, started by `run`: the budget's end, and the hard deadline a bounded grace
        # past it, where shrinking (which may overrun the budget) stops with what it has.
        self._grace_s = shrink_grace_s if shrink_grace_s is not None else max(60.0, 0.5 * budget_s)
        self._t0 = self._deadline = self._hard_deadline = 0.0
        # The failure `_find` is after: the last (smallest) version Hypothesis has shown us,
        # and the file an unfinished failure is on disk as until `_finish` replaces it.
        self._best: Violation | None = None
        self._unfinished_path: str | None = None

    def _body(self, case) -> None:
        check_stop()
        if self.fault_scope != case.fault_scope:
            case = dataclasses.replace(case, fault_scope=self.fault_scope)
        now = time.monotonic()
        if now > self._hard_deadline or (now > self._deadline and self._best is None):
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
            self._seen(v)
            raise
        finally:
            cell.examples += 1
            cell.seconds += time.perf_counter() - t0
            self.summary.examples += 1
            self._print_progress()

    def _seen(self, v: Violation) -> None:
        """Hypothesis saw `v` fail: found, or a smaller version while shrinking. The first is
        on disk at once, before shrinking: nothing is lost if the campaign is killed mid-shrink."""
        if self.summary.first_failure_s is None:
            self.summary.first_failure_s = time.monotonic() - self._t0
            self.summary.first_failure_examples = self.summary.examples + 1
        first, self._best = self._best is None, v
        if first:
            self._persist(v, final=False)

    def _hypothesis_test(self, layout: str, i: int):
        """Chunk `i` on `layout` as a Hypothesis test. Nightly (`use_database` and a database
        in the profile): random, and the example database replays the cell's saved failures
        first. Otherwise a seed per chunk (which turns the database off): reproducible."""
        strat = cases((layout,), self.modes, self.faults, self.base, self.max_requests)
        # Hypothesis runs the simplest Case first in every run (one short request, tp-only
        # options off): one extra example per chunk keeps `chunk` drawn ones. After the first
        # rotation the simplest Case is a skipped duplicate.
        s = settings(max_examples=self.chunk + 1)
        db = settings.default.database
        nightly = db is not None and self.use_database
        if nightly:
            s = settings(s, database=CellDatabase(db, repr((layout, self.modes, self.faults)).encode()))

        def body(case):
            return self._body(case)
        test = s(given(strat)(body))
        return test if nightly else hseed(self.seed * 100003 + i)(test)

    def _find(self, layout: str, i: int) -> tuple[list[Violation], bool]:
        """Run chunk `i` on `layout`: the failures found, as small as Hypothesis got them, and
        whether a stop (SIGINT/SIGTERM) ended the chunk. When a stop, or our hard deadline
        (late replays pass: Hypothesis calls that flaky), cuts the shrink short, the smallest
        failure seen so far. Every exception Hypothesis raises is handled here."""
        self._best, found, stopped = None, [], False
        try:
            self._hypothesis_test(layout, i)()
        except Violation as v:
            found = [v]
        except KeyboardInterrupt:
            stopped = True
        except BaseExceptionGroup as g:  # several failures, or Hypothesis's FlakyFailure
            vs, rest = g.split(Violation)
            # A Ctrl-C grouped with failures still stops the run.
            stopped = rest is not None and rest.subgroup(KeyboardInterrupt) is not None
            if vs is None and self._best is None and not stopped:
                raise
            found = _leaves(vs)
        except Exception:  # Hypothesis gave up mid-shrink: keep the smallest failure seen
            if self._best is None:
                raise
        if not found and self._best is not None:
            found = [self._best]
        self._best = None
        return found, stopped

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

    def _persist(self, v: Violation, *, final: bool) -> str | None:
        """The one writer of reproducers: write `v` atomically, then remove the file of the
        unfinished failure it supersedes (never one already recorded). `final`: `v` is
        finished and its file stays; otherwise the next `_persist` replaces it."""
        path = self._write(v)
        old, self._unfinished_path = self._unfinished_path, None if final else path
        if old and old != path and os.path.exists(old) and all(f.path != old for f in self.summary.failures):
            os.unlink(old)
        return path

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

    def _finish(self, v: Violation, shrink: bool = True) -> bool:
        """A failure found: minimize it further (unless `shrink` is off or the hard deadline
        passed), write it once, record it in the summary, print it. True when a stop
        (SIGINT/SIGTERM) arrived while minimizing: the smallest version so far is written."""
        stopped = False
        if shrink and time.monotonic() < self._hard_deadline:
            v, stopped = self._minimize(v)
        path = self._persist(v, final=True)
        case = v.case
        if path is None or not any(f.path == path for f in self.summary.failures):
            self.summary.failures.append(Failure(v.property, v.message, case.describe(), path, v.error_ratio,
                                                 v.oracle, v.second_opinion))
            self.summary.cells.setdefault((case.layout, case.mode), CellStats()).failures += 1
        if self.progress:
            by = f" (against {v.oracle})" if v.oracle else ""
            sys.stderr.write(f"\nFOUND {v.property}{by}: {v.message}\n  {case.describe()}\n  -> {path}\n")
        return stopped

    def _minimize(self, v: Violation) -> tuple[Violation, bool]:
        """Hypothesis shrank within one layout; try simpler layouts and options too. The
        smallest version that fails the same way (same property and oracle), and whether a
        stop cut the search short (it keeps what it had)."""
        best = [v]

        def still_fails(case) -> bool:
            check_stop()
            if time.monotonic() > self._hard_deadline:
                return False
            try:
                self.harness.check(case)
            except Violation as w:
                if (w.property, w.oracle) == (v.property, v.oracle):
                    best[0] = w
                    return True
            return False

        try:
            # A failure that does not happen again (a rank killed from outside, a flaky host)
            # has no simpler version to find: one re-run instead of up to 80 passing candidates.
            if still_fails(v.case):
                minimize(v.case, still_fails, max_checks=80)
        except KeyboardInterrupt:
            return best[0], True
        return best[0], False

    def run(self) -> Summary:
        self._t0 = time.monotonic()
        self._deadline = self._t0 + self.budget_s
        self._hard_deadline = self._deadline + self._grace_s
        _STOP.clear()  # a stop belongs to the run it interrupted (tests call main() in-process)
        try:  # from here on, an interrupt still prints the summary and closes our harness
            sys.stderr.write(f"llmfuzz: campaign started: {len(self.layouts)} layout(s), "
                             f"modes {','.join(self.modes)}, budget {self.budget_s:.0f}s\n")
            sys.stderr.flush()
            i = 0
            while time.monotonic() < self._deadline:
                check_stop()
                # One layout per chunk, round robin: every layout gets its turn early.
                found, stopped = self._find(self.layouts[i % len(self.layouts)], i)
                i += 1
                for v in found:  # after a stop, the rest are written as they are
                    stopped = self._finish(v, shrink=not stopped) or stopped
                if stopped:
                    self.summary.interrupted = True
                    break
                if self.stop_on_failure and self.summary.failures:
                    break
        except KeyboardInterrupt:
            self.summary.interrupted = True
        finally:
            self.summary.seconds = time.monotonic() - self._t0
            self._print_progress(force=True)
            if self.progress:
                sys.stderr.write("\n")
            if self._own_harness:
                self.harness.close()
        return self.summary
