"""Campaign: a time-budgeted Hypothesis run over Cases, with progress, stats and reproducers.

The one campaign loop for every target (fuzz.targets.base: our engine, vLLM). It goes round the
target's cells (layouts): a first round of one example each (every layout is visited before
any gets a second), then chunks of a few examples each, the next to the cell that has had the
least time; or it visits each cell of a
`sequential` target (vLLM: an engine start per cell) once for its share of the budget.
`_find` runs Hypothesis on one chunk (a fresh seed each, or the example database in nightly
mode) and returns the failures it found, shrunk as far as Hypothesis got within the budget;
`_finish` minimizes each one further within the budget (fuzz.campaign.shrink_phase, with the target's
candidates), writes it, records it and prints it. The campaign goes on (or stops, with
`stop_on_failure`, as selftest does). After the budget, the shrink phase finishes every
failure the budget cut short (fuzz.campaign.shrink_phase.ShrinkPhase, `shrink_budget_s`). `_persist`
and `_rewrite` are the writers of reproducers: the first failure of a chunk is on disk the
moment it is seen, so nothing is lost if the campaign is killed mid-shrink, and each smaller
version replaces the one before.

A chunk's seed is a function of (campaign seed, cell, the chunk's index on that cell) only
(`chunk_seed`), so a cell draws the same Cases alone in a worker of `llmfuzz run --jobs N`
(fuzz.campaign.jobs; `share`: its part of the campaign) as among all cells in one process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Callable

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, target

from fuzz.campaign.sequential import SequentialVisits
from fuzz.contention.command import enter_cell
from fuzz.contention.coprocs import active
from fuzz.campaign.replay_rate import TIMED_REPLAYS, replay_times
from fuzz.campaign.reproduce import load_reproducer, update_reproducer
from fuzz.campaign.findings import case_size
from fuzz.verdict.engine_pool import pool_capacity_for
from fuzz.verdict.harness import Harness
from fuzz.verdict.isolated import make_harness
from fuzz.verdict.properties import Violation
from fuzz.campaign.history import Histories, recording_check
from fuzz.campaign.settle import FreshRecorder, note_fresh, not_replayed
from fuzz.campaign.shrink_phase import Pending, Shrunk, ShrinkPhase, shrink_one
from fuzz.stop import check_stop, clear_stop, stop_requested
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.campaign.summary import CellDatabase, CellStats, Failure, Summary, drawn_events, note_example, visited
from fuzz.targets.base import Cell, Target
from fuzz.targets.reference import HarnessTarget


def chunk_seed(seed: int, cell: str, k: int) -> int:
    """The Hypothesis seed of chunk `k` on `cell`. Not Python's hash() (salted per process):
    every worker of a campaign, and every run with this seed, must agree on it."""
    digest = hashlib.sha256(f"{seed}\0{cell}\0{k}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _kind(v: Violation) -> tuple:
    """What makes two failures the same one (fuzz.verdict.properties.same_failure)."""
    return v.property, v.oracle, getattr(v, "signature", None)


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


class ShrinkOver(KeyboardInterrupt):
    """Raised through Hypothesis to end its shrink of a failure at the campaign's `shrink_s`.
    A KeyboardInterrupt: Hypothesis does not take it for a failure, and it is the one exception
    whose example Hypothesis does not save to the database (it saves the choices of any other
    that escapes a test, so a nightly run would later replay the shrink candidate that was
    about to run, often a passing Case, ahead of the saved failure). `_find` catches it before
    its KeyboardInterrupt clause."""


class Campaign(SequentialVisits):
    def __init__(self, *, layouts=(), modes=("eager",), faults=(), seed: int = 0, out_dir: str = "reproducers",
                 budget_s: float = 60.0, chunk: int | None = None, stop_on_failure: bool = False,
                 progress: bool = True, base=FUZZ_MODEL, max_requests: int = 10,
                 harness: Harness | None = None, use_database: bool = False,
                 shrink_grace_s: float | None = None, isolate: str = "auto",
                 oracles: frozenset[str] = frozenset(), fault_scope: str = "test",
                 target: Target | None = None, shrink_s: float | None = None, min_cell_s: float | None = None,
                 shrink_budget_s: float | None = None, keep_stop: bool = False, poison: str | None = None,
                 share=None, clock: Callable[[], float] = time.monotonic) -> None:
        # The campaign's clock: budgets, shares and deadlines are read on it. A test gives one it
        # controls, so what it asserts does not depend on how loaded the machine is.
        self.clock = clock
        self.fault_scope = fault_scope  # "everywhere": the faults are in every run (selftest --everywhere)
        self.poison = poison  # every Case's reset poison (engine/poison.py); None: drawn, alternating
        self.keep_stop = keep_stop  # a stop set before `run` stops it too (selftest: one stop for all faults)
        self.use_database = use_database
        self.owns_target = harness is None and target is None  # closed by `run`; given ones are the caller's
        if target is None:
            # Without a harness given, one of our own (isolated on CUDA, as `make_harness` says),
            # its engine pool sized for these layouts and modes.
            harness = harness or make_harness(base.device, isolate,
                                              pool_capacity_for(len(layouts), len(modes)), oracles)
            target = HarnessTarget(harness, layouts, modes, faults, base, max_requests)
        self.target, self.cells, self.harness = target, target.cells(), getattr(target, "harness", None)
        # A worker's part of a `run --jobs` campaign (fuzz.campaign.jobs_worker.Share): chunk sizes and
        # the first round are the whole campaign's, so its cells draw what they would in one process.
        self.share = share
        self.cells_total = share.cells_total if share is not None else len(self.cells)
        # What is not given here is the target's policy (fuzz.targets.base.Target). Short
        # budgets take short chunks, so the round robin reaches every cell.
        chunk = target.chunk if chunk is None else chunk
        chunk = max(2, min(chunk, int(budget_s / (4 * max(1, self.cells_total)))))
        self.seed, self.out_dir, self.budget_s, self.chunk = seed, out_dir, budget_s, chunk
        self.stop_on_failure, self.progress = stop_on_failure, progress
        # Per failure while finding (None: up to the end of finding); a sequential cell's least time.
        self.shrink_s = target.shrink_per_failure_s(budget_s) if shrink_s is None else shrink_s
        self.min_cell_s = target.min_cell_s if min_cell_s is None else min_cell_s
        self.summary = Summary(planned=[c.name for c in self.cells], budget_s=budget_s, seed=seed, target=target)
        self._last_print = 0.0
        # Cases that passed, by their JSON, with their error ratio. Each chunk's Hypothesis run
        # starts from the simplest Case again and mutates earlier draws, so a short campaign
        # draws many Cases twice; a Case's verdict is deterministic, so a passed one is not run
        # again. Failing Cases are never skipped: Hypothesis's shrinker must see them fail.
        self._passed: dict[bytes, float] = {}
        # The shrink phase after the budget (`shrink_grace_s`: another name for it).
        shrink_budget_s = shrink_budget_s if shrink_budget_s is not None else shrink_grace_s
        self.shrink_budget_s = shrink_budget_s if shrink_budget_s is not None else target.shrink_phase_s(budget_s)
        self.shrink_report: dict | None = None  # what the shrink phase did (None: it had nothing to do)
        self._pending: list[Pending] = []  # failures the budget cut short, for the shrink phase
        # The clock, started by `run`: the budget's end; a chunk may end later (a sequential
        # target's cell has a least time), and finding and shrinking within it stop at its end.
        self._t0 = self._deadline = self._chunk_end = 0.0
        # The failure `_find` is after: the last (smallest) version Hypothesis has shown us,
        # and the file an unfinished failure is on disk as until `_finish` replaces it.
        self._best: Violation | None = None
        self._shrink_end = float("inf")  # with `shrink_s`: where Hypothesis' shrink of `_best` stops
        self.recorder = FreshRecorder(out_dir, target, self.summary, progress,
                                      claims=share.claims if share is not None else None)
        # A target that keeps state: per cell, the Cases its engine served since it (re)started,
        # each Violation given those before its Case (fuzz.campaign.history); every check goes
        # through `_check`, the shrinker's too.
        self.histories = Histories()
        self._check = recording_check(target, self.histories, lambda: self._cell.name if self._cell else "")
        self._found: dict[tuple, tuple[float, int]] = {}  # per failure kind in the chunk: (seconds, examples before)
        self._cell, self._row = None, None  # the cell being fuzzed (Cell), and its summary row

    def _real(self, t: float) -> float:
        """Time `t` of the campaign's clock as a time.monotonic(), which the minimizer reads
        (fuzz.campaign.shrink): the same time left."""
        return time.monotonic() + (t - self.clock())

    def _find_end(self) -> float:
        """Where finding ends, and with it the shrinking a campaign does as it goes: the budget,
        or the end of a chunk that runs past it."""
        return max(self._deadline, self._chunk_end)

    def _body(self, case) -> None:
        check_stop()
        if self.fault_scope != case.fault_scope:
            case = dataclasses.replace(case, fault_scope=self.fault_scope)
        if self.poison is not None and self.poison != case.poison:
            case = dataclasses.replace(case, poison=self.poison)
        now = self.clock()
        if self._best is not None and now > self._shrink_end and self.target.hypothesis_shrinks:
            # Hypothesis' shrink has had its `shrink_s`: end it (passing Cases would not: it
            # would go on drawing candidates, each a strategy draw) and keep the smallest so far.
            raise ShrinkOver
        if now > self._find_end() or (now > self._chunk_end and self._best is None):
            # Out of time: the rest of the chunk passes untested (not counted); a shrink in
            # progress stops and keeps the smallest failure seen so far (the shrink phase goes on).
            return
        if not self.target.hypothesis_shrinks and self._best is not None:
            raise self._best  # Hypothesis replays the failure it saw: not worth another engine run
        key = hashlib.sha1(case.key().encode()).digest()  # 20 bytes a Case: flat over long runs
        if key in self._passed:
            self.summary.duplicates += 1
            # The same observation as a run would give: what Hypothesis draws next must not
            # depend on which earlier chunks this process ran (a worker runs only some).
            target(self._passed[key], label="error/tolerance")
            return
        t0, counted = self.clock(), True
        # After a failure in the chunk, Hypothesis runs candidates to shrink it: counted as the
        # cell's shrink checks, not as its examples (nor in its reach or error distribution).
        shrinking = self._best is not None
        cell = self.summary.cells.setdefault(self.target.stats_key(case), CellStats())
        try:
            v = self._check(case)
            counted = self.target.checked(v)
            ratio = min(v.logits.ratio, 1e6)
            target(ratio, label="error/tolerance")
            if not shrinking:
                self.target.record(cell, v)
            if counted and not shrinking:  # the per-cell distribution a green run reports (how far from failing)
                note_example(cell, ratio, getattr(getattr(case, "config", None), "dtype", None), drawn_events())
            self._passed[key] = ratio
        except Violation as v:
            self._seen(v)
            raise
        finally:
            if shrinking:
                cell.add_shrink(counted, self.clock() - t0)
            else:
                cell.examples += counted
                cell.seconds += self.clock() - t0
                self.summary.examples += counted
            self._print_progress()

    def _seen(self, v: Violation) -> None:
        """Hypothesis saw `v` fail: found, or a smaller version while shrinking. The first is
        on disk at once, before shrinking: nothing is lost if the campaign is killed mid-shrink."""
        if self.summary.first_failure_s is None:
            self.summary.first_failure_s = self.clock() - self._t0
            self.summary.first_failure_examples = self.summary.examples + 1
        self._found.setdefault(_kind(v), (self.clock() - self._t0, self.summary.examples))
        first, self._best = self._best is None, v
        if first and self.shrink_s is not None:  # Hypothesis' shrink gets what the minimizer would
            self._shrink_end = self.clock() + self.shrink_s
        if first and self._triage(v) == "new":
            self._persist(v, final=False)

    def _persist(self, v: Violation, *, final: bool, minimal: bool = False) -> str | None:
        """Write `v`; None when it could not be (its Case went to stderr). Another worker's
        reproducer of the same Case and property is left as it is (`recorder.elsewhere`)."""
        found = self._found.get(_kind(v)) or (self.clock() - self._t0, self.summary.examples)
        return self.recorder.persist(v, final=final, found=found, minimal=minimal)

    def _triage(self, v: Violation) -> str:
        return self.target.triage(v, [f for f in self.summary.failures if f.cell == self._cell.name])

    def _hypothesis_test(self, cell: Cell, i: int, examples: int | None = None):
        """Chunk `i` (its index on `cell`) as a Hypothesis test of `examples` examples (default:
        a chunk). Nightly (`use_database` and a database in the profile): random, and the
        example database replays the cell's saved failures first. Otherwise a seed per chunk
        (which turns the database off): reproducible, whichever process runs the chunk."""
        # Hypothesis runs the simplest Case first in every run (one short request, tp-only
        # options off): one extra example per chunk keeps `chunk` drawn ones. After the first
        # rotation the simplest Case is a skipped duplicate.
        s = settings(max_examples=examples or self.chunk + 1)
        if self.stop_on_failure:
            # A run that ends at its first failure (`--fault`, selftest) shrinks that one
            # at once: hunting on for a second bug in the chunk (Hypothesis runs up to twice the
            # examples the first took) then shrinking it too cost a one-example find 30-50 s.
            s = settings(s, report_multiple_bugs=False)
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
        return test if nightly else hseed(chunk_seed(self.seed, cell.name, i))(test)

    def _find(self, cell: Cell, i: int, end: float, examples: int | None = None) -> tuple[list[Violation], bool]:
        """Run chunk `i` on `cell` until `end`: the failures found, as small as Hypothesis got
        them, and whether a stop (SIGINT/SIGTERM) ended the chunk. When a stop, or the end of
        finding (late replays pass: Hypothesis calls that flaky), cuts the shrink short, the
        smallest failure seen so far. Every exception Hypothesis raises is handled here."""
        self._best, found, stopped, self._chunk_end, self._found = None, [], False, end, {}
        self._shrink_end = float("inf")
        try:
            self._hypothesis_test(cell, i, examples)()
        except Violation as v:
            found = [v]
        except ShrinkOver:
            pass  # the smallest failure so far, below
        except KeyboardInterrupt:
            stopped = True
        except BaseExceptionGroup as g:  # several failures, or Hypothesis's FlakyFailure
            vs, rest = g.split(Violation)
            # A Ctrl-C grouped with failures still stops the run.
            stopped = stop_requested() or (rest is not None and rest.subgroup(KeyboardInterrupt) is not None)
            if vs is None and self._best is None and not stopped:
                raise
            found = _leaves(vs)
        except Exception:  # Hypothesis gave up mid-shrink: keep the smallest failure seen
            # An interrupt that lands in Hypothesis's own setup can come out as another error
            # (an AssertionError of its state, seen under load): after a stop, it is the stop.
            stopped = stop_requested()
            if self._best is None and not stopped:
                raise
        if not found and self._best is not None:
            found = [self._best]
        self._best = None
        return found, stopped

    def _print_progress(self, force: bool = False) -> None:
        now = self.clock()
        tty = sys.stderr.isatty()
        # A worker's lines go to the parent, which sums them into its own progress line.
        every = 2.0 if self.share is not None else 1.0 if tty else 15.0
        if not self.progress or (not force and now - self._last_print < every):
            return
        self._last_print = now
        s, el = self.summary, now - self._t0
        done = min(20, int(20 * el / self.budget_s)) if self.budget_s else 20
        line = (f"[{'#' * done}{'.' * (20 - done)}] {el:5.0f}s/{self.budget_s:.0f}s "
                f"{s.examples} examples ({s.examples / max(el, 1e-9):.2f}/s) "
                f"{self.target.unit} {len(visited(s.cells))}/{len(self.cells)} failures {len(s.failures)}")
        sys.stderr.write("\r" + line if tty else line + "\n")
        sys.stderr.flush()

    def _finish(self, v: Violation, shrink: bool = True) -> bool:
        """A failure found: triage it (a known one or a repeat is counted, not written);
        minimize it further within the budget (unless `shrink` is off or finding is over),
        write it once, record it in the summary (one not minimal yet is left to the shrink
        phase), print it. True when a stop (SIGINT/SIGTERM) arrived while minimizing: the
        smallest version so far is written. A target that keeps state has it replayed on a
        fresh engine first (shrink_one; fuzz.campaign.history): the file says what that showed."""
        verdict = self._triage(v)
        if verdict != "new":
            self._skip(v, verdict)
            return False
        t0, row = self.clock(), self.target.stats_key(v.case)  # counted where it was found
        found_s, before = self._found.get(_kind(v)) or (t0 - self._t0, self.summary.examples)
        r = Shrunk(v, 0, False)
        if shrink and t0 < self._find_end():
            deadline = self._find_end() if self.shrink_s is None else min(self._find_end(), t0 + self.shrink_s)
            r = shrink_one(v, self.target, self._real(deadline), self.target.max_shrink_checks, check_stop,
                           check=self._check)
            self.summary.cells.setdefault(row, CellStats()).add_shrink(r.checks, self.clock() - t0)
        v, case = r.violation, r.violation.case
        if getattr(self.target, "keeps_state", False):  # written as it is, not replayed on a fresh engine: say so
            not_replayed(v, "interrupted" if r.stopped else "no time was left to replay it on a fresh engine")
        path = self._persist(v, final=True, minimal=r.minimal)
        r = dataclasses.replace(r, minimal=self.recorder.minimal)  # as the file says (the recorder decides)
        if path is not None and self.recorder.elsewhere:
            # Another worker found and wrote this very reproducer first: a repeat, not a second file.
            self.summary.repeats += 1
            if self.progress:
                sys.stderr.write(f"\nREPEAT {v.property}: {case.describe()}\n  -> {path} (written by another worker)\n")
            return r.stopped
        if path is None or not any(f.path == path for f in self.summary.failures):
            f = Failure(v.property, v.message, case.describe(), path, v.error_ratio, v.oracle, v.second_opinion,
                        self._cell.name, {"signature": getattr(v, "signature", None), "shrink_checks": r.checks,
                                          "row": self.target.stats_key(case)[0], "counted_in": list(row)},
                        seconds_to_find=round(found_s, 2), examples_before=before, size=case_size(case),
                        minimal=r.minimal, shrink_seconds=round(self.clock() - t0, 2))
            note_fresh(f, v)
            self.summary.failures.append(f)
            self.summary.cells.setdefault(row, CellStats()).failures += 1
            if shrink and not r.stopped and not r.minimal and r.reproducible and path is not None:
                self._pending.append(Pending(f, v, confirmed=r.checks > 0))
        self.histories.after(self._cell.name, v, self.target.ends_cell(v))
        if self.target.ends_cell(v):
            self._row.stopped = f"crashed ({v.property}: {getattr(v, 'signature', None)})"
        if self.progress:
            by = f" (against {v.oracle})" if v.oracle else ""
            sys.stderr.write(f"\nFOUND {v.property}{by} after {found_s:.1f}s: {v.message}\n  {case.describe()}\n"
                             f"  -> {path or 'not written (the Case is printed as JSON above)'}"
                             f"{'' if r.minimal else ' (not minimal yet)'}\n")
        return r.stopped

    def _skip(self, v: Violation, verdict: str) -> None:
        if verdict == "repeat":
            self._row.repeats += 1
            return
        sig = getattr(v, "signature", None)  # a known crash would only be met again: the cell ends
        self._row.known.append(sig)
        self._row.stopped = f"known failure {sig}"

    def _visit(self, cell: Cell, row: CellStats, i: int, end: float, examples: int | None = None) -> bool:
        """One chunk on `cell`, its failures finished. True when the campaign should stop."""
        self._cell, self._row = cell, row
        enter_cell(cell.name)  # `run --contention draw`: this cell's load (fuzz/contention/command.py)
        found, stopped = self._find(cell, i, end, examples)
        for v in found:  # after a stop, the rest are written as they are
            stopped = self._finish(v, shrink=not stopped) or stopped
        if stopped:
            self.summary.interrupted = True
            return True
        if self.stop_on_failure and self.summary.failures:
            if self.share is not None:
                self.share.end_all()  # the other workers end at their next chunk
            return True
        return False

    def _run_round_robin(self) -> None:
        # A worker that shares its cell with others runs every `streams`-th chunk of it, from
        # `stream` on: together they run the chunks one process would, each chunk once.
        stream, streams = (self.share.stream, self.share.streams) if self.share is not None else (0, 1)
        k = [stream] * len(self.cells)  # each cell's next chunk index
        # Seconds each cell's chunks took after its first: the next chunk goes to the cell that
        # has had the least time, so every cell gets an equal share of the budget, not an equal
        # number of examples (a tp8 example costs ten of tp1's; counted in examples, the small
        # layouts, where most bugs show first, got a few examples a minute).
        spent = [0.0] * len(self.cells)
        while self.clock() < self._deadline:
            check_stop()
            if self.share is not None and self.share.ended():
                return
            # The first round gives each cell one example (its simplest Case, engines built): on
            # a short budget every layout is visited before any gets a second. A layout's
            # summary rows are per mode (stats_key), and a round-robin target never ends, skips
            # or repeats a cell: its own row is a scratch one.
            fresh = [c for c in range(len(self.cells)) if k[c] == stream]  # not visited yet
            c = fresh[0] if fresh else min(range(len(self.cells)), key=lambda j: (spent[j], j))
            first_round = k[c] == 0 and self.cells_total > 1
            t = self.clock()
            if self._visit(self.cells[c], CellStats(), k[c], self._deadline, 1 if first_round else None):
                return
            if not first_round:
                spent[c] += self.clock() - t
            k[c] += streams

    def _shrink_phase(self) -> None:
        """After the budget: minimize what it cut short, within `shrink_budget_s`."""
        phase = ShrinkPhase(self.target, self.shrink_budget_s, self.recorder.rewrite, check_stop,
                            max_checks=10 * self.target.max_shrink_checks, progress=self.progress,
                            check=self._check)
        phase.clock = self.clock
        try:
            if phase.run(self._pending):
                self.summary.interrupted = True
        finally:
            self.shrink_report = phase.report(self._pending)

    def _rate_findings(self) -> None:
        """Under contention, each finding's reproducer (as small as it got) is replayed
        TIMED_REPLAYS times under the same load, on the same engine, and its rate written into
        it and the summary: a race shows at a rate, not every time."""
        for f in self.summary.failures:
            if f.path is None or not os.path.exists(f.path):
                continue
            rate = replay_times(self._check, load_reproducer(f.path), TIMED_REPLAYS, stop=stop_requested)
            f.meta["replay_rate"] = rate.to_json()
            update_reproducer(f.path, replay_rate=rate.to_json())
            if self.progress:
                sys.stderr.write(f"RATE {f.property}: {rate.line()}\n  {f.path}\n")

    def run(self) -> Summary:
        self._t0 = self.clock()
        self._deadline = self._t0 + self.budget_s
        self.target.begin(self.budget_s)
        if not self.keep_stop:
            clear_stop()  # a stop belongs to the run it interrupted (tests call main() in-process)
        try:  # from here on, an interrupt still prints the summary and closes our target
            sys.stderr.write(f"llmfuzz: campaign started: {self.target.describe()}, "
                             f"budget {self.budget_s:.0f}s\n")
            sys.stderr.flush()
            if self.target.sequential:
                self._run_sequential()
            else:
                self._run_round_robin()
            if self._pending and not self.summary.interrupted:
                self._shrink_phase()
            if active() is not None and not self.summary.interrupted:
                self._rate_findings()
        except KeyboardInterrupt:
            self.summary.interrupted = True
        except Exception:
            if not stop_requested():  # after a stop, an error is the interrupt's (see `_find`)
                raise
            self.summary.interrupted = True
        finally:
            self.summary.seconds = self.clock() - self._t0
            self._print_progress(force=True)
            if self.progress:
                sys.stderr.write("\n")
            if self.owns_target:
                self.target.close()
        return self.summary
