"""VLLMTarget's process handling (reuse, restart, crash and hang with a time bound, killing
its process group) against a fake worker speaking the worker protocol: no vLLM needed."""
from __future__ import annotations

import json
import os
import time

import pytest

from fuzz.targets import TargetFailure
from fuzz.targets import vllm_target as vt
from fuzz.targets import vllm_checker as vc

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_engine_reused_then_restarted_for_another_config(fake):
    t = fake("ok")
    try:
        case = vc.vllm_case([([1, 2], 3)])
        run = t.run(case)
        assert run.results["r0"].token_ids == (7, 7, 7)
        t.run(case)
        assert t.stats["tp1pp1-eager"].starts == 1 and t.stats["tp1pp1-eager"].runs == 2
        t.run(vc.vllm_case([([1], 1)], max_num_seqs=2))
        assert t.stats["tp1pp1-eager-s2"].starts == 1
        assert os.path.exists(os.path.join(vt.checkpoint_dir(case.config), "model.safetensors"))
    finally:
        t.close()


def test_crash_signature_from_the_root_traceback_and_restart(fake):
    t = fake("crash")
    case = vc.vllm_case([([1, 2], 3)])
    with pytest.raises(TargetFailure) as ei:
        t.run(case)
    f = ei.value
    assert f.kind == "crash"
    assert f.signature == "AssertionError@vllm/v1/worker/r.py:step_fn"
    assert "Worker_PP1" in f.detail and "EngineDeadError@vllm/v1/engine/core_client.py:get_output" in f.detail
    with pytest.raises(TargetFailure):
        t.run(case)  # a fresh engine was started for the next Case
    assert t.stats["tp1pp1-eager"].starts == 2 and t.stats["tp1pp1-eager"].failures == 2
    t.close()


def test_hang_is_a_failure_within_the_bound_and_the_group_is_killed(fake):
    t = fake("hang", run_timeout_s=2.0, run_timeout_per_token_s=0.0)
    t.ensure(vt.VLLM_MODEL)
    pid = t._w.proc.pid
    t0 = time.monotonic()
    with pytest.raises(TargetFailure) as ei:
        t.run(vc.vllm_case([([1], 1)]))
    assert ei.value.kind == "hang" and ei.value.signature == "hang@run"
    assert time.monotonic() - t0 < 30
    assert not _alive(pid)
    t.close()


def test_start_failure(fake):
    t = fake("nostart")
    with pytest.raises(TargetFailure) as ei:
        t.ensure(vt.VLLM_MODEL)
    assert ei.value.kind == "startup"
    assert ei.value.signature == "ValueError@vllm/engine/arg_utils.py:create_engine_config"
    t.close()


def test_checker_turns_failures_into_violations(fake, tmp_path):
    from fuzz.targets.vllm_campaign import write_vllm_reproducer
    from fuzz.reproduce import load_reproducer

    chk = vc.VLLMChecker(fake("crash"))
    case = vc.vllm_case([([1, 2, 3], 2)], layout="tp1pp2")
    with pytest.raises(vc.VLLMCrash) as ei:
        chk.check(case)
    v = ei.value
    assert v.property == "vllm_crash" and v.case == case and v.signature.startswith("AssertionError@")
    path = write_vllm_reproducer(str(tmp_path / "out"), v, vt.VLLMOptions(), chk.target)
    repro = load_reproducer(path)
    assert repro.case == case and repro.meta["signature"] == v.signature
    assert json.load(open(path))["llm_kwargs"]["pipeline_parallel_size"] == 2
    chk.close()


def test_disagreement_with_the_reference_is_a_violation(fake):
    """The fake always answers token 7: the reference engine does not."""
    chk = vc.VLLMChecker(fake("ok"))
    with pytest.raises(vc.VLLMvsReference):
        chk.check(vc.vllm_case([([1, 2, 3], 4)]))
    chk.close()
