"""What a campaign says it did agrees with what it did: a reproducer's `minimal` is the same
on stderr, in the summary and in its file; a cell's examples are the Cases checked while
finding (a shrink's candidates are its `shrink_checks`); a cell with no example checked is not
visited; and the budget a sequential campaign's cells leave goes to shrinking. Every campaign
here runs on a clock the test moves (fuzz_testutil.FakeClock), so none depends on how loaded
the machine is."""
from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import strategies as st

from fuzz.campaign.findings import run_json
from fuzz.campaign.loop import Campaign
from fuzz.campaign.sequential import NOT_VISITED
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.targets.base import Cell, Target, Unsupported
from fuzz.verdict.properties import LogitsMismatch
from fuzz_testutil import FakeClock, FakeHarness

CHECK_S = 1.0  # what a check costs on the campaign's clock


def _case(cell: str, k: int) -> Case:
    """A one-request Case of `cell` whose prompt is the token `k` (the fakes fail from a token on)."""
    return Case(FUZZ_MODEL, Workload((RequestSpec((k,), 1),)), target="vllm", target_options={"cell": cell})


class Configs(Target):
    """A sequential target (vLLM's policies, no engine): one cell per name, drawing prompts
    from `draws` (lowest, highest); a prompt token of `fails_from` or more crashes, and the
    crash ends its cell. Its
    minimizer steps a prompt's token down by one, so a failure is minimal at `fails_from`.
    `refused`: cells it refuses (unsupported); `unchecked`: cells whose Cases it never runs
    (vLLM's past its deadline: not examples). `skipped_for_time`: what every reproducer says
    of its shrink's candidates (vLLM: those an engine start could not fit before the deadline)."""

    name, sequential, hypothesis_shrinks, unit = "configs", True, False, "configs"
    confirm_before_shrink = False

    def __init__(self, names: str, clock: FakeClock, *, fails_from: int | None = None,
                 draws: tuple[int, int] = (1, 10**6),
                 refused: str = "", unchecked: str = "", max_shrink_checks: int = 80,
                 skipped_for_time: int = 0) -> None:
        self.names, self.clock, self.fails_from, self.draws = names, clock, fails_from, draws
        self.refused, self.unchecked, self.skipped_for_time = refused, unchecked, skipped_for_time
        self.max_shrink_checks = max_shrink_checks
        self.checks: list[Case] = []

    def cells(self):
        return [Cell(n, st.integers(*self.draws).map(lambda k, n=n: _case(n, k)), _case(n, 1)) for n in self.names]

    def shrink_phase_s(self, budget_s: float) -> float:
        return 0.0  # the shrink phase has only what the cells leave

    def stats_key(self, case):
        return case.target_options["cell"], ""

    def start(self, cell):
        if cell.name in self.refused:
            raise Unsupported(f"{cell.name}: refused by design")

    def check(self, case):
        self.clock.sleep(CHECK_S)
        self.checks.append(case)
        k = case.workload.requests[0].prompt_token_ids[0]
        if self.fails_from is not None and k >= self.fails_from:
            raise LogitsMismatch("crashed", case, 2.0)
        return SimpleNamespace(logits=SimpleNamespace(ratio=0.0), case=case, checked=case.target_options["cell"]
                               not in self.unchecked)

    def checked(self, verdict) -> bool:
        return verdict.checked

    def ends_cell(self, violation) -> bool:
        return True

    def simpler(self, case):
        k = case.workload.requests[0].prompt_token_ids[0]
        if k > 1:
            yield _case(case.target_options["cell"], k - 1)

    def reproducer_meta(self, case, violation) -> dict:
        return {"shrink_candidates_skipped_for_time": self.skipped_for_time}


def _prompt(path: str) -> int:
    from fuzz.campaign.reproduce import load_reproducer

    return load_reproducer(path).case.workload.requests[0].prompt_token_ids[0]


def test_a_shrink_cut_short_for_time_is_not_minimal_on_stderr_in_the_summary_and_in_the_file(tmp_path, capsys):
    """The minimizer reaches its fixpoint, but candidates were skipped for time (vLLM: an
    engine start that would not fit before the deadline counts as not failing): the file says
    `minimal: false`, and so do the FOUND line, the summary and, after the shrink phase
    rewrites it, the SHRUNK line. Once, the SHRUNK line said "minimal" beside a file saying
    false: the recorder forced the file's flag and the line printed the minimizer's."""
    clock = FakeClock()
    target = Configs("a", clock, fails_from=10, draws=(30, 40), skipped_for_time=17)
    camp = Campaign(target=target, budget_s=100, shrink_budget_s=30, out_dir=str(tmp_path), progress=True, clock=clock)
    s = camp.run()
    err = capsys.readouterr().err
    (f,) = s.failures
    with open(f.path) as fh:
        doc = json.load(fh)
    assert doc["minimal"] is False and doc["shrink_candidates_skipped_for_time"] == 17
    assert f.minimal is False and run_json(s, camp.shrink_report)["failure_details"][0]["minimal"] is False
    assert err.split("FOUND", 1)[1].splitlines()[2].endswith("(not minimal yet)"), err
    # Not minimal: left to the shrink phase, which rewrites it and says so as the file does.
    shrunk = [line for line in err.splitlines() if line.startswith("SHRUNK")]
    assert shrunk and all("(not minimal yet," in line for line in shrunk), shrunk
    assert camp.shrink_report["minimal"] == 0


