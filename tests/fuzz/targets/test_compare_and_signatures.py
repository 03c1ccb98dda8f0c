"""Target-independent pieces of fuzz.targets (no vLLM needed): the check_logprobs_close-style
comparison, greedy check, crash signatures from logged tracebacks, Case -> vLLM arguments."""
from __future__ import annotations

import pytest

from fuzz.targets.runs import RequestResult, parse_tracebacks, signature
from fuzz.verdict.compare import RunMismatch, check_greedy, compare_runs


def rr(tokens, tops):
    return RequestResult(tuple(tokens), tuple(tuple(sorted(t.items(), key=lambda p: -p[1])) for t in tops))


A = rr([1, 2], [{1: -1.0, 5: -1.5}, {2: -0.5, 6: -2.0}])


def test_equal_runs_agree():
    rep = compare_runs({"r0": A}, {"r0": A}, lp_tol=1e-6, margin_tol=1e-6)
    assert rep.positions == 2 and rep.max_lp_error == 0 and not rep.divergences


def test_logprob_difference_beyond_tolerance():
    b = rr([1, 2], [{1: -1.0, 5: -1.5}, {2: -0.5 + 1e-3, 6: -2.0}])
    compare_runs({"r0": A}, {"r0": b}, lp_tol=2e-3, margin_tol=2e-3)
    with pytest.raises(RunMismatch, match="request r0 position 1: logprob of token 2"):
        compare_runs({"r0": A}, {"r0": b}, lp_tol=1e-4, margin_tol=1e-4)


def test_divergence_allowed_only_at_a_near_tie():
    tie = rr([1, 9], [{1: -1.0, 5: -1.0 - 1e-5}, {9: -0.1, 2: -0.2}])
    near = rr([5, 7], [{5: -1.0, 1: -1.0 - 1e-5}, {7: -0.1}])  # diverges at 0; rest not compared
    rep = compare_runs({"r0": tie}, {"r0": near}, lp_tol=1e-4, margin_tol=1e-4)
    assert rep.divergences == [("r0", 0, 1, 5, pytest.approx(1e-5))]
    far = rr([5, 7], [{5: -1.0, 1: -1.2}, {7: -0.1}])
    with pytest.raises(RunMismatch, match="margin"):
        compare_runs({"r0": A}, {"r0": far}, lp_tol=1e-4, margin_tol=1e-4)
    absent = rr([8, 2], [{8: -0.9, 1: -1.0}, {2: -0.5}])
    with pytest.raises(RunMismatch, match="not in oracle's top"):
        compare_runs({"r0": A}, {"r0": absent}, lp_tol=1e-4, margin_tol=1e-4)


def test_lengths_and_missing_requests():
    with pytest.raises(RunMismatch, match="no output"):
        compare_runs({"r0": A}, {}, lp_tol=1, margin_tol=1)
    with pytest.raises(RunMismatch, match="generated 1 tokens"):
        compare_runs({"r0": A}, {"r0": rr([1], [{1: -1.0}])}, lp_tol=1, margin_tol=1)


def test_greedy_check():
    check_greedy({"r0": A}, 1e-6)
    with pytest.raises(RunMismatch, match="greedy"):
        check_greedy({"r0": rr([5], [{1: -1.0, 5: -1.5}])}, 1e-6)


LOG = """\
(MainProcess pid=1) WARNING 11-29 16:02:02 [base.py:380] Traceback (most recent call last):
(MainProcess pid=1) WARNING 11-29 16:02:02 [base.py:380]   File "/v/site-packages/vllm/renderers/base.py", line 217, in get_tokenizer
(MainProcess pid=1) WARNING 11-29 16:02:02 [base.py:380]     raise ValueError("no tokenizer")
(MainProcess pid=1) WARNING 11-29 16:02:02 [base.py:380] ValueError: no tokenizer
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]   File "/v/site-packages/vllm/v1/executor/multiproc_executor.py", line 1055, in _execute_worker_rpc
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]     output = func(*args, **kwargs)
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]              ^^^^^^^^^^^^^^^^^^^^^
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]   File "/v/site-packages/torch/utils/_contextlib.py", line 124, in decorate_context
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]     return func(*args, **kwargs)
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]   File "/v/site-packages/vllm/v1/worker/gpu_model_runner.py", line 3174, in sync_and_gather_intermediate_tensors
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]     assert self.intermediate_tensors is not None
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063]            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(Worker_PP1 pid=2) ERROR 11-29 16:07:59 [multiproc_executor.py:1063] AssertionError
(EngineCore pid=3) ERROR 11-29 16:07:59 [core.py:1] Traceback (most recent call last):
(EngineCore pid=3) ERROR 11-29 16:07:59 [core.py:1]   File "/v/site-packages/vllm/v1/core/sched/scheduler.py", line 2105, in update_from_output
(EngineCore pid=3) ERROR 11-29 16:07:59 [core.py:1]     req_index = model_runner_output.req_id_to_index[req_id]
(EngineCore pid=3) ERROR 11-29 16:07:59 [core.py:1] KeyError: 'r0-8e285255'
"""


