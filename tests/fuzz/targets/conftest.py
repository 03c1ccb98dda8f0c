"""tests/fuzz/targets: real engines as targets. Tests that need vLLM are marked `vllm` (registered in
pyproject.toml too) and skip cleanly without it; the rest run a fake worker that speaks the
vLLM worker protocol (fuzz/targets/vllm/worker.py)."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM installed (scripts/setup_vllm_cpu.sh); skips cleanly without it")


FAKE = textwrap.dedent('''
    import json, os, sys, time
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    spec = json.loads(sys.stdin.readline() if sys.argv[1] == "--warm" else sys.argv[1])
    mode = os.environ.get("FAKE_MODE", "ok")
    time.sleep(float(os.environ.get("FAKE_START_S", "0")))  # an engine's start-up
    if mode == "nostart":
        print("Traceback (most recent call last):", file=sys.stderr)
        print('  File "/x/site-packages/vllm/engine/arg_utils.py", line 1, in create_engine_config', file=sys.stderr)
        print("ValueError: unsupported", file=sys.stderr)
        sys.exit(1)
    if mode == "startcrash_tp2" and spec["llm_kwargs"].get("tensor_parallel_size") == 2:
        proto.write(json.dumps({"event": "error", "type": "RuntimeError", "message": "tp2 start", "frames": [
            {"file": "/x/site-packages/vllm/v1/executor/multiproc_executor.py", "line": 1, "func": "_init_executor"}]})
            + "\\n")
        sys.exit(3)
    proto.write(json.dumps({"event": "ready", "startup_s": 0.0, "ready_at": time.time(), "vllm_version": "fake"}) + "\\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if os.environ.get("FAKE_LOG"):  # what the runner sent, for tests of the protocol
            with open(os.environ["FAKE_LOG"], "a") as f:
                f.write(line.strip() + "\\n")
        if cmd.get("cmd") == "exit":
            time.sleep(float(os.environ.get("FAKE_EXIT_S", "0")))  # an engine's shut-down
            break
        if mode == "hang":
            time.sleep(3600)
        if mode in ("crash", "raise_then_hang"):
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1] Traceback (most recent call last):", file=sys.stderr)
            print('(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1]   File "/x/site-packages/vllm/v1/worker/r.py", line 5, in step_fn', file=sys.stderr)
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1]     assert x", file=sys.stderr)
            print("(Worker_PP1 pid=9) ERROR 11-29 16:07:59 [m.py:1] AssertionError", file=sys.stderr)
            sys.stderr.flush()
            if mode == "raise_then_hang":  # a worker raised; the engine waits on it forever
                time.sleep(3600)
            proto.write(json.dumps({"event": "error", "type": "EngineDeadError", "message": "dead", "frames": [
                {"file": "/x/site-packages/vllm/v1/engine/core_client.py", "line": 1, "func": "get_output"}]}) + "\\n")
            sys.exit(3)
        res = {r["id"]: {"token_ids": [7] * r["max_tokens"],
                         "logprobs": [[[7, -0.5], [8, -1.0]]] * r["max_tokens"]} for r in cmd["requests"]}
        if cmd.get("prompt_logprobs"):
            for r in cmd["requests"]:
                res[r["id"]]["prompt_logprobs"] = [[[t, -1.0]] for t in r["prompt_token_ids"][1:]]
        proto.write(json.dumps({"event": "result", "seconds": 0.0, "steps": 1, "results": res}) + "\\n")
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """make(mode, **VLLMRunner kwargs): a VLLMRunner whose worker is FAKE in `mode` (ok: answers
    token 7 always; crash; hang; raise_then_hang: a worker's ERROR traceback, then a hang;
    nostart: a ValueError from vllm/engine/arg_utils.py). Every command the worker reads is
    appended to $FAKE_LOG; a start takes $FAKE_START_S seconds, an exit $FAKE_EXIT_S (default 0)."""
    from fuzz.targets.vllm import launch
    from fuzz.targets.vllm.runner import VLLMRunner

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    monkeypatch.setattr(launch, "WORKER", str(script))
    monkeypatch.setattr(launch, "vllm_python", lambda: sys.executable)  # VLLMRunner() without vLLM
    monkeypatch.setenv("LLMFUZZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_MODE", "ok")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake_commands.jsonl"))

    def make(mode: str, **kw):
        monkeypatch.setenv("FAKE_MODE", mode)
        return VLLMRunner(python=sys.executable, log_dir=str(tmp_path / "logs"), **kw)
    os.makedirs(tmp_path / "logs")
    return make


@pytest.fixture
def write_vllm():
    """write(out_dir, violation, runner): the reproducer a vLLM campaign writes for `violation`
    (fuzz.campaign.reproduce.write_reproducer with the vLLM target's metadata)."""
    from fuzz.campaign.reproduce import write_reproducer
    from fuzz.targets.vllm.target import reproducer_meta

    def write(out_dir: str, v, runner) -> str:
        return write_reproducer(out_dir, v.case, v.property, v.message, v.error_ratio, v.oracle, v.second_opinion,
                                reproducer_meta(v.case, v, runner.vllm_version))
    return write