def test_the_shrink_phase_says_what_the_file_says(tmp_path, capsys):
    """`Recorder.rewrite` with a shrink result the minimizer calls minimal, over a target whose
    reproducer says candidates were skipped for time: the SHRUNK line, the Failure and the
    file all say not minimal (as measured: 17 checks, all skipped, "SHRUNK (minimal, ...)")."""
    from fuzz.campaign.recorder import Recorder
    from fuzz.campaign.shrink_phase import Pending, Shrunk
    from fuzz.campaign.summary import Failure, Summary

    target = Configs("a", FakeClock(), skipped_for_time=17)
    summary = Summary()
    rec = Recorder(str(tmp_path), target, summary, progress=True)
    v = LogitsMismatch("crashed", _case("a", 12))
    f = Failure(v.property, v.message, v.case.describe(), rec.persist(v, final=True, found=(1.0, 3)), 2.0,
                cell="a", meta={"counted_in": ["a", ""]}, minimal=False)
    summary.failures.append(f)
    small = LogitsMismatch("crashed", _case("a", 10))
    rec.rewrite(Pending(f, v, confirmed=True), Shrunk(small, 17, True), 0.0)
    err = capsys.readouterr().err
    with open(f.path) as fh:
        assert json.load(fh)["minimal"] is False
    assert f.minimal is False and "SHRUNK logits (not minimal yet, 17 checks" in err, err
    assert summary.cells[("a", "")].shrink_checks == 17  # counted in its row, apart from examples


def test_shrink_candidates_are_not_examples_of_the_cell(tmp_path):
    """Hypothesis' shrink of a failure and the minimizer's candidates after it run Cases on
    the cell; they are its `shrink_checks`, not its examples: the examples are the Cases run
    until the failure (the failing one last), and every other check is a shrink check."""
    checks: list = []

    class Counting(FakeHarness):
        def check(self, case):
            checks.append(case)
            clock.sleep(CHECK_S)
            return super().check(case)

    clock = FakeClock()
    s = Campaign(layouts=("tp1pp2",), modes=("eager",), seed=0, out_dir=str(tmp_path), harness=Counting(2),
                 budget_s=100, shrink_budget_s=0, stop_on_failure=True, progress=False, clock=clock).run()
    (row,) = s.cells.values()
    assert s.failures and s.examples == row.examples == s.first_failure_examples, (s.examples, row)
    assert row.shrink_checks > 0 and row.examples + row.shrink_checks == len(checks), (row, len(checks))
    assert abs(row.seconds - CHECK_S * row.examples) < 1, row  # the clock's ticks aside
    per_cell = s.to_json()["per_cell"]["tp1pp2/eager"]
    assert per_cell["examples"] == row.examples and per_cell["shrink_checks"] == row.shrink_checks


def test_a_config_with_no_example_checked_is_not_visited(tmp_path, capsys):
    """Of three configs, one checks examples, one is refused and one starts but has none of
    its Cases checked: only the first is visited. The summary lists the other two as not
    visited, the table names them, the progress line counts one config of three, and the
    started one's row says why it has no examples."""
    clock = FakeClock()
    target = Configs("abc", clock, refused="b", unchecked="c")
    s = Campaign(target=target, budget_s=30, min_cell_s=1, out_dir=str(tmp_path), progress=True, clock=clock).run()
    err = capsys.readouterr().err
    doc = s.to_json()
    assert s.cells[("a", "")].examples > 0 and s.cells[("c", "")].examples == 0
    assert doc["layouts"] == ["a"] and doc["not_visited"] == ["b", "c"], doc
    assert "not visited: b" in s.table() and "not visited: c" in s.table()
    assert "configs 1/3" in err.strip().splitlines()[-1], err.strip().splitlines()[-1]
    assert s.cells[("c", "")].stopped == NOT_VISITED and "refused" in s.cells[("b", "")].stopped


def test_a_crash_that_ends_the_last_config_leaves_the_budget_to_its_shrink(tmp_path):
    """A one-config sequential campaign (vLLM's policies) whose config crashes early: the
    crash ends the cell and no config is left, so the budget left goes to the shrink phase,
    which minimizes the crash (here from the minimizer's 3 checks in the cell to the smallest
    prompt). Once the shrink phase had only its own 2 % and the rest of the budget went unused:
    a vLLM crash ended with one shrink check and half the budget left."""
    clock = FakeClock()
    target = Configs("a", clock, fails_from=10, draws=(30, 40), max_shrink_checks=3)  # crashes at its first
    camp = Campaign(target=target, budget_s=100, out_dir=str(tmp_path), progress=False, clock=clock)
    s = camp.run()
    (f,) = s.failures
    row = s.cells[("a", "")]
    ended = 100 - CHECK_S * (row.examples + 3)  # the budget left when the cell ended (the clock's ticks aside)
    assert camp.shrink_report is not None and camp.shrink_report["budget_s"] >= ended - 1, camp.shrink_report
    assert f.minimal and _prompt(f.path) == 10 and f.meta["shrink_checks"] > 3, f
    assert row.shrink_checks == f.meta["shrink_checks"] and row.examples + row.shrink_checks == len(target.checks)
