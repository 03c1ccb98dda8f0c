"""Campaign: a time-budgeted Hypothesis run over Cases, with progress, stats and reproducers.

The one campaign loop for every target (fuzz.target: our engine, vLLM). It goes round the
target's cells (layouts), one chunk of a few examples each, or visits each cell of a
`sequential` target (vLLM: an engine start per cell) once for its share of the budget.
`_find` runs Hypothesis on one chunk (a fresh seed each, or the example database in nightly
mode) and returns the failures it found, shrunk as far as Hypothesis got; `_finish`
minimizes each one further (fuzz.shrink, with the target's candidates), writes it, records
it and prints it. The campaign goes on (or stops, with
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

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, target

from fuzz.harness import Harness, pool_capacity_for
from fuzz.isolated import make_harness
from fuzz.properties import Violation
from fuzz.reproduce import write_reproducer
from fuzz.shrink import Shrinker, minimize
from fuzz.strategies import FUZZ_MODEL
from fuzz.target import (Cell, CellDatabase, CellStats, Failure, HarnessTarget, Summary,  # noqa: F401 (re-exported)
                         Target, Unsupported)


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
    def __init__(self, *, layouts=(), modes=("eager",), faults=(), seed: int = 0, out_dir: str = "reproducers",
                 budget_s: float = 60.0, chunk: int = 8, stop_on_failure: bool = False,
                 progress: bool = True, base=FUZZ_MODEL, max_requests: int = 10,
                 harness: Harness | None = None, use_database: bool = False,
                 shrink_grace_s: float | None = None, isolate: str = "auto",
                 oracles: frozenset[str] = frozenset(), fault_scope: str = "test",
                 target: Target | None = None, shrink_s: float | None = None, min_cell_s: float = 60.0) -> None:
        self.fault_scope = fault_scope  # "everywhere": the faults are in every run (selftest --everywhere)
        self.use_database = use_database
        self.owns_target = harness is None and target is None  # closed by `run`; given ones are the caller's
        if target is None:
            # Without a harness given, one of our own (isolated on CUDA, as `make_harness` says),
            # its engine pool sized for these layouts and modes.
            harness = harness or make_harness(base.device, isolate,
                                              pool_capacity_for(len(layouts), len(modes)), oracles)
            target = HarnessTarget(harness, layouts, modes, faults, base, max_requests)
        self.target, self.cells, self.harness = target, target.cells(), getattr(target, "harness", None)
        # Short budgets take short chunks, so the round robin reaches every cell.
        chunk = max(2, min(chunk, int(budget_s / (4 * max(1, len(self.cells))))))
        self.seed, self.out_dir, self.budget_s, self.chunk = seed, out_dir, budget_s, chunk
        self.stop_on_failure, self.progress = stop_on_failure, progress
        self.shrink_s, self.min_cell_s = shrink_s, min_cell_s  # per failure; a sequential cell's least
        self.summary = Summary(planned=[c.name for c in self.cells], budget_s=budget_s, seed=seed, target=target)
        self._last_print = 0.0
        # Cases that passed, by their JSON. Each chunk's Hypothesis run starts from the
        # simplest Case again and mutates earlier draws, so a short campaign draws many Cases
        # twice; a Case's verdict is deterministic, so a passed one is not run again. Failing
        # Cases are never skipped: Hypothesis's shrinker must see them fail.
        self._passed: set[bytes] = set()
        # The clock, started by `run`: the budget's end, and the hard deadline a bounded grace
        # past it, where shrinking (which may overrun the budget) stops with what it has.
        self._grace_s = shrink_grace_s if shrink_grace_s is not None else max(60.0, 0.5 * budget_s)
        self._t0 = self._deadline = self._hard_deadline = self._chunk_end = 0.0
        # The failure `_find` is after: the last (smallest) version Hypothesis has shown us,
        # and the file an unfinished failure is on disk as until `_finish` replaces it.
        self._best: Violation | None = None
        self._unfinished_path: str | None = None
        self._cell, self._row = None, None  # the cell being fuzzed (Cell), and its summary row

    def _body(self, case) -> None:
        check_stop()
        if self.fault_scope != case.fault_scope:
            case = dataclasses.replace(case, fault_scope=self.fault_scope)
        now = time.monotonic()
        if now > self._hard_deadline or (now > self._chunk_end and self._best is None):
            # Out of time: the rest of the chunk passes untested (not counted); a shrink in
            # progress stops and keeps the smallest failure seen so far.
            return
        if not self.target.hypothesis_shrinks and self._best is not None:
            raise self._best  # Hypothesis replays the failure it saw: not worth another engine run
        key = hashlib.sha1(case.key().encode()).digest()  # 20 bytes a Case: flat over long runs
        if key in self._passed:
            self.summary.duplicates += 1
            return
        t0 = time.perf_counter()
        cell = self.summary.cells.setdefault(self.target.stats_key(case), CellStats())
        try:
            v = self.target.check(case)
            target(min(v.logits.ratio, 1e6), label="error/tolerance")
            self.target.record(cell, v)
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
        if first and self._triage(v) == "new":
            self._persist(v, final=False)

    def _triage(self, v: Violation) -> str:
        return self.target.triage(v, [f for f in self.summary.failures if f.cell == self._cell.name])

    def _hypothesis_test(self, cell: Cell, i: int):
        """Chunk `i` on `cell` as a Hypothesis test. Nightly (`use_database` and a database
        in the profile): random, and the example database replays the cell's saved failures
        first. Otherwise a seed per chunk (which turns the database off): reproducible."""
        # Hypothesis runs the simplest Case first in every run (one short request, tp-only
        # options off): one extra example per chunk keeps `chunk` drawn ones. After the first
        # rotation the simplest Case is a skipped duplicate.
        s = settings(max_examples=self.chunk + 1)
        if not self.target.hypothesis_shrinks:  # the minimizer shrinks, within its deadline
            s = settings(s, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                         suppress_health_check=list(HealthCheck))
        db = settings.default.database
        nightly = db is not None and self.use_database and self.target.hypothesis_shrinks
        if nightly:
            s = settings(s, database=CellDatabase(db, cell.name.encode()))

        def body(case):
            return self._body(case)
        test = s(given(cell.strategy)(body))
        return test if nightly else hseed(self.seed * 100003 + i)(test)

    def _find(self, cell: Cell, i: int, end: float) -> tuple[list[Violation], bool]:
        """Run chunk `i` on `cell` until `end`: the failures found, as small as Hypothesis got
        them, and whether a stop (SIGINT/SIGTERM) ended the chunk. When a stop, or our hard
        deadline (late replays pass: Hypothesis calls that flaky), cuts the shrink short, the
        smallest failure seen so far. Every exception Hypothesis raises is handled here."""
        self._best, found, stopped, self._chunk_end = None, [], False, end
        try:
            self._hypothesis_test(cell, i)()
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
                                    v.oracle, v.second_opinion, self.target.reproducer_meta(v.case, v))
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
                f"{self.target.unit} {len({k[0] for k in s.cells})}/{len(self.cells)} failures {len(s.failures)}")
        sys.stderr.write("\r" + line if tty else line + "\n")
        sys.stderr.flush()

    def _finish(self, v: Violation, shrink: bool = True) -> bool:
        """A failure found: triage it (a known one or a repeat is counted, not written);
        minimize it further (unless `shrink` is off or the hard deadline passed), write it
        once, record it in the summary, print it. True when a stop (SIGINT/SIGTERM) arrived
        while minimizing: the smallest version so far is written."""
        stopped, checks, verdict = False, 0, self._triage(v)
        if verdict != "new":
            self._skip(v, verdict)
            return False
        if shrink and time.monotonic() < self._hard_deadline:
            v, stopped, checks = self._minimize(v)
        path = self._persist(v, final=True)
        case = v.case
        if path is None or not any(f.path == path for f in self.summary.failures):
            self.summary.failures.append(Failure(v.property, v.message, case.describe(), path, v.error_ratio,
                                                 v.oracle, v.second_opinion, self._cell.name,
                                                 {"signature": getattr(v, "signature", None), "shrink_checks": checks,
                                                  "row": self.target.stats_key(case)[0]}))
            self.summary.cells.setdefault(self.target.stats_key(case), CellStats()).failures += 1
        if self.target.ends_cell(v):
            self._row.stopped = f"crashed ({v.property}: {getattr(v, 'signature', None)})"
        if self.progress:
            by = f" (against {v.oracle})" if v.oracle else ""
            sys.stderr.write(f"\nFOUND {v.property}{by}: {v.message}\n  {case.describe()}\n  -> {path}\n")
        return stopped

    def _skip(self, v: Violation, verdict: str) -> None:
        if verdict == "repeat":
            self._row.repeats += 1
            return
        sig = getattr(v, "signature", None)  # a known crash would only be met again: the cell ends
        self._row.known.append(sig)
        self._row.stopped = f"known failure {sig}"

    def _minimize(self, v: Violation) -> tuple[Violation, bool, int]:
        """Hypothesis shrank within one cell; try the target's simpler Cases (layouts, options,
        configs) too. The smallest version that fails the same way (same property, oracle and
        signature), whether a stop cut the search short (it keeps what it had), and the checks."""
        sh = Shrinker(v, self.target.check, before=check_stop)
        deadline = self._hard_deadline
        if self.shrink_s is not None:
            deadline = min(deadline, time.monotonic() + self.shrink_s)
        try:
            checks = 0
            # A failure that does not happen again (a rank killed from outside, a flaky host)
            # has no simpler version to find: one re-run instead of up to 80 passing candidates.
            if not self.target.confirm_before_shrink or sh.still_fails(v.case):
                _, checks = minimize(v.case, sh.still_fails, self.target.max_shrink_checks, deadline,
                                     self.target.simpler)
        except KeyboardInterrupt:
            return sh.best, True, checks
        return sh.best, False, checks

    def _visit(self, cell: Cell, row: CellStats, i: int, end: float) -> bool:
        """One chunk on `cell`, its failures finished. True when the campaign should stop."""
        self._cell, self._row = cell, row
        found, stopped = self._find(cell, i, end)
        for v in found:  # after a stop, the rest are written as they are
            stopped = self._finish(v, shrink=not stopped) or stopped
        if stopped:
            self.summary.interrupted = True
            return True
        return self.stop_on_failure and bool(self.summary.failures)

    def _run_round_robin(self) -> None:
        i = 0
        while time.monotonic() < self._deadline:
            check_stop()
            # One cell per chunk, round robin: every layout gets its turn early. A layout's
            # summary rows are per mode (stats_key), and a round-robin target never ends, skips
            # or repeats a cell: its own row is a scratch one.
            if self._visit(self.cells[i % len(self.cells)], CellStats(), i, self._deadline):
                return
            i += 1

    def _run_sequential(self) -> None:
        """Each cell once, in order: its share of the time left (start-up included), and at
        least min(min_cell_s, budget) of examples once started. A cell's costs are added to
        its row however it ends (Target.cell_done)."""
        for ci, cell in enumerate(self.cells):
            now = time.monotonic()
            if now >= self._deadline:
                return
            share = (self._deadline - now) / (len(self.cells) - ci)
            row = self.summary.cells.setdefault(self.target.stats_key(cell.data), CellStats())
            try:
                if not self._start(cell, row):
                    continue
                end, j = max(now + share, time.monotonic() + min(self.min_cell_s, self.budget_s)), 0
                while time.monotonic() < end and not row.stopped:
                    check_stop()
                    if self._visit(cell, row, ci * 1009 + j, end):
                        return
                    j += 1
            finally:
                self.target.cell_done(cell, row)

    def _start(self, cell: Cell, row: CellStats) -> bool:
        """Start a sequential cell's engine: False when it is refused (unsupported) or fails
        to start (a failure, recorded without minimizing: every check would restart it)."""
        self._cell, self._row = cell, row
        if self.progress:
            sys.stderr.write(f"llmfuzz: cell {cell.name}: starting\n")
        try:
            self.target.start(cell)
            return True
        except Unsupported as e:
            row.unsupported = row.stopped = str(e)[:500]
        except Violation as v:
            self._finish(v, shrink=False)
            row.stopped = f"engine did not start ({getattr(v, 'signature', v.property)})"
        return False

    def run(self) -> Summary:
        self._t0 = time.monotonic()
        self._deadline = self._t0 + self.budget_s
        self._hard_deadline = self._deadline + self._grace_s
        _STOP.clear()  # a stop belongs to the run it interrupted (tests call main() in-process)
        try:  # from here on, an interrupt still prints the summary and closes our target
            sys.stderr.write(f"llmfuzz: campaign started: {self.target.describe()}, "
                             f"budget {self.budget_s:.0f}s\n")
            sys.stderr.flush()
            if self.target.sequential:
                self._run_sequential()
            else:
                self._run_round_robin()
        except KeyboardInterrupt:
            self.summary.interrupted = True
        finally:
            self.summary.seconds = time.monotonic() - self._t0
            self._print_progress(force=True)
            if self.progress:
                sys.stderr.write("\n")
            if self.owns_target:
                self.target.close()
        return self.summary
