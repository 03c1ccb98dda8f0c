"""fuzz/campaign/summary.py: what a campaign reports per cell besides examples and failures:
the prefix-cache hit rate, the sampling mix, aborts, preemptions and the config limits its
Cases reached, in the summary JSON, the text table and the report (fuzz/report/render.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from fuzz.campaign.loop import Campaign
from fuzz.campaign.summary import CellStats, Summary, all_cells, reach_row
from fuzz.cases.limits import LIMITS
from fuzz.report.render import job_summary_md, render_html
from fuzz.targets.reference import HarnessTarget, tally

REACH_KEYS = ("sampling_share", "random_sampling_share", "penalties_share", "abort_share")


class CountingHarness:
    """Passes every Case, reporting the counters the real harness's Verdict carries: half of
    the prompt tokens of a Case with prefix caching on found cached, a preemption where the
    Case's KV pool is one block short."""

    def check(self, case):
        cfg, prompts = case.config, case.workload.num_prompt_tokens
        queried = prompts if cfg.enable_prefix_caching else 0
        return SimpleNamespace(logits=SimpleNamespace(ratio=0.1), case=case, prefix_queried_tokens=queried,
                               prefix_hit_tokens=queried // 2,
                               num_preemptions=int("kv blocks + 1" in tally(case)))

    def close(self) -> None:
        pass


def test_a_short_campaign_reports_reach_per_cell_above_zero(tmp_path) -> None:
    from fuzz_testutil import FakeClock

    clock = FakeClock()  # each check moves it 50 ms: the budget is about 120 examples, however loaded the machine

    class Timed(CountingHarness):
        def check(self, case):
            clock.sleep(0.05)
            return super().check(case)

    camp = Campaign(layouts=("tp1pp2",), modes=("eager", "graph"), seed=0, out_dir=str(tmp_path), harness=Timed(),
                    budget_s=6, progress=False, clock=clock)
    s = camp.run()
    doc = json.loads(json.dumps(s.to_json()))
    rows = doc["per_cell"]
    assert rows and all(r["examples"] > 0 for r in rows.values())
    total = doc["reach"]
    for key in REACH_KEYS + ("prefix_hit_rate",):
        assert total[key] > 0, key
        assert all(0 <= r[key] <= 1 for r in rows.values() if r.get(key) is not None)
    assert 0 < total["limits_reached"] <= len(LIMITS) and set(total["limits"]) <= set(LIMITS)
    assert all(0 < v <= 1 for v in total["limits"].values())
    # Every row says how many limits its Cases reached, and the text table shows it.
    assert all(r["limits_reached"] == len(r["limits"]) for r in rows.values())
    table = s.table()
    assert "hit%" in table and "limits" in table.splitlines()[0]
    assert f"{total['limits_reached']}/{len(LIMITS)}" in table.splitlines()[-1]
    # Each passing example's error/tolerance (0.1 here) in its row, by decade, with the max,
    # the dtype it ran in and the case classes its strategy labelled (not its layout or mode).
    for row in rows.values():
        assert row["error_ratio_hist"] == {"1e-1": row["examples"]} and row["error_ratio_max"] == 0.1
        assert row["dtype"] == "float32"
        assert row["events"] and not any(k.startswith(("layout=", "mode=", "limit: ")) for k in row["events"])
    assert doc["error_ratio_hist"] == {"1e-1": doc["examples"]}
    assert "max e/t" in table.splitlines()[0] and all("1.0e-01" in line for line in table.splitlines()[1:])


def test_rows_merged_from_workers_add_counts_and_keep_the_larger_max() -> None:
    """`run --jobs` and `llmfuzz merge` add workers' rows up (jobs_worker.merge_reports); a
    report written before the per-cell error/tolerance existed adds its counts only."""
    from fuzz.campaign.jobs_worker import merge_reports
    from fuzz.campaign.summary import note_example, summary_doc

    docs = []
    for ratios, dtype in (([0.0, 2e-3], "float32"), ([5e-3, 0.3, 0.0], "bfloat16")):
        s = Summary(examples=len(ratios), seconds=1.0)
        c = s.cells[("tp1pp1", "eager")] = CellStats(examples=len(ratios), seconds=1.0)
        for r in ratios:
            note_example(c, r, dtype, ["abort"])
        docs.append(json.loads(json.dumps(summary_doc(s, None))))
    old = json.loads(json.dumps(docs[0]))
    for k in ("dtype", "ratio_hist", "ratio_max", "events"):
        del old["cells"][0][1][k]
    part = {"layouts": ["tp1pp1"], "stream": 0, "streams": 1}
    merged, _ = merge_reports([(i, part, d) for i, d in enumerate(docs + [old])], budget_s=1.0, seed=0)
    row = merged.to_json()["per_cell"]["tp1pp1/eager"]
    assert row["examples"] == 7 and row["error_ratio_hist"] == {"0": 2, "1e-3": 2, "1e-1": 1}
    assert row["error_ratio_max"] == 0.3 and row["dtype"] == "bfloat16,float32" and row["events"] == {"abort": 5}
    assert "3.0e-01" in merged.table()


def test_reach_row_is_shares_of_the_rows_cases_and_requests() -> None:
    c = CellStats(examples=4, notes={"cases": 4, "requests": 10, "requests_sampling": 5, "requests_random": 2,
                                     "requests_penalties": 1, "cases_with_abort": 1, "cases_preempted": 2,
                                     "limit: max_model_len": 2, "limit: budget 1": 1})
    assert reach_row(c) == {"sampling_share": 0.5, "random_sampling_share": 0.2, "penalties_share": 0.1,
                            "abort_share": 0.25, "preemption_share": 0.5, "limits_reached": 2,
                            "limits": {"budget 1": 0.25, "max_model_len": 0.5}}
    assert reach_row(CellStats()) == {}  # a target that counts nothing (vLLM's) reports nothing
    both = all_cells([c, CellStats(notes={"cases": 4, "requests": 10, "stopped_by": "x"})])
    assert reach_row(both)["sampling_share"] == 0.25 and "stopped_by" not in both.notes


def test_report_shows_reach_per_cell() -> None:
    target, stats = HarnessTarget(CountingHarness()), CellStats(examples=1, seconds=1.0)
    from fuzz.cases.case import Case, RequestSpec, Workload
    from engine.sample.sampling_params import SamplingParams
    from fuzz.cases.strategies import FUZZ_MODEL

    case = Case(FUZZ_MODEL.replace(enable_prefix_caching=True),
                Workload((RequestSpec(tuple(range(60)), 4, sampling=SamplingParams(temperature=1.0)),
                          RequestSpec((1, 2), 1, abort_step=1))))
    target.record(stats, CountingHarness().check(case))
    doc = json.loads(json.dumps(Summary(examples=1, seconds=1.0, cells={("tp1pp1", "eager"): stats}).to_json()))
    row = doc["per_cell"]["tp1pp1/eager"]
    assert (row["prefix_hit_rate"], row["sampling_share"], row["random_sampling_share"], row["abort_share"]) == \
        (0.5, 0.5, 0.5, 1.0)
    assert row["limits"]["max_model_len"] == 1.0
    html = render_html(doc)
    assert "prefix hit %" in html and "Config limits reached" in html and "max_model_len" in html
    md = job_summary_md(doc)
    assert "| prefix hit % |" in md and "| 50 | 50 | 50 | 0 | 100 |" in md
