"""`--contention` on the commands: bad input exits 2 before anything starts; a finding
records the load it was found under; replay restores it and reports a rate; a drawn campaign
puts each cell under its own level."""
from __future__ import annotations

import json

import pytest

from fuzz.campaign.replay_rate import Rate, replay_times, replays_for
from fuzz.campaign.reproduce import Reproducer, load_reproducer, write_reproducer
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.cli.main import main
from fuzz.contention import Profile, active
from fuzz.contention.command import enter_cell, for_replay, held
from fuzz.contention.profile import draw_levels, drawn_for
from fuzz.verdict.properties import LogitsMismatch
from fuzz_testutil import FakeClock, campaigns_on

CASE = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2, 3), 2),)))


@pytest.mark.parametrize("argv, words", [
    (["run", "--contention", "gpu"], "needs CUDA"),
    (["run", "--contention", "nope"], "unknown profile"),
    (["run", "--contention", "draw", "--jobs", "2"], "--jobs 1"),
    (["run", "--contention", "cpu:1", "--cluster", "ray"], "Ray cluster"),
    (["selftest", "--contention", "gpu:1"], "needs CUDA"),
    (["selftest", "--contention", "draw"], "only `run` draws"),
])
def test_bad_contention_is_one_line_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_a_finding_records_its_contention_and_replay_restores_it(capsys, tmp_path, monkeypatch):
    # On a clock the test controls (each check 0.2 s of it): as many examples on a busy machine as on a quiet one.
    campaigns_on(monkeypatch, FakeClock(), check_s=0.2)
    code = main(["run", "--budget", "30", "--jobs", "1", "--layouts", "tp1pp1", "--modes", "eager", "--fault",
                 "sampling_penalty_stale_row", "--contention", "cpu:1", "--out", str(tmp_path), "--quiet"])
    assert code == 1
    (path,) = tmp_path.glob("*/*.json")
    repro = load_reproducer(str(path))
    assert repro.meta["contention"] == "cpu:1"
    # Found under contention: the shrunk Case's rate under the same load (a deterministic CPU bug: every time).
    assert repro.meta["replay_rate"] == {"reproduced": 8, "runs": 8, "differs": 0, "contention": "cpu:1"}
    assert "replayed: reproduces 8/8 under cpu:1" in capsys.readouterr().out
    assert active() is None  # the run's load ended with it
    capsys.readouterr()
    assert main(["replay", str(path), "--json", "--replays", "2"]) == 1
    out, err = capsys.readouterr()
    rate = json.loads(out)["rate"]
    assert rate == {"reproduced": 2, "runs": 2, "differs": 0, "contention": "cpu:1"}
    assert "reproduces 2/2 under cpu:1" in err
    assert main(["replay", str(path), "--json", "--replays", "1", "--contention", "none"]) == 1
    assert json.loads(capsys.readouterr().out)["rate"]["contention"] is None


class Flaky:
    """A target whose failure shows on some runs only, as a race does."""

    def __init__(self, fails_on: set[int]) -> None:
        self.calls, self.fails_on = 0, fails_on

    def check(self, case):
        self.calls += 1
        if self.calls in self.fails_on:
            raise LogitsMismatch("request r0 position 0: greedy token 5 vs 7", case)
        return None


def test_a_timing_dependent_failure_is_a_rate_and_fails_once_red():
    repro = Reproducer(CASE, "logits", "request r0 position 0: greedy token 1 vs 2")
    rate = replay_times(Flaky({2, 5}), repro, 8)
    assert (rate.reproduced, rate.runs, rate.verdict) == (2, 8, "reproduces")
    assert rate.line() == "reproduces 2/8 without contention"
    assert replay_times(Flaky(set()), repro, 3).verdict == "passes"


def test_replays_default_to_a_rate_under_contention_only():
    plain = Reproducer(CASE, "logits", "", meta={})
    timed = Reproducer(CASE, "logits", "", meta={"contention": "gpu:3"})
    assert replays_for(plain, None, None) == 1
    assert replays_for(timed, None, None) == 8
    assert replays_for(plain, None, Profile(cpu=1)) == 8
    assert replays_for(timed, 3, None) == 3


def test_a_recorded_gpu_profile_replays_without_the_gpu_part_here(capsys):
    assert for_replay(None, "gpu:3,cpu:1") == Profile(cpu=1)
    assert "needs CUDA" in capsys.readouterr().err
    assert for_replay(None, None) is None
    assert for_replay("cpu:2", "gpu:3") == Profile(cpu=2)  # the command line wins


def test_a_drawn_campaign_puts_each_cell_under_its_level():
    levels = draw_levels(cuda=False)
    with held("draw", device="cpu", seed=3) as c:
        assert active() is None  # paused at none until a cell is entered
        for cell in ("tp1pp1", "tp2pp1", "pp2", "tp2pp2", "pp4", "tp4pp1"):
            enter_cell(cell)
            want = drawn_for(cell, 3, levels)
            assert active() == (None if want.idle else str(want))
            assert c.level == want
    assert active() is None
    enter_cell("tp1pp1")  # no drawn campaign now: nothing changes
    assert active() is None


def test_reproducers_written_under_contention_record_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFUZZ_CONTENTION", "gpu:3")
    path = write_reproducer(str(tmp_path), CASE, "logits", "m")
    assert load_reproducer(path).meta["contention"] == "gpu:3"
    monkeypatch.delenv("LLMFUZZ_CONTENTION")
    path = write_reproducer(str(tmp_path / "b"), CASE, "logits", "m")
    assert "contention" not in load_reproducer(path).meta
