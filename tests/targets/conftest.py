"""tests/targets: real engines as targets. Tests that need vLLM are marked `vllm` (registered in
pyproject.toml too) and skip cleanly without it; the rest run a fake worker that speaks the
vLLM worker protocol (fuzz/targets/vllm_worker.py)."""
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
        if cmd.get("prompt_logprobs"):
            for r in cmd["requests"]:
                res[r["id"]]["prompt_logprobs"] = [[[t, -1.0]] for t in r["prompt_token_ids"][1:]]
        proto.write(json.dumps({"event": "result", "seconds": 0.0, "steps": 1, "results": res}) + "\\n")
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """make(mode, **VLLMTarget kwargs): a VLLMTarget whose worker is FAKE in `mode` (ok: answers
    token 7 always; crash; hang; nostart: a ValueError from vllm/engine/arg_utils.py)."""
    from fuzz.targets import vllm_target as vt

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE)
    monkeypatch.setattr(vt, "WORKER", str(script))
    monkeypatch.setattr(vt, "vllm_python", lambda: sys.executable)  # VLLMTarget() without vLLM
    monkeypatch.setenv("LLMFUZZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_MODE", "ok")

    def make(mode: str, **kw):
        monkeypatch.setenv("FAKE_MODE", mode)
        return vt.VLLMTarget(python=sys.executable, log_dir=str(tmp_path / "logs"), **kw)
    os.makedirs(tmp_path / "logs")
    return make
