"""VLLMTarget's process handling (reuse, restart, crash and hang with a time bound, killing
its process group) against a fake worker speaking the worker protocol: no vLLM needed."""
from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from fuzz.targets import TargetFailure
from fuzz.targets import vllm_target as vt

FAKE = textwrap.dedent('''
    import json, os, sys, time
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    spec = json.loads(sys.argv[1])
    mode = os.environ.get("FAKE_MODE", "ok")
    if mode == "nostart":
        print("Traceback (most recent call last):", file=sys.stderr)
        print('  File "/x/site-packages/vllm/engine/arg_utils.py", line 1, in create_engine_config', file=sys.stderr)
        print("ValueError: unsupported", file=sys.stderr)
        sys.exit(1)
    proto.write(json.dumps({"event": "ready", "startup_s": 0.0, "vllm_version": "fake"}) + "\\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        if mode == "hang":
            time.sleep(3600)
        if mode == "crash":
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1] Traceback (most recent call last):", file=sys.stderr)
            print('(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1]   File "/x/site-packages/vllm/v1/worker/r.py", line 5, in step_fn', file=sys.stderr)
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1]     assert x", file=sys.stderr)
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1] AssertionError", file=sys.stderr)
            sys.stderr.flush()
            proto.write(json.dumps({"event": "error", "type": "EngineDeadError", "message": "dead", "frames": [
                {"file": "/x/site-packages/vllm/v1/engine/core_client.py", "line": 1, "func": "get_output"}]}) + "\\n")
            sys.exit(3)
        res = {r["id"]: {"token_ids": [7] * r["max_tokens"],
                         "logprobs": [[[7, -0.5], [8, -1.0]]] * r["max_tokens"]} for r in cmd["requests"]}
        proto.write(json.dumps({"event": "result", "seconds": 0.0, "steps": 1, "results": res}) + "\\n")
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    monkeypatch.setattr(vt, "WORKER", str(script))
    monkeypatch.setenv("LLMFUZZ_CACHE", str(tmp_path / "cache"))

    def make(mode: str, **kw) -> vt.VLLMTarget:
        monkeypatch.setenv("FAKE_MODE", mode)
        return vt.VLLMTarget(python=sys.executable, log_dir=str(tmp_path / "logs"), **kw)
    os.makedirs(tmp_path / "logs")
    return make


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_engine_reused_then_restarted_for_another_config(fake):
    t = fake("ok")
    try:
        case = vt.vllm_case([([1, 2], 3)])
        run = t.run(case)
        assert run.results["r0"].token_ids == (7, 7, 7)
        t.run(case)
        assert t.stats["tp1pp1-eager"].starts == 1 and t.stats["tp1pp1-eager"].runs == 2
        t.run(vt.vllm_case([([1], 1)], max_num_seqs=2))
        assert t.stats["tp1pp1-eager-s2"].starts == 1
        assert os.path.exists(os.path.join(vt.checkpoint_dir(case.config), "model.safetensors"))
    finally:
        t.close()


def test_crash_signature_from_the_root_traceback_and_restart(fake):
    t = fake("crash")
    case = vt.vllm_case([([1, 2], 3)])
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
        t.run(vt.vllm_case([([1], 1)]))
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

    chk = vt.VLLMChecker(fake("crash"))
    case = vt.vllm_case([([1, 2, 3], 2)], layout="tp1pp2")
    with pytest.raises(vt.VLLMCrash) as ei:
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
    chk = vt.VLLMChecker(fake("ok"))
    with pytest.raises(vt.VLLMvsReference):
        chk.check(vt.vllm_case([([1, 2, 3], 4)]))
    chk.close()