def test_tracebacks_from_a_vllm_log():
    tbs = parse_tracebacks(LOG)
    assert [(t.process, t.level, t.exc_type) for t in tbs] == [
        ("MainProcess", "WARNING", "ValueError"), ("Worker_PP1", "ERROR", "AssertionError"),
        ("EngineCore", "ERROR", "KeyError")]
    pp1 = tbs[1]
    assert pp1.frames[-1]["code"] == "assert self.intermediate_tensors is not None"
    assert signature(pp1.exc_type, pp1.frames, "vllm") == \
        "AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors"
    assert signature("X", [{"file": "/a/b.py", "func": "f"}], "vllm") == "X@<outside vllm>"


def test_case_to_llm_kwargs():
    from fuzz.targets.vllm.configs import VLLM_MODEL, VLLMOptions, cell_name
    from fuzz.targets.vllm.launch import llm_kwargs, worker_env

    cfg = VLLM_MODEL.replace(layout="tp1pp2")
    kw = llm_kwargs(cfg)
    assert kw["pipeline_parallel_size"] == 2 and kw["enforce_eager"] and kw["distributed_executor_backend"] == "mp"
    assert kw["block_size"] == 32 and kw["skip_tokenizer_init"] and kw["dtype"] == "float32"
    assert cell_name(cfg) == "tp1pp2-eager"
    comp = VLLM_MODEL.replace(cudagraph_mode="FULL", capture_sizes=(1, 2), speculative_method="ngram",
                              num_speculative_tokens=2)
    assert not llm_kwargs(comp)["enforce_eager"]
    assert llm_kwargs(comp)["speculative_config"]["num_speculative_tokens"] == 2
    assert cell_name(comp, VLLMOptions(enable_prefix_caching=True)) == "tp1pp1-compiled-ngram2+enable_prefix_caching"
    env = worker_env(cfg)
    assert env["VLLM_CPU_KVCACHE_SPACE"] and "VLLM_CPU_OMP_THREADS_BIND" in env


def test_vllm_processes_get_one_thread_and_a_short_spin_unless_the_user_says_otherwise(monkeypatch):
    from fuzz.targets.vllm.configs import VLLM_MODEL
    from fuzz.targets.vllm.launch import worker_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LLMFUZZ_VLLM_SPIN_S", raising=False)
    env = worker_env(VLLM_MODEL)
    assert env["OMP_NUM_THREADS"] == "1" and float(env["LLMFUZZ_VLLM_SPIN_S"]) < 0.1
    from fuzz.targets.vllm.checker import vllm_case
    from fuzz.targets.vllm.target import reproducer_meta

    meta = reproducer_meta(vllm_case([([1, 2], 3)], layout="tp2pp1"), None, "x")  # what a reproducer says it ran with
    assert {k: meta["env"][k] for k in ("OMP_NUM_THREADS", "LLMFUZZ_VLLM_SPIN_S")} == {
        "OMP_NUM_THREADS": "1", "LLMFUZZ_VLLM_SPIN_S": env["LLMFUZZ_VLLM_SPIN_S"]}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("LLMFUZZ_VLLM_SPIN_S", "")  # vLLM's own spin
    env = worker_env(VLLM_MODEL)
    assert env["OMP_NUM_THREADS"] == "4" and env["LLMFUZZ_VLLM_SPIN_S"] == ""


def test_cli_parser_is_light():
    """add_vllm_parser imports neither torch nor vLLM (llmfuzz --help stays fast)."""
    import subprocess
    import sys

    code = ("import argparse, sys; from fuzz.cli.vllm import add_vllm_parser; "
            "p = argparse.ArgumentParser(); add_vllm_parser(p.add_subparsers()); "
            "print('torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_start_up_outside_the_engine_is_the_adapters_error() -> None:
    from fuzz.targets.runs import TargetFailure, adapter_error

    assert "harness error" in adapter_error(TargetFailure("startup", "TypeError@<outside vllm>", "x"), "vllm")
    assert adapter_error(TargetFailure("startup", "ValueError@vllm/config/model.py:f"), "vllm") is None
    assert adapter_error(TargetFailure("crash", "TypeError@<outside vllm>"), "vllm") is None  # after start: a crash
