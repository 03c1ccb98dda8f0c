"""Planted bugs in the transformers-cb worker (`LLMFUZZ_TCB_PLANT`, fuzz/targets/transformers_cb/
worker.py) are caught as what they are: the scheduler raising -> a crash keyed by its
innermost transformers frame (the worker, whose library failed the run cleanly, runs the
next); the scheduler never returning -> a hang named by the stuck frame within `hang_s`; a KV cache kept referenced after the manager is destroyed -> a leak.
The clean worker passes the same Case (tests/fuzz/targets/transformers_cb/test_tcb_runner.py)."""
from __future__ import annotations

import importlib.util
import time

import pytest

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.targets.runs import TargetFailure
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
              pytest.mark.slow]

CASE = CBOptions().on(Case(CB_MODEL.replace(max_num_batched_tokens=16),
                           Workload((RequestSpec(tuple(range(1, 30)), 4), RequestSpec((5, 6), 3, arrival_step=1)))))


def run_planted(monkeypatch, plant: str, survives: bool = False, **kw):
    """The failure the planted bug causes; then, if `survives` (a run the library failed
    cleanly, on the CPU), the same worker runs the Case again (the plant fires once)."""
    from fuzz.targets.transformers_cb.runner import CBRunner

    monkeypatch.setenv("LLMFUZZ_TCB_PLANT", plant)
    r = CBRunner(**kw)
    try:
        with pytest.raises(TargetFailure) as e:
            r.run(CASE)
        if survives:
            assert len(r.run(CASE).results) == 2 and len(r.starts) == 1
        else:
            assert r._w is None  # the worker is gone: its state is unknown after this failure
        return e.value
    finally:
        r.close()


def test_scheduler_raising_is_a_crash_with_its_signature(monkeypatch):
    f = run_planted(monkeypatch, "raise_schedule:3", survives=True)
    assert f.kind == "crash"
    assert f.signature == "RuntimeError@transformers/generation/continuous_batching/continuous_api.py:prepare_next_batch"
    assert "planted scheduler failure" in f.detail


def test_scheduler_never_returning_is_a_hang_named_by_its_frame(monkeypatch):
    t0 = time.monotonic()
    f = run_planted(monkeypatch, "hang_schedule:2", hang_s=4.0)
    assert f.kind == "hang"
    assert f.signature == "hang@transformers/generation/continuous_batching/continuous_api.py:prepare_next_batch"
    assert time.monotonic() - t0 < 60  # start-up, 4 s without a batch, the stack dump


def test_a_native_abort_is_named_by_the_thread_it_hit(monkeypatch):
    """The process dies of SIGABRT in the library's thread: the report names that thread's
    innermost transformers frame and what the process printed as it died, not the main
    thread's wait nor the log's last lines (faulthandler's module list)."""
    f = run_planted(monkeypatch, "abort_schedule:2")
    assert f.kind == "crash"
    assert f.signature == ("ProcessDied(rc=-6)@transformers/generation/continuous_batching/continuous_api.py:"
                           "prepare_next_batch")
    assert f.detail.startswith("Fatal Python error: Aborted") and "planted abort" in f.detail
    assert "planted_schedule_batch" in f.detail and "Extension modules" not in f.detail


def test_cache_kept_alive_is_a_leak(monkeypatch):
    f = run_planted(monkeypatch, "leak_cache")
    assert (f.kind, f.signature) == ("leak", "leak@transformers:cache_alive")


def test_a_cuda_error_the_library_logs_and_swallows_is_a_crash(monkeypatch):
    """The library's warm-up catches a CUDA error, logs "Failed to warm up: CUDA error: ..." as
    a warning and generates on; the run is a crash keyed by the library's frame that logged it."""
    f = run_planted(monkeypatch, "warmup_cuda_error:2", survives=True)  # 1: the configure check
    assert f.kind == "crash"
    assert f.signature == "LoggedCUDAError@transformers/generation/continuous_batching/model_runner.py:run_one_warmup"
    assert "Failed to warm up: CUDA error: device-side assert triggered (planted)" in f.detail
