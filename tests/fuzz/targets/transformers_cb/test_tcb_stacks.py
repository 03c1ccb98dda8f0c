"""A died transformers-cb worker named from its log (fuzz.targets.transformers_cb.stacks.death_signature):
the thread faulthandler says the signal hit, and what the process printed as it died."""
from __future__ import annotations

from fuzz.targets.transformers_cb.stacks import death_signature

DUMP = """Loading weights: 100%|##########| 21/21
terminate called after throwing an instance of 'c10::Error'
  what():  CUDA error: an illegal memory access was encountered
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/w/fuzz/targets/transformers_cb/worker.py", line 250 in _serve

Current thread 0x00007f0000000002 (most recent call first):
  File "/site-packages/torch/cuda/graphs.py", line 88 in replay
  File "/site-packages/transformers/generation/continuous_batching/continuous_api.py", line 900 in _generation_step
  File "/site-packages/transformers/generation/continuous_batching/continuous_api.py", line 950 in _run_generation_loop
  File "/usr/lib/python3.11/threading.py", line 982 in run

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


def test_the_thread_the_signal_hit_names_the_death() -> None:
    sig, detail = death_signature(DUMP, -6)
    assert sig == "ProcessDied(rc=-6)@transformers/generation/continuous_batching/continuous_api.py:_generation_step"
    assert detail.startswith("Fatal Python error: Aborted; printed before it: ")
    assert "illegal memory access" in detail and "graphs.py:88:replay" in detail
    assert "Extension modules" not in detail


def test_without_a_dump_the_log_tail_is_the_detail() -> None:
    assert death_signature("a\nb\nSegmentation fault", -11) == ("ProcessDied(rc=-11)@transformers_cb_worker",
                                                                  "a | b | Segmentation fault")
    assert death_signature("", None) == ("ProcessDied(rc=None)@transformers_cb_worker", "")
