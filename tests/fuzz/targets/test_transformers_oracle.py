"""The transformers oracle of the vLLM target (fuzz.verdict.oracles.hf.TransformersOracle,
fuzz.verdict.compare.check_teacher_forced) on the checkpoint the harness writes, checked here against our reference
engine's outputs (no vLLM needed): it agrees with a correct run and catches wrong ones."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fuzz.targets.reference import ReferenceRunner  # noqa: E402
from fuzz.targets.runs import RequestResult, request_items  # noqa: E402
from fuzz.verdict.compare import RunMismatch, check_teacher_forced  # noqa: E402
from fuzz.verdict.oracles.hf import TransformersOracle  # noqa: E402
from fuzz.targets.vllm.checker import logprob_tolerance, vllm_case  # noqa: E402
from fuzz.targets.vllm.configs import VLLM_MODEL  # noqa: E402
from fuzz.targets.vllm.launch import checkpoint_dir  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import os

    old = os.environ.get("LLMFUZZ_CACHE")
    os.environ["LLMFUZZ_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    ref = ReferenceRunner(top_k=5)
    case = vllm_case([([1, 2, 3], 6), (list(range(10, 50)), 4), ((9,) * 33, 3)])
    run = ref.run(case).results
    tol = logprob_tolerance(case.config, ref.logit_absmax(case))
    path = checkpoint_dir(case.config)
    yield TransformersOracle(), path, case, run, tol
    ref.close()
    if old is None:
        os.environ.pop("LLMFUZZ_CACHE", None)
    else:
        os.environ["LLMFUZZ_CACHE"] = old


def _prompts(case):
    return {rid: r.prompt_token_ids for rid, r in request_items(case)}


def test_reference_agrees_with_transformers(setup):
    hf, path, case, run, tol = setup
    rep = check_teacher_forced(hf, path, _prompts(case), run, lp_tol=tol, margin_tol=tol, name="reference")
    assert rep.positions == 6 + 4 + 3
    assert rep.max_lp_error < tol / 10  # same weights, fp32: far inside the tolerance


def test_prompt_logprobs_are_checked(setup):
    """Prompt logprobs as vLLM returns them (the prompt token plus the top-k, for prompt
    tokens 1..), built from transformers itself: they pass; shifted by one position they fail."""
    hf, path, case, run, tol = setup
    prompt = tuple(case.workload.requests[1].prompt_token_ids)
    lp = hf.logprobs(path, prompt)
    pos = []
    for j in range(1, len(prompt)):
        vals, idx = lp[j - 1].topk(5)
        top = dict(zip(idx.tolist(), vals.tolist()))
        top[prompt[j]] = float(lp[j - 1, prompt[j]])
        pos.append(tuple(sorted(top.items(), key=lambda p: -p[1])))
    r1 = run["r1"]
    good = {"r1": RequestResult(r1.token_ids, r1.logprobs, tuple(pos))}
    rep = check_teacher_forced(hf, path, {"r1": prompt}, good, lp_tol=tol, margin_tol=tol)
    assert rep.prompt_positions == len(prompt) - 1
    shifted = {"r1": RequestResult(r1.token_ids, r1.logprobs, tuple(pos[1:]) + (pos[-1],))}
    with pytest.raises(RunMismatch, match="prompt position"):
        check_teacher_forced(hf, path, {"r1": prompt}, shifted, lp_tol=tol, margin_tol=tol)


def test_wrong_logprob_or_token_is_caught(setup):
    hf, path, case, run, tol = setup
    r0 = run["r0"]
    off = tuple(tuple((t, v + (3 * tol if i == 2 else 0.0)) for t, v in p) for i, p in enumerate(r0.logprobs))
    with pytest.raises(RunMismatch, match="position 2: logprob of token"):
        check_teacher_forced(hf, path, {"r0": (1, 2, 3)}, {"r0": RequestResult(r0.token_ids, off)},
                             lp_tol=tol, margin_tol=tol)
    second = r0.logprobs[0][1][0]  # the runner-up at position 0, clearly not a near-tie here
    toks = (second,) + r0.token_ids[1:]
    with pytest.raises(RunMismatch, match="argmax"):
        check_teacher_forced(hf, path, {"r0": (1, 2, 3)}, {"r0": RequestResult(toks, r0.logprobs)},
                             lp_tol=tol, margin_tol=tol)


def test_checker_uses_transformers_when_available(fake):
    from fuzz.targets.vllm.checker import VLLMChecker

    chk = VLLMChecker(fake("ok"))
    assert chk.hf is not None
    chk.close()
    chk = VLLMChecker(fake("ok"), transformers=False)
    assert chk.hf is None
    chk.close()
    assert VLLM_MODEL.head_dim == 64
