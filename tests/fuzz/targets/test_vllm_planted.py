"""The vLLM target's judging on a real vLLM (skips without it): a planted n-gram drafter bug is caught by the
draft property while the output tokens stay right; a planted hang is named by its stuck frame
once a fresh engine stalls too; our n-gram rule agrees with vLLM's own proposer function. The bugs are planted
by fuzz/targets/vllm/site/sitecustomize.py inside the vLLM process (LLMFUZZ_VLLM_PLANT), never
by editing the installed vLLM."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from fuzz.cases.case import RequestSpec, Workload  # noqa: E402
from fuzz.targets.runs import TargetFailure  # noqa: E402
from fuzz.targets.vllm.checker import VLLMChecker, VLLMDraft, vllm_case  # noqa: E402
from fuzz.targets.vllm.configs import parse_cell_name  # noqa: E402
from fuzz.targets.vllm.drafts import expected_draft  # noqa: E402
from fuzz.targets.vllm.runner import VLLMRunner  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Repetitive prompts: the n-gram proposer has matches to draft from at every step.
WORKLOAD = Workload(tuple(RequestSpec(tuple([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3][: 5 + i]), 12, i % 2) for i in range(4)))


def _case(name: str):
    cfg, opts = parse_cell_name(name)
    return vllm_case(WORKLOAD, cfg, opts)


def test_our_ngram_rule_is_vllms(tmp_path):
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as theirs

    rng = np.random.default_rng(0)
    for _ in range(400):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int32)
        min_n, max_n, k = int(rng.integers(1, 3)), int(rng.integers(2, 5)), int(rng.integers(1, 5))
        max_n = max(max_n, min_n)
        want = list(theirs(toks, min_n, max_n, 48, k))
        assert expected_draft(list(toks), len(toks), k, min_n, max_n, 48) == want, (list(toks), min_n, max_n, k)


def test_planted_drafter_bug_is_caught_by_the_draft_property(tmp_path, monkeypatch):
    case = _case("tp1pp1-eager-ngram3")
    clean = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "clean")), transformers=False)
    try:
        v = clean.check(case)  # the real proposer: drafts as the token history implies
        st = clean.draft_stats["tp1pp1-eager-ngram3"]
        assert st.proposals > 0 and st.drafted > 0 and st.mismatches == 0
        tokens = {rid: r.token_ids for rid, r in clean.runner.run(case).results.items()}
    finally:
        clean.close()
    assert v is not None
    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", "ngram_offbyone")
    bugged = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "bugged")), transformers=False)
    try:
        with pytest.raises(VLLMDraft) as ei:
            bugged.check(case)
        assert "n-gram drafts differ" in str(ei.value)
        # ... while the output tokens are exactly the clean engine's (greedy verification).
        assert {rid: r.token_ids for rid, r in bugged.runner.run(case).results.items()} == tokens
    finally:
        bugged.close()


def test_planted_hang_is_named_by_its_stuck_frame_after_a_fresh_engine_stalls_too(tmp_path, monkeypatch):
    """The stall is re-run on a fresh engine (whose third `schedule` hangs again) with RERUN_K
    x the watchdog before it is reported: within both watchdogs, the fresh start and the dumps."""
    from fuzz.targets.vllm.watchdog import RERUN_K

    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", "hang_schedule:3")
    t = VLLMRunner(spare=False, hang_s=10.0, log_dir=str(tmp_path))
    try:
        t.ensure(*parse_cell_name("tp1pp1-eager"))
        watchdog = t.watchdog_s(t._w)  # the start-up measured here, or the floor
        t0 = time.monotonic()
        with pytest.raises(TargetFailure) as ei:
            t.run(_case("tp1pp1-eager"))
        took = time.monotonic() - t0
    finally:
        t.close()
    assert ei.value.kind == "hang" and "on a fresh engine" in ei.value.detail
    assert ei.value.signature == "hang@fuzz/targets/vllm/site/sitecustomize.py:planted_hang", ei.value.detail
    assert t.slow_steps == [] and len(t.starts) == 2
    assert took < (1 + RERUN_K) * watchdog + t.starts[1]["seconds"] + 20, (took, watchdog)
