"""Fresh replay and histories (fuzz.campaign.history, fuzz.campaign.settle, fuzz.targets.fresh): a failure on a
target that keeps state across Cases is replayed on a fresh engine before it is written as
reproducible or minimal; one that needs an earlier Case's state is written with that Case (its
`history`), which a replay runs first; one that does not fail even then is written as not
reproducible. A target that keeps no state (the reference engine) gets none of it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from fuzz.targets.fresh import IN_PROCESS, PROCESS, FreshUnavailable  # noqa: E402
from fuzz.campaign.history import (FAILS, FAILS_WITH_HISTORY, NOT_RUN, PASSES, HISTORY_LEN,  # noqa: E402
                                   Histories, recording_check, shrink_history)
from fuzz.campaign.settle import settle  # noqa: E402
from fuzz.campaign.reproduce import load_reproducer, replay_on, write_reproducer  # noqa: E402
from fuzz.cases.case import Case, RequestSpec, Workload  # noqa: E402
from fuzz.cases.strategies import FUZZ_MODEL  # noqa: E402
from fuzz.targets.base import Target  # noqa: E402
from fuzz.verdict.properties import LogitsMismatch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the planted adapter, importable by name here and in a fresh process
    sys.path.insert(0, HERE)

from stateful_engine import StaleRowTarget  # noqa: E402


def _case(*lens: int, max_tokens: int = 2) -> Case:
    return Case(FUZZ_MODEL, Workload(tuple(RequestSpec(tuple(range(1, n + 1)), max_tokens) for n in lens)))


MARK, BUG, OTHER = _case(5, 5, 5), _case(1, 1), _case(2)


class NeedsMark(Target):
    """No engine: BUG fails on a fresh engine only after MARK (`alone`: always), counting replays."""

    def __init__(self, alone: bool = False, never: bool = False) -> None:
        self.alone, self.never, self.replays = alone, never, []

    def cells(self):
        return []

    def check(self, case):
        raise AssertionError("settle replays through fresh_check only; a warm check here is a bug")

    def fresh_check(self, case, history=()):
        self.fresh = PROCESS
        self.replays.append(tuple(history))
        if case == BUG and not self.never and (self.alone or MARK in history):
            return LogitsMismatch("request r1 position 0: greedy token differs", case, 2.0, "reference")
        return None

    def simpler(self, case):
        return ()


def _found(history) -> LogitsMismatch:
    v = LogitsMismatch("request r1 position 0: greedy token differs", BUG, 2.0, "reference")
    v.history = tuple(history)
    return v


def test_a_failure_that_needs_an_earlier_case_keeps_it_and_drops_the_rest() -> None:
    target, v = NeedsMark(), _found([OTHER] * 9 + [MARK] + [OTHER] * 6)
    res = settle(v, target, None, 40)
    assert res.state == FAILS_WITH_HISTORY and res.history == (MARK,) and res.history_minimal
    assert target.replays[:2] == [(), v.history]  # alone first, then after the whole history
    assert v.fresh_replay is res and res.text() == "fails with history of 1"
    doc = res.fields()
    assert doc["reproducible"] is True and doc["fresh"] == PROCESS and doc["history_seen"] == 16
    assert [Case.from_dict(h) for h in doc["history"]] == [MARK] and doc["history_format"] == 1


def test_a_failure_that_fails_alone_gets_no_history_and_one_that_never_fails_is_not_reproducible() -> None:
    res = settle(_found([MARK, OTHER]), NeedsMark(alone=True), None, 40)
    assert res.state == FAILS and res.history == () and "history" not in res.fields()
    res = settle(_found([MARK, OTHER]), NeedsMark(never=True), None, 40)
    assert res.state == PASSES and not res.fails
    doc = res.fields()
    assert doc["reproducible"] is False and doc["fresh_replay"] == "passes"
    assert "fresh engine" in doc["fresh_replay_note"]


def test_no_fresh_engine_means_nothing_is_claimed() -> None:
    class Broken(NeedsMark):
        def fresh_check(self, case, history=()):
            raise FreshUnavailable("the adapter did not import")

    res = settle(_found([MARK]), Broken(), None, 40)
    doc = res.fields()
    assert res.state == NOT_RUN and doc["reproducible"] is None and "did not import" in doc["fresh_replay_note"]


def test_the_history_shrink_stops_at_its_check_budget_and_says_it_is_not_minimal() -> None:
    small, checks, minimal = shrink_history((MARK,) + (OTHER,) * 20, lambda h: MARK in h, lambda c: (), None, 2)
    assert checks == 2 and not minimal and small[0] == MARK and len(small) == 11
    small, checks, minimal = shrink_history((OTHER,) * 20 + (MARK,), lambda h: MARK in h, lambda c: (), None, 40)
    assert small == (MARK,) and checks == 2 and minimal  # runs of Cases go in one check each


def test_the_campaign_history_is_bounded_and_given_to_a_violation() -> None:
    class Flaky(NeedsMark):
        def check(self, case):
            if case == BUG:
                raise LogitsMismatch("x", case)

    hs = Histories()
    check = recording_check(Flaky(), hs, lambda: "cell")
    for _ in range(HISTORY_LEN + 5):
        check(OTHER)
    with pytest.raises(LogitsMismatch) as ei:
        check(BUG)
    assert len(ei.value.history) == HISTORY_LEN and hs.of("cell")[-1] == BUG
    hs.reset("cell")
    assert hs.of("cell") == ()


def test_a_reproducer_with_a_history_is_format_2_and_its_replay_runs_the_history_first(tmp_path) -> None:
    res = settle(_found([MARK]), NeedsMark(), None, 40)
    path = write_reproducer(str(tmp_path), BUG, "logits", "request r1 position 0: greedy token differs", 2.0,
                            "reference", meta=res.fields())
    doc = json.loads(open(path).read())
    assert doc["format"] == 2
    repro = load_reproducer(path)
    assert repro.history == (MARK,) and "history" not in repro.meta

    class Seen:
        def __init__(self):
            self.cases = []

        def check(self, case):
            self.cases.append(case)
            if case == BUG and MARK in self.cases:
                raise LogitsMismatch("request r1 position 0: greedy token differs", case)

    t = Seen()
    assert replay_on(t, repro)[0] == "reproduces" and t.cases == [MARK, BUG]
    plain = load_reproducer(write_reproducer(str(tmp_path / "plain"), BUG, "logits", "m"))  # format 1 as before
    assert plain.history == () and plain.meta["format"] == 1


def test_an_adapter_that_cannot_be_imported_elsewhere_is_replayed_in_process() -> None:
    """Defined in a function: no new process can import it; a new instance here stands in."""
    from fuzz.targets.blackbox import BlackBoxChecker
    from fuzz.targets.blackbox_target import BlackBoxTarget

    class Local(StaleRowTarget):
        """Defined in a function: no fresh process can import it by name."""

    target = BlackBoxTarget(BlackBoxChecker(Local(), "stalerow", transformers=False, batch_invariance=False))
    try:
        assert target.keeps_state
        big, two = _case(3, 4, 5, max_tokens=1), _case(1, 2, max_tokens=1)
        assert target.fresh_check(two, ()) is None and target.fresh == IN_PROCESS
        v = target.fresh_check(two, (big,))
        assert v is not None and v.property == "stalerow_greedy"
        assert target.checker.runner.rows == []  # the campaign's own instance served nothing
    finally:
        target.close()


def test_a_stateless_finding_on_the_reference_engine_gets_no_history(tmp_path) -> None:
    from fuzz.campaign.loop import Campaign
    from fuzz_testutil import FakeHarness

    s = Campaign(layouts=("tp1pp1",), modes=("eager",), seed=0, out_dir=str(tmp_path), harness=FakeHarness(2),
                 budget_s=600, shrink_s=5.0, shrink_budget_s=0, stop_on_failure=True, progress=False).run()
    assert not s.target.keeps_state and len(s.failures) == 1
    f = s.failures[0]
    doc = json.loads(open(f.path).read())
    assert doc["format"] == 1 and "history" not in doc and "fresh_replay" not in doc
    assert f.fresh_replay is None and f.history == 0 and "findings_needing_history" not in s.to_json()


def _replay_in_a_new_process(path: str) -> subprocess.CompletedProcess:
    """`llmfuzz replay`'s equivalent for the adapter, in a new Python process: a new StaleRowTarget."""
    return subprocess.run([sys.executable, os.path.join(HERE, "stateful_engine.py"), path], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_campaign_finds_a_stale_row_and_writes_the_history_it_needs(tmp_path) -> None:
    """The planted adapter's bug shows only after a Case with more requests: the campaign finds
    it, its fresh replay fails only after the history, the reproducer keeps that history, a
    replay in a new process fails as recorded and, without the history, passes."""
    from fuzz.campaign.findings import run_text
    from fuzz.campaign.loop import Campaign
    from fuzz.targets.blackbox import BlackBoxChecker
    from fuzz.targets.blackbox_target import BlackBoxTarget

    target = BlackBoxTarget(BlackBoxChecker(StaleRowTarget(), "stalerow", transformers=False), layouts=("tp1pp1",))
    target.max_fresh_checks = 4  # fresh replays for the history shrink: a count, whatever the machine's load
    try:
        # The budget only bounds a broken run: the campaign stops at its first failure.
        s = Campaign(target=target, budget_s=600, seed=0, out_dir=str(tmp_path / "out"), progress=False,
                     stop_on_failure=True, shrink_budget_s=0).run()
    finally:
        target.close()
    assert [f.property for f in s.failures] == ["stalerow_greedy"]
    f = s.failures[0]
    doc = json.loads(open(f.path).read())
    assert doc["fresh"] == PROCESS and doc["adapter"] == "stateful_engine:StaleRowTarget"
    assert doc["format"] == 2 and doc["reproducible"] is True and 1 <= len(doc["history"]) <= HISTORY_LEN
    assert doc["fresh_replay"] == f"fails with history of {len(doc['history'])}" == f.fresh_replay
    assert doc["minimal"] == f.minimal and (not f.minimal or doc["history_minimal"])  # minimal only when replayed fresh
    assert s.to_json()["findings_needing_history"] == 1 and "fresh replay: fails with history of" in run_text(s, None)

    red = _replay_in_a_new_process(f.path)
    assert red.returncode == 1, red.stdout + red.stderr  # fails as recorded, the history run first
    assert "earlier Case(s)" in red.stdout
    alone = dict(doc, format=1)
    for k in ("history", "history_format", "history_minimal"):
        alone.pop(k)
    (tmp_path / "alone.json").write_text(json.dumps(alone))
    green = _replay_in_a_new_process(str(tmp_path / "alone.json"))
    assert green.returncode == 0, green.stdout + green.stderr  # the Case alone passes: the history is needed

