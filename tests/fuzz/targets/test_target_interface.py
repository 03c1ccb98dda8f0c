"""The target interface (fuzz.targets.base): a Case carries its target and options in its JSON,
vLLM reproducers of case format 1 load as vLLM Cases, the one minimizer stops at its
deadline, and the one campaign loop runs a sequential target (cells in order, unsupported /
known / repeats / a failure that ends its cell) with no engine at all."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import strategies as st

from fuzz.campaign.loop import Campaign
from fuzz.cases.case import PLAIN_FORMAT, TARGET_FORMAT, Case, RequestSpec, Workload
from fuzz.verdict.properties import CrashViolation, LogitsMismatch
from fuzz.campaign.reproduce import load_reproducer, write_reproducer
from fuzz.campaign.shrink import minimize
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.targets.base import Cell, Target, Unsupported

ROOT = Path(__file__).resolve().parents[3]


def _case(**kw) -> Case:
    return Case(FUZZ_MODEL, Workload((RequestSpec((1, 2, 3), 2), RequestSpec((4,), 1))), **kw)


def test_reference_case_json_is_unchanged_and_a_vllm_case_carries_its_target():
    d = _case().to_dict()
    assert d["format"] == PLAIN_FORMAT and "target" not in d and "target_options" not in d
    v = _case(target="vllm", target_options={"enable_prefix_caching": True})
    d = v.to_dict()
    assert d["format"] == TARGET_FORMAT and d["target"] == "vllm"
    assert Case.from_json(v.to_json()) == v and Case.from_json(_case().to_json()) == _case()


def test_old_vllm_reproducer_loads_as_a_vllm_case():
    path = ROOT / "reproducers/vllm/vllm_crash/402ca48c42d3.json"
    doc = json.loads(path.read_text())
    assert doc["case"]["format"] == 1 and "target" not in doc["case"]  # as it was committed
    repro = load_reproducer(str(path))
    assert repro.case.target == "vllm" and repro.case.layout == "tp1pp2"
    assert repro.case.target_options == {"async_scheduling": False, "enable_prefix_caching": False}


def test_reproducer_meta_and_target_round_trip(tmp_path):
    case = _case(target="vllm", target_options={"async_scheduling": True})
    path = write_reproducer(str(tmp_path), case, "vllm_crash", "boom", meta={"signature": "X@vllm/a.py:f"})
    repro = load_reproducer(path)
    assert repro.case == case and repro.meta["signature"] == "X@vllm/a.py:f"
    assert repro.meta["replay"] == f"llmfuzz replay {path}"


def test_minimize_stops_at_its_deadline():
    calls = []

    def slow_fails(case) -> bool:
        calls.append(case)
        time.sleep(0.2)
        return True
    small, checks = minimize(_case(), slow_fails, max_checks=400, deadline=time.monotonic() + 0.5)
    assert 1 <= checks <= 4 and len(calls) == checks


class FakeSequential(Target):
    """Cells a (refused), b (a crash that ends it, then never reached again), c (a known
    crash), d (logits failures: the first written, the rest repeats)."""

    name, sequential, hypothesis_shrinks, confirm_before_shrink, unit = "fake", True, False, False, "configs"

    def __init__(self, clock=None) -> None:
        self.known, self.clock = {"known@x"}, clock  # a FakeClock each check moves 100 ms

    def cells(self):
        def on(n):
            return lambda k: Case(FUZZ_MODEL, Workload((RequestSpec((k,), 1),)), target="vllm",
                                  target_options={"cell": n})
        return [Cell(n, st.integers(1, 3).map(on(n)), on(n)(1)) for n in "abcd"]

    def stats_key(self, case):
        return case.target_options["cell"], ""

    def start(self, cell):
        if cell.name == "a":
            raise Unsupported("refused by design")

    def check(self, case):
        if self.clock is not None:
            self.clock.sleep(0.1)
        cell = case.target_options["cell"]
        if cell in "bc":
            v = CrashViolation("crash", case)
            v.signature = "known@x" if cell == "c" else "new@x"
            raise v
        raise LogitsMismatch("differs", case, 2.0, "reference")

    def simpler(self, case):
        return iter(())

    def triage(self, v, earlier):
        if getattr(v, "signature", None) in self.known:
            return "known"
        return "repeat" if any(f.property == v.property for f in earlier) else "new"

    def ends_cell(self, v):
        return isinstance(v, CrashViolation)


def test_sequential_target_on_the_one_campaign_loop(tmp_path):
    from fuzz_testutil import FakeClock

    clock = FakeClock()  # the budget is examples (40 at most), however loaded the machine
    s = Campaign(target=FakeSequential(clock), budget_s=4, min_cell_s=1, out_dir=str(tmp_path), progress=False,
                 shrink_grace_s=10, clock=clock).run()
    rows = {k[0]: c for k, c in s.cells.items()}
    assert s.planned == ["a", "b", "c", "d"]
    assert rows["a"].unsupported == "refused by design" and rows["a"].examples == 0
    assert rows["b"].failures == 1 and rows["b"].stopped.startswith("crashed") and rows["b"].examples == 1
    assert rows["c"].known == ["known@x"] and rows["c"].stopped == "known failure known@x"
    assert rows["d"].failures == 1 and rows["d"].repeats >= 1
    assert sorted(f.property for f in s.failures) == ["crash", "logits"]
    assert len(list(tmp_path.rglob("*.json"))) == 2  # the known one and the repeats: none written


def test_replay_and_minimize_a_vllm_reproducer_through_the_shared_commands(fake, write_vllm, tmp_path, capsys):
    """`llmfuzz replay` / `llmfuzz minimize` on a vLLM reproducer run on vLLM (a fake that
    crashes on every config): the shared minimizer walks the config back to defaults and the
    shared writer records the vLLM metadata."""
    from fuzz.cli import main as cli
    from fuzz.targets.vllm import checker as vc
    from fuzz.targets.vllm.configs import VLLMOptions

    fake("crash")
    chk = vc.VLLMChecker(transformers=False)
    case = vc.vllm_case([([1, 2, 3], 2), ([4, 5], 1)], opts=VLLMOptions(enable_prefix_caching=True), layout="tp1pp2")
    with pytest.raises(vc.VLLMCrash) as ei:
        chk.check(case)
    v = ei.value
    path = write_vllm(str(tmp_path / "found"), v, chk.runner)
    chk.close()
    assert cli.main(["replay", path, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["same_failure"]
    assert cli.main(["minimize", path, "--out", str(tmp_path / "small")]) == 1
    small = load_reproducer(str(next((tmp_path / "small").rglob("*.json"))))
    assert small.case.layout == "tp1pp1" and small.case.target_options["enable_prefix_caching"] is False
    assert len(small.case.workload.requests) == 1 and small.meta["signature"] == v.signature
