"""`fuzz.campaign.loop.Campaign` on a stand-in harness (no engine runs, so each test takes seconds):
one reproducer per failure, minimized, written once; the unfinished one on disk while shrinking;
a stop mid-shrink keeps the smallest failure so far; nightly mode keys the example database
per (layout, modes, faults) cell through public Hypothesis API only."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase

from fuzz.campaign.loop import Campaign
from fuzz.campaign.summary import CellDatabase
from fuzz.stop import request_stop
from fuzz.verdict.properties import LogitsMismatch
from fuzz.campaign.reproduce import load_reproducer

PASS = SimpleNamespace(logits=SimpleNamespace(ratio=0.1))


class FakeHarness:
    """Fails (logits, against the reference) every Case with two or more requests."""

    def __init__(self, out, stop_when=None) -> None:
        self.out, self.stop_when = out, stop_when
        self.failed: list = []  # Cases that failed, in order
        self.on_disk: list[int] = []  # reproducer files on disk at each check after a failure

    def check(self, case):
        if self.failed:
            self.on_disk.append(len(list(self.out.rglob("*.json"))))
        if self.stop_when is not None and self.stop_when(self, case):
            request_stop()  # what the signal handler does
            raise KeyboardInterrupt
        if len(case.workload.requests) >= 2:
            self.failed.append(case)
            raise LogitsMismatch("two requests", case, 2.0, oracle="reference")
        return PASS

    def close(self) -> None:
        pass


def campaign(tmp_path, h, layouts=("tp1pp2",), **kw) -> Campaign:
    # shrink_s: Hypothesis' shrink ends 5 s after the find (the minimizer and the shrink phase go
    # on), so that a campaign ends soon after its find, not at the end of its budget.
    kw = {"budget_s": 30, "shrink_grace_s": 30, "shrink_s": 5.0, "stop_on_failure": True, "progress": False, **kw}
    return Campaign(layouts=layouts, modes=("eager",), seed=0, out_dir=str(tmp_path / "out"), harness=h, **kw)


def test_failure_is_minimized_and_written_once(tmp_path) -> None:
    h = FakeHarness(tmp_path / "out")
    s = campaign(tmp_path, h).run()
    files = list((tmp_path / "out").rglob("*.json"))
    assert len(s.failures) == 1 and len(files) == 1 and s.failures[0].path == str(files[0])
    assert s.failures[0].property == "logits" and s.failures[0].oracle == "reference"
    repro = load_reproducer(str(files[0]))
    assert len(repro.case.workload.requests) == 2 and repro.case.layout == "tp1pp1"  # minimized past Hypothesis
    # While it was shrunk, the failure was on disk, as one file: a SIGKILL loses nothing.
    assert h.on_disk and all(n == 1 for n in h.on_disk)
    assert s.first_failure_examples is not None and not s.interrupted
    assert not list((tmp_path / "out").rglob(".tmp-*"))


def test_stop_during_hypothesis_shrink_writes_smallest_so_far(tmp_path) -> None:
    h = FakeHarness(tmp_path / "out", stop_when=lambda h, case: len(h.failed) >= 3)
    s = campaign(tmp_path, h).run()
    files = list((tmp_path / "out").rglob("*.json"))
    assert s.interrupted and len(s.failures) == 1 and len(files) == 1
    assert load_reproducer(str(files[0])).case.key() == h.failed[-1].key()


def test_stop_during_minimize_writes_smallest_so_far(tmp_path) -> None:
    # Hypothesis draws tp1pp2 only; the minimizer's first simpler layout is tp1pp1.
    h = FakeHarness(tmp_path / "out", stop_when=lambda h, case: case.layout == "tp1pp1")
    s = campaign(tmp_path, h).run()
    files = list((tmp_path / "out").rglob("*.json"))
    assert s.interrupted and len(s.failures) == 1 and len(files) == 1
    repro = load_reproducer(str(files[0]))
    assert repro.case.layout == "tp1pp2" and repro.case.key() == h.failed[-1].key()


def test_cell_database_keeps_cells_apart() -> None:
    db = InMemoryExampleDatabase()
    a, b = CellDatabase(db, b"a"), CellDatabase(db, b"b")
    a.save(b"k", b"1")
    a.save(b"k.secondary", b"2")
    assert list(a.fetch(b"k")) == [b"1"] and list(b.fetch(b"k")) == [] and list(db.fetch(b"k")) == []
    a.move(b"k", b"k.secondary", b"1")
    assert list(a.fetch(b"k")) == [] and sorted(a.fetch(b"k.secondary")) == [b"1", b"2"]
    a.delete(b"k.secondary", b"2")
    assert list(a.fetch(b"k.secondary")) == [b"1"]


@pytest.fixture
def nightly_db():
    """A profile with an example database, as the nightly one has; the previous one after."""
    prev = settings.get_current_profile_name()
    db = InMemoryExampleDatabase()
    settings.register_profile("llmfuzz-test-db", settings.get_profile("dev"), database=db)
    settings.load_profile("llmfuzz-test-db")
    try:
        yield db
    finally:
        settings.load_profile(prev)


def test_nightly_replays_saved_failures_first_in_their_own_cell_only(tmp_path, nightly_db) -> None:
    first = campaign(tmp_path / "1", FakeHarness(tmp_path / "1"), use_database=True).run()
    assert first.failures and first.first_failure_examples > 1  # the simplest Case passes
    assert nightly_db.data  # saved, under the cell's keys only
    cell = CellDatabase(nightly_db, repr(("tp1pp2", ("eager",), ())).encode())
    assert all(k.startswith(cell.prefix) for k in nightly_db.data)
    again = campaign(tmp_path / "2", FakeHarness(tmp_path / "2"), use_database=True).run()
    assert again.failures and again.first_failure_examples == 1  # the saved failure, replayed first
    other = campaign(tmp_path / "3", FakeHarness(tmp_path / "3"), layouts=("tp1pp1",), use_database=True).run()
    assert other.failures and other.first_failure_examples > 1  # another cell: nothing replayed
    faulty = campaign(tmp_path / "4", FakeHarness(tmp_path / "4"), use_database=True,
                      faults=("pp_stale_new_token_ids",)).run()
    assert faulty.failures and faulty.first_failure_examples > 1


def test_error_hypothesis_raises_after_a_stop_is_the_stop(tmp_path, monkeypatch) -> None:
    """A signal that lands inside Hypothesis's own setup can come out of it as another error
    (an AssertionError about its state; seen once in 60 SIGTERM'd selftests under load). Once
    a stop was requested, the campaign ends interrupted with its summary, not with that error;
    without a stop the error is a real one and is raised."""
    from fuzz.stop import clear_stop

    def broken(self, cell, i, examples=None):
        def test():
            if stop:
                request_stop()
            raise AssertionError("state._runner is None")
        return test

    monkeypatch.setattr(Campaign, "_hypothesis_test", broken)
    stop = True
    s = campaign(tmp_path, FakeHarness(tmp_path / "out")).run()
    assert s.interrupted and not s.failures
    clear_stop()
    stop = False
    with pytest.raises(AssertionError, match="_runner"):
        campaign(tmp_path, FakeHarness(tmp_path / "out")).run()


def test_shrink_while_finding_stops_at_shrink_s(tmp_path) -> None:
    """With `shrink_s` (the selftest's), Hypothesis' shrink of a found failure ends that many
    seconds after it was found, not at the end of the budget; the smallest failure so far is
    written. Each check here costs 0.2 s, so a shrink to the end of a 60 s budget would show."""
    import time as _time

    class Slow(FakeHarness):
        def check(self, case):
            _time.sleep(0.2)
            return super().check(case)

    h = Slow(tmp_path / "out")
    t0 = _time.monotonic()
    s = campaign(tmp_path, h, budget_s=60, shrink_s=3.0, shrink_grace_s=0.0).run()
    assert len(s.failures) == 1 and s.failures[0].path
    assert _time.monotonic() - t0 < 20, (s.first_failure_s, _time.monotonic() - t0)


def test_each_cell_gets_an_equal_share_of_the_time_not_of_the_examples(monkeypatch) -> None:
    """A layout whose examples cost many times another's gets a fraction of its examples:
    the next chunk goes to the cell that has had the least time. (On a clock the checks move:
    tp1pp2's cost ten times tp1pp1's.)"""
    from fuzz_testutil import FakeClock, FakeHarness, recording_draws

    clock = FakeClock()

    class Slow(FakeHarness):
        def check(self, case):
            clock.sleep(0.5 if case.config.layout == "tp1pp2" else 0.05)
            return super().check(case)

    with recording_draws(monkeypatch) as seen:
        Campaign(layouts=("tp1pp1", "tp1pp2"), modes=("eager",), seed=3, budget_s=5.0, progress=False,
                 harness=Slow(), out_dir="/nonexistent", clock=clock).run()
    n = {lay: sum(len(v) for (cell, _), v in seen.items() if cell == lay) for lay in ("tp1pp1", "tp1pp2")}
    assert n["tp1pp1"] > 2 * n["tp1pp2"], n  # round robin: as many each


def _named_cells(names, hi: int = 10**6) -> list:
    """The cells of a fake sequential target: one per name, drawing one-request Cases told
    apart by target_options["cell"] (their stats key), the first with prompt (1,)."""
    from hypothesis import strategies as st

    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL
    from fuzz.targets.base import Cell

    def on(n):
        return lambda k: Case(FUZZ_MODEL, Workload((RequestSpec((k,), 1),)), target="vllm", target_options={"cell": n})
    return [Cell(n, st.integers(1, hi).map(on(n)), on(n)(1)) for n in names]


def test_sequential_cells_get_equal_time_for_examples_whatever_their_start_costs() -> None:
    """A sequential target's cells (vLLM: an engine start each) whose starts cost 0, 0.6 and
    1.2 s, known beforehand (`start_estimate_s`): each gets about the same time for examples.
    Counting a start in its cell's share gave 1.0, 0.4 and the 0.1 s floor here. (On a clock
    the starts and checks move.)"""
    from fuzz.targets.base import Target
    from fuzz_testutil import FakeClock

    starts = {"a": 0.0, "b": 0.6, "c": 1.2}
    clock = FakeClock()

    class Starts(Target):
        name, sequential, hypothesis_shrinks, unit = "starts", True, False, "configs"

        def cells(self):
            return _named_cells(starts, 50)

        def stats_key(self, case):
            return case.target_options["cell"], ""

        def start_estimate_s(self, cell):
            return starts[cell.name]

        def start(self, cell):
            clock.sleep(starts[cell.name])

        def check(self, case):
            clock.sleep(0.01)
            return SimpleNamespace(logits=SimpleNamespace(ratio=0.0), case=case)

    s = Campaign(target=Starts(), budget_s=3.0, min_cell_s=0.1, out_dir="/nonexistent", progress=False,
                 clock=clock).run()
    fuzz_s = {k[0]: c.seconds for k, c in s.cells.items()}
    # (check time only: Hypothesis' own per-example time is not in it)
    assert min(fuzz_s.values()) > 0.1 and max(fuzz_s.values()) < 2 * min(fuzz_s.values()), fuzz_s
    assert s.seconds < 3.5, s.seconds


def test_a_sequential_campaign_names_the_next_cell_before_fuzzing_the_current() -> None:
    """`Target.prestart(next cell)` comes right after a cell starts, before its first
    example, so a target can start the next engine beside this cell's examples; the last cell
    names none. (On a clock the checks move: every cell has its examples, however loaded the machine.)"""
    from fuzz.targets.base import Target
    from fuzz_testutil import FakeClock

    events: list[str] = []
    clock = FakeClock()

    class Seq(Target):
        name, sequential, hypothesis_shrinks, unit = "seq", True, False, "configs"

        def cells(self):
            return _named_cells("abc", 50)

        def stats_key(self, case):
            return case.target_options["cell"], ""

        def start(self, cell):
            events.append(f"start {cell.name}")

        def prestart(self, cell):
            events.append(f"prestart {cell.name}")

        def check(self, case):
            clock.sleep(0.01)
            if events[-1] != f"check {case.target_options['cell']}":
                events.append(f"check {case.target_options['cell']}")
            return SimpleNamespace(logits=SimpleNamespace(ratio=0.0), case=case)

    Campaign(target=Seq(), budget_s=1.5, min_cell_s=0.1, out_dir="/nonexistent", progress=False, clock=clock).run()
    assert events == ["start a", "prestart b", "check a", "start b", "prestart c", "check b", "start c", "check c"], events


def _prestarting_campaign(names: str, start_s: float, estimates: dict[str, float], budget_s: float):
    """A campaign on a target that `prestarts`: each cell's engine is up `start_s` after it is
    pre-started, and `start_estimate_s` says `estimates`. Returns (when each cell was up,
    each cell's check times), on a clock the checks move (10 ms each)."""
    from fuzz.targets.base import Target
    from fuzz_testutil import FakeClock

    clock = FakeClock()

    up_at: dict[str, float] = {}
    checks: dict[str, list[float]] = {n: [] for n in names}

    class Prestarting(Target):
        name, sequential, prestarts, hypothesis_shrinks, unit = "prestarting", True, True, False, "configs"

        def cells(self):
            return _named_cells(names)

        def stats_key(self, case):
            return case.target_options["cell"], ""

        def start_estimate_s(self, cell):
            return estimates.get(cell.name, 0.0)

        def prestart(self, cell):
            up_at[cell.name] = clock.now + start_s

        def starting(self, cell):
            return clock.now < up_at[cell.name]

        def check(self, case):
            clock.sleep(0.01)
            checks[case.target_options["cell"]].append(clock.now)
            return SimpleNamespace(logits=SimpleNamespace(ratio=0.0), case=case)

    Campaign(target=Prestarting(), budget_s=budget_s, min_cell_s=0.1, out_dir="/nonexistent", progress=False,
             clock=clock).run()
    return up_at, checks


def test_a_cell_goes_on_with_examples_while_the_next_engine_is_still_starting() -> None:
    """A target that starts the next cell beside the current one (`prestarts`): where the
    next engine is not up when the current cell's share ends, the current cell goes on with
    examples until it is (`Target.starting`), rather than the campaign waiting idle."""
    up_at, checks = _prestarting_campaign("ab", 2.0, {}, 3.0)  # b takes 2 s to start; a's share is about 1.5 s
    assert checks["a"] and checks["b"], checks
    assert max(checks["a"]) >= up_at["b"] - 0.5, (max(checks["a"]) - up_at["b"])  # fuzzed until b was nearly up
    assert min(checks["b"]) >= up_at["b"] - 0.1


def test_the_share_beside_prestarted_engines_ends_the_cells_left_at_the_deadline() -> None:
    """Each cell lasts its share or the next engine's start, whichever is longer; the share is
    what makes them add up to the time left (an equal split, 100/3 each, made the first cell
    wait out a 60 s start and the three overrun 100 s by 27 s)."""
    from fuzz.campaign.sequential import fill_share

    assert abs(fill_share(100.0, [10.0, 10.0, 0.0]) - 100 / 3) < 1e-9
    x = fill_share(100.0, [60.0, 10.0, 0.0])
    assert abs(x - 20.0) < 1e-9 and abs(max(x, 60) + max(x, 10) + max(x, 0) - 100.0) < 1e-9
    assert fill_share(50.0, [60.0, 10.0, 0.0]) == 0.0  # the starts alone take longer than the time left


def test_a_cell_stops_at_its_share_when_the_starts_left_would_not_fit() -> None:
    """Beside a pre-starting engine a cell's examples slow the start down: where the starts
    still to come leave no time for the cells after them, the cell ends at its share and the
    next start has the cores to itself, rather than the cell going on with examples."""
    up_at, checks = _prestarting_campaign("abc", 1.5, {"c": 60.0}, 3.0)  # c's start alone outlasts the budget
    assert checks["a"] and max(checks["a"]) < up_at["b"] - 1.0, (max(checks["a"]) - up_at["b"])


def _slow_first_cell(check_s: float, budget_s: float) -> dict[str, list[float]]:
    """Cells a and b of a sequential target that wants 10 examples a cell; a's examples take
    `check_s`, b's 10 ms, on a clock the checks move. Returns each cell's check times."""
    from fuzz.targets.base import Target
    from fuzz_testutil import FakeClock

    clock = FakeClock()

    checks: dict[str, list[float]] = {"a": [], "b": []}

    class SlowFirst(Target):
        name, sequential, hypothesis_shrinks, unit = "slow-first", True, False, "configs"
        min_cell_examples = 10

        def cells(self):
            return _named_cells("ab")

        def stats_key(self, case):
            return case.target_options["cell"], ""

        def check(self, case):
            n = case.target_options["cell"]
            clock.sleep(check_s if n == "a" else 0.01)
            checks[n].append(clock.now)
            return SimpleNamespace(logits=SimpleNamespace(ratio=0.0), case=case)

    Campaign(target=SlowFirst(), budget_s=budget_s, min_cell_s=0.1, out_dir="/nonexistent", progress=False,
             clock=clock).run()
    return checks


def test_a_cell_short_of_its_least_examples_goes_on_past_its_share() -> None:
    """Equal time is not equal depth: a cell whose share (1.5 s of 3) ends with fewer checked
    examples than the target's `min_cell_examples` goes on until it has them, and the cell
    after it shares what is left; but never past STRETCH x its share, so one cell of very slow
    examples cannot eat the next one's time."""
    from fuzz.campaign.sequential import SequentialVisits

    checks = _slow_first_cell(0.2, 3.0)  # 10 examples take ~2 s: 7 fit in the share, 10 in the stretch
    assert len(checks["a"]) >= 10 and checks["b"], {k: len(v) for k, v in checks.items()}
    checks = _slow_first_cell(0.6, 3.0)  # 10 would take 6 s: a stops at 1.5 x its share
    a, b = checks["a"], checks["b"]
    assert len(a) < 10 and b, {k: len(v) for k, v in checks.items()}
    # a's last slice and example may run past the stretch (0.5 s + 0.6 s); 10 examples would take 6 s
    assert min(b) - min(a) < SequentialVisits.STRETCH * 1.5 + 1.5, min(b) - min(a)
