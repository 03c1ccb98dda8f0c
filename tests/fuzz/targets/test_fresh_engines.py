"""A fresh engine for a fresh replay (fuzz.targets.fresh): vLLM's target restarts its engine's
worker process and runs the history on the new engine before the Case (here on the fake
worker of conftest.py); the transformers continuous-batching target shuts its worker down
first; the reference engine keeps no state and has no fresh replay."""
from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest

from fuzz.targets.fresh import RESTARTED
from fuzz.verdict.properties import LogitsMismatch, Violation


def test_targets_say_whether_they_keep_state() -> None:
    from fuzz.targets.base import Target
    from fuzz.targets.reference import HarnessTarget
    from fuzz.targets.transformers_cb.target import CBTarget
    from fuzz.targets.vllm.target import VLLMTarget

    assert not HarnessTarget.__new__(HarnessTarget).keeps_state  # resets and poisons between Cases
    assert VLLMTarget([]).keeps_state
    assert CBTarget.fresh_check is not Target.fresh_check


def test_a_vllm_fresh_check_starts_a_new_engine_and_runs_the_history_on_it(fake, tmp_path) -> None:
    from fuzz.stop import clear_stop
    from fuzz.targets.vllm import checker as vc
    from fuzz.targets.vllm.configs import VLLM_MODEL, VLLMOptions
    from fuzz.targets.vllm.target import VLLMTarget

    clear_stop()  # a stop an earlier test in this process left set would end the runner's reads
    chk = vc.VLLMChecker(fake("ok", spare=False), transformers=False)
    target = VLLMTarget([(VLLM_MODEL, VLLMOptions())], checker=chk)
    first, case = vc.vllm_case([([1, 2, 3], 2)]), vc.vllm_case([([4, 5], 1)])
    log = tmp_path / "fake_commands.jsonl"
    try:
        with contextlib.suppress(Violation):  # the fake answers token 7 always: any verdict will do
            target.check(first)
        starts, sent_before = len(chk.runner.starts), len(log.read_text().splitlines())
        with contextlib.suppress(Violation):
            target.fresh_check(case, (first,))
        assert target.fresh == RESTARTED and len(chk.runner.starts) == starts + 1  # a new engine
        sent = [json.loads(line) for line in log.read_text().splitlines()[sent_before:]]
        prompts = [r["prompt_token_ids"] for cmd in sent for r in cmd.get("requests", ())]
        assert prompts[0] == [1, 2, 3] and prompts.index([4, 5]) > 0  # the history first, then the Case
    finally:
        chk.close()


def test_a_transformers_cb_fresh_check_shuts_the_worker_down_first() -> None:
    from fuzz.targets.transformers_cb.target import CBTarget

    calls = []
    target = CBTarget.__new__(CBTarget)
    target.checker = SimpleNamespace(runner=SimpleNamespace(shutdown=lambda: calls.append("shutdown")))

    def check(case):
        calls.append(case)
        if case == "case" and "history" in calls:
            raise LogitsMismatch("m", None)
    target.check = check
    v = target.fresh_check("case", ("history",))
    assert calls == ["shutdown", "history", "case"] and isinstance(v, LogitsMismatch) and target.fresh == RESTARTED


@pytest.mark.parametrize("keeps", [True, False])
def test_an_adapter_says_whether_it_keeps_state(keeps) -> None:
    import llmfuzz
    from fuzz.targets.blackbox import BlackBoxChecker
    from fuzz.targets.blackbox_target import BlackBoxTarget

    class Mine(llmfuzz.Target):
        keeps_state = keeps

    assert llmfuzz.Target.keeps_state is True
    target = BlackBoxTarget(BlackBoxChecker(Mine(), "mine", transformers=False), own=False)
    assert target.keeps_state is keeps
