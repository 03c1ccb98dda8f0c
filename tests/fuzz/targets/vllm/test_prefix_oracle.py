"""The `vllm_prefix_cache` property without vLLM: reported cached-token counts (synthetic, as
vLLM's `num_cached_tokens` would be) judged against the harness's own cache model over what
the engine served before (fuzz.targets.vllm.prefix): a planted cross-salt hit is caught, a
lost hit where nothing can have been evicted is caught, and what vLLM may legitimately do
(hit its own run's blocks, an aborted request's unseen output, evict under a small pool, not
read the cache for prompt logprobs) is not."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fuzz.cases.case import RequestSpec, Workload
from fuzz.targets.blackbox import engine_items
from fuzz.targets.runs import RequestResult, TargetRun
from fuzz.targets.vllm import checker as vc
from fuzz.targets.vllm.configs import VLLMOptions
from fuzz.targets.vllm.prefix import EngineCache

PROMPT = tuple(range(1, 41))  # 40 tokens: one full block of 32, then 8


class StubRunner:
    """A black-box runner that answers token 7 and reports `reported[rid]` cached tokens, with
    the real ledger judging every run, as VLLMRunner does."""

    supports_sampling = supports_aborts = supports_prompt_logprobs = True

    def __init__(self, enabled: bool = True, free: int = 30000) -> None:
        self.cache, self.free, self.reported, self.aborted = EngineCache(32, enabled), free, {}, {}
        self.last_prefix = None

    def engine_key(self, case) -> str:
        return "stub"

    def run(self, case, items=None, prompt_logprobs: bool = False) -> TargetRun:
        items = items if items is not None else engine_items(case)
        results = {rid: RequestResult((7,) * r.max_tokens, (((7, -0.1),),) * r.max_tokens, (),
                                      self.reported.get(rid, 0)) for rid, r in items if rid not in self.aborted}
        run = TargetRun(results, aborted=dict(self.aborted), free_blocks=(self.free, self.free))
        self.last_prefix = self.cache.judge(items, run, prompt_logprobs)
        return run

    def close(self) -> None:
        """Nothing to shut down: no worker process behind this fake."""


def case_of(*reqs: RequestSpec):
    return VLLMOptions(enable_prefix_caching=True).on(vc.vllm_case(Workload(tuple(reqs))))


def checker(runner: StubRunner) -> vc.VLLMChecker:
    return vc.VLLMChecker(runner, transformers=False)


def test_a_planted_cross_salt_hit_is_caught():
    """A prompt served under salt "a", then the same prompt under salt "b" reporting the
    block as cached: KV shared across tenants, the same tokens, so no output differs."""
    t = StubRunner()
    chk = checker(t)
    chk.run(case_of(RequestSpec(PROMPT, 2, cache_salt="a")))
    t.reported = {"r0": 32}
    with pytest.raises(vc.VLLMPrefixCache) as ei:
        chk.run(case_of(RequestSpec(PROMPT, 2, cache_salt="b")))
    assert ei.value.signature == "vllm_prefix_cache:above" and "reported 32 cached tokens" in str(ei.value)
    chk.run(case_of(RequestSpec(PROMPT, 2, cache_salt="a")))  # its own salt: the hit is right


def test_a_hit_equals_the_model_where_nothing_can_have_been_evicted():
    t = StubRunner()
    chk = checker(t)
    chk.run(case_of(RequestSpec(PROMPT, 2)))
    with pytest.raises(vc.VLLMPrefixCache) as ei:  # reported 0: the block earlier runs left was lost
        chk.run(case_of(RequestSpec(PROMPT, 2)))
    assert ei.value.signature == "vllm_prefix_cache:below" and "model allows 32..32" in str(ei.value)
    t.reported = {"r0": 32}
    chk.run(case_of(RequestSpec(PROMPT, 2)))
    assert t.last_prefix.requests["r0"] == (32, 32, 32)
    judged = chk.mix_stats["tp1pp1-eager+enable_prefix_caching"]
    assert judged["cache_judged"] == 3 and judged["cache_exact"] == 3  # counted for the summary
    with pytest.raises(vc.VLLMPrefixCache):  # more than the whole block: no such hit exists
        t.reported = {"r0": 64}
        chk.run(case_of(RequestSpec(PROMPT + PROMPT, 2)))


def test_a_small_pool_may_evict_so_only_the_upper_bound_holds():
    t = StubRunner(free=4)  # the two runs may take 3 blocks each
    chk = checker(t)
    chk.run(case_of(RequestSpec(PROMPT, 2)))
    chk.run(case_of(RequestSpec(PROMPT, 2)))  # reported 0: it may have been evicted
    assert t.last_prefix.requests["r0"] == (0, None, 32)


def test_a_hit_on_blocks_of_its_own_run_and_an_aborted_requests_unseen_output():
    t = StubRunner()
    chk = checker(t)
    t.reported = {"r1": 32}  # r1 arrives after r0 and hits r0's block, in the same run
    chk.run(case_of(RequestSpec(PROMPT, 2), RequestSpec(PROMPT, 2, arrival_step=1)))
    assert t.last_prefix.requests["r1"] == (32, 0, 32)
    t2 = StubRunner()
    chk2 = checker(t2)
    t2.aborted = {"r0": 3}  # 30 prompt tokens, then up to 10 unseen: its first block may be full
    chk2.run(case_of(RequestSpec(PROMPT[:30], 10, abort_step=3)))
    t2.aborted, t2.reported = {}, {"r0": 32}
    chk2.run(case_of(RequestSpec(PROMPT[:30] + (99, 98, 97, 96, 95), 2)))


def test_no_hit_without_caching_or_with_prompt_logprobs():
    t = StubRunner(enabled=False)
    chk = checker(t)
    chk.run(case_of(RequestSpec(PROMPT, 2)))
    t.reported = {"r0": 32}
    with pytest.raises(vc.VLLMPrefixCache):
        chk.run(case_of(RequestSpec(PROMPT, 2)))
    t = StubRunner()
    chk = checker(t)
    chk.run(case_of(RequestSpec(PROMPT, 2)))
    t.reported = {"r0": 0}
    chk.run(case_of(RequestSpec(PROMPT, 2)), prompt_logprobs=True)  # vLLM does not read the cache for it
    assert t.last_prefix.requests["r0"] == (0, 0, 0)


def test_solo_runs_are_judged_and_served_like_batch_runs():
    """A request run alone (its salt dropped, as the batch-invariance oracle runs it) hits
    what an unsalted batch request left, not what a salted one left."""
    t = StubRunner()
    chk = checker(t)
    case = case_of(RequestSpec(PROMPT, 2, cache_salt="a"), RequestSpec(PROMPT[:36], 2))
    chk.run(case)
    t.reported = {"r1": 32}
    chk.run(case, [("r1", replace(case.workload.requests[0], cache_salt=None))])
    assert t.last_prefix.requests["r1"] == (32, 32, 32)
