"""Honest coverage counts in a vLLM campaign's summary (fuzz.targets.vllm.summary): a config
is visited, and its pairs exercised, only by passing examples that reached its features
(drafts with n-gram speculation, a prefix-cache hit with caching, more than a one-token
request for all); every pair not exercised is listed. Counted from example counts, no clock."""
from __future__ import annotations

from types import SimpleNamespace

from fuzz.campaign.summary import CellStats, Summary
from fuzz.cases.case import RequestSpec, Workload
from fuzz.targets.vllm.checker import reached, vllm_case
from fuzz.targets.vllm.configs import parse_cell_name
from fuzz.targets.vllm.plan import plan_report
from fuzz.targets.vllm.summary import summary_json, summary_table
from fuzz.targets.vllm.target import VLLMTarget

PLAIN, NGRAM, CACHING = "tp1pp1-eager", "tp1pp1-eager-ngram3", "tp1pp1-eager+enable_prefix_caching"


def campaign(reached_by_cell: dict[str, dict[str, int]]):
    names = [PLAIN, NGRAM, CACHING]
    plan = plan_report([parse_cell_name(n) for n in names], ("tp1pp1",), ("eager",))
    s = Summary(planned=names, budget_s=60, seed=0)
    for n, r in reached_by_cell.items():
        s.cells[(n, "")] = CellStats(examples=sum(r.values()), notes={"reached": r})
    runner = SimpleNamespace(starts=[], vllm_version="x", slow_steps=[], compile_waits=[])
    return s, VLLMTarget([], checker=SimpleNamespace(runner=runner, hf=None), plan=plan)


def test_a_config_counts_only_by_examples_that_reached_its_features():
    s, t = campaign({PLAIN: {"work": 2}, NGRAM: {"work": 3}, CACHING: {"none": 1}})
    doc = summary_json(s, t)
    reach = doc["config_reach"]
    assert reach[PLAIN]["reached"] and reach[PLAIN]["work"] == 2
    assert not reach[NGRAM]["reached"] and reach[NGRAM]["missing"] == ["drafts"]
    assert not reach[CACHING]["reached"] and reach[CACHING]["missing"] == ["hits", "work"]
    assert doc["configs_visited"] == 1 and doc["configs_started"] == 3
    pairs = doc["pairs_exercised"]
    assert "spec=3 x prefix=False" in pairs["pairs_not_exercised"]
    assert "spec=0 x prefix=True" in pairs["pairs_not_exercised"]
    assert pairs["not_exercised"] == len(pairs["pairs_not_exercised"]) > 0
    table = summary_table(s, t)
    assert "configs visited (an example reached their features): 1 of 3 planned" in table
    assert f"{NGRAM} (drafts)" in table and f"{CACHING} (hits, work)" in table
    for p in pairs["pairs_not_exercised"]:  # every one listed, none hidden
        assert p in table


def test_drafts_and_hits_reached_exercise_their_pairs():
    before = summary_json(*campaign({PLAIN: {"work": 2}, NGRAM: {"work": 3}, CACHING: {"none": 1}}))
    after = summary_json(*campaign({PLAIN: {"work": 2}, NGRAM: {"work": 3, "drafts+work": 1},
                                    CACHING: {"hits+sampled+work": 1}}))
    assert after["configs_visited"] == 3 and after["pairs_exercised"]["not_exercised"] == 0
    assert after["pairs_exercised"]["covered"] > before["pairs_exercised"]["covered"]
    assert after["config_reach"][CACHING]["sampled"] == 1
    apart = summary_json(*campaign({PLAIN: {"work": 1}, NGRAM: {"work": 1}, "tp1pp1-eager-ngram3+enable_prefix_caching":
                                    {"drafts+work": 1, "hits+work": 1}}))
    assert apart["config_reach"]["tp1pp1-eager-ngram3+enable_prefix_caching"]["missing"] == \
        ["drafts+hits+work in one example"]


def test_what_one_example_reached():
    one = vllm_case([([1], 1)])
    assert reached(one, {"cached_tokens": 0}) == frozenset()
    two = vllm_case(Workload((RequestSpec((1, 2, 3), 2, cache_salt="a"), RequestSpec((1, 2), 1, abort_step=1))))
    assert reached(two, {"cached_tokens": 32, "aborted": 1, "sampled": 0}) == {"work", "hits", "abort"}
