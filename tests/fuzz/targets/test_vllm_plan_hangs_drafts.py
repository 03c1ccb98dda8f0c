"""The vLLM target's planning and judging, without vLLM: the covering plan, hang signatures
from faulthandler dumps, the known-failure default, one reproducer per signature, and the
n-gram draft oracle."""
from __future__ import annotations

import itertools
import json

import pytest

from fuzz.targets.vllm.configs import cell_name, parse_cell_name
from fuzz.targets.vllm.launch import llm_kwargs
from fuzz.targets.vllm.covering import DIMENSIONS, coverage, covering_plan, fit_budget, required, valid
from fuzz.targets.vllm.drafts import DraftStats, check_drafts, expected_draft
from fuzz.targets.vllm.known import KNOWN_CRASHES
from fuzz.targets.vllm.stacks import hang_signature, parse_dump, stuck_frame


# -- covering plan -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_valid_pair_is_covered_within_the_first_k_configs(seed):
    rows, k = covering_plan(seed=seed, excluded=KNOWN_CRASHES)
    names = list(DIMENSIONS)
    got = {tuple((n, r[n]) for n in c) for r in rows[:k] for c in itertools.combinations(names, 2)}
    need = required(DIMENSIONS, 2)
    left_out = {(("layout", "tp1pp2"), ("mode", "eager")), (("layout", "tp1pp2"), ("spec", 1)),
                (("layout", "tp1pp2"), ("spec", 3))}
    assert need - got == left_out  # every pair a valid config can have, but the known crashes'
    assert k <= 15 and all(valid(r, KNOWN_CRASHES) for r in rows)
    # no invalid pair was required or planned: async scheduling never meets n-gram drafts
    assert (("spec", 1), ("async", True)) not in need and not any(r["async"] and r["spec"] for r in rows)
    assert all(r["block"] % 32 == 0 and r["budget"] >= 8 for r in rows)
    # a known crash on the first step is not planned (its pairs would be covered on paper
    # only), but its pairs are still required: they count as not covered
    assert not any(r["layout"] == "tp1pp2" and r["mode"] == "eager" for r in rows)
    assert left_out <= need
    every, k = covering_plan(seed=seed)  # --include-known
    assert need <= {tuple((n, r[n]) for n in c) for r in every[:k] for c in itertools.combinations(names, 2)}


def test_rows_after_the_pairs_add_triples():
    rows, k = covering_plan(seed=0)
    before, total = coverage(rows[:k], t=3)
    after, _ = coverage(rows[:k + 4], t=3)
    assert before < after <= total


def test_the_budget_decides_how_many_configs():
    rows, _ = covering_plan(seed=0)
    assert fit_budget(rows, 20) == 1 and fit_budget(rows, 300) < fit_budget(rows, 900) <= len(rows)


def test_plan_report_names_pairs_and_printed_plan(tmp_path):
    from fuzz.targets.vllm.plan import campaign_configs, format_plan, plan_report

    configs = campaign_configs(budget_s=900)
    rep = plan_report(configs)
    # Every pair but those only known crashes' configs have: those are excluded, named with the
    # crash, and counted as not covered.
    assert rep["pairs_covered"] + len(rep["pairs_excluded"]) == rep["pairs_total"] and not rep["pairs_missing"]
    assert rep["pairs_excluded"] == {"layout=tp1pp2 x mode=eager": "known crash 402ca48c42d3",
                                     "layout=tp1pp2 x spec=1": "known crash ea8ba2f472e9",
                                     "layout=tp1pp2 x spec=3": "known crash ea8ba2f472e9"}
    assert f"pairs covered {rep['pairs_covered']}/{rep['pairs_total']}, 3 excluded: " \
        "known crash 402ca48c42d3 (1); known crash ea8ba2f472e9 (2)" in format_plan(rep)
    part = plan_report(configs[:3])
    assert part["pairs_covered"] < part["pairs_total"] and part["pairs_missing"]
    assert "pairs covered" in format_plan(rep) and cell_name(*configs[0]) in format_plan(rep)
    # --include-known plans them: every pair covered, nothing excluded.
    every = campaign_configs(budget_s=900, include_known=True)
    rep = plan_report(every, include_known=True)
    assert rep["pairs_covered"] == rep["pairs_total"] and not rep["pairs_excluded"]
    assert {(c.layout, c.cudagraph_mode) for c, _ in every} >= {("tp1pp2", "NONE")}


def test_a_plan_restricted_to_known_crash_configs_says_what_it_leaves_out():
    from fuzz.targets.vllm.plan import campaign_configs, plan_report

    configs = campaign_configs(budget_s=900, layouts=("tp1pp2",), modes=("compiled",))
    rep = plan_report(configs, ("tp1pp2",), ("compiled",))
    assert all(c.num_speculative_tokens == 0 for c, _ in configs)  # n-gram on pp2 dies at start-up
    assert rep["pairs_excluded"] and set(rep["pairs_excluded"].values()) == {"known crash ea8ba2f472e9"}
    assert rep["pairs_covered"] + len(rep["pairs_excluded"]) == rep["pairs_total"]


def test_cell_names_round_trip_with_the_new_dimensions():
    from fuzz.targets.vllm.configs import plan_configs

    for cfg, opts in plan_configs(20, seed=2):
        assert parse_cell_name(cell_name(cfg, opts)) == (cfg, opts)
        kw = llm_kwargs(cfg, opts)
        assert kw["dtype"] == cfg.dtype and kw["max_model_len"] == cfg.max_model_len
        assert kw.get("num_gpu_blocks_override", 0) == opts.kv_blocks
        if opts.kv_blocks:  # small: one longest request (and a block) fits, a batch does not
            assert opts.kv_blocks * cfg.block_size >= cfg.max_model_len
            assert opts.kv_blocks * cfg.block_size < 2 * cfg.max_model_len + cfg.block_size


def test_the_engine_core_in_its_own_process_is_a_dimension_of_its_own():
    """`+engine_core_process` names it, the engine starts with VLLM_ENABLE_V1_MULTIPROCESSING=1
    (a different engine key, the same vLLM arguments), the plan covers both values, and a
    shrink tries the core back in the client's process."""
    from fuzz.targets.vllm.configs import VLLM_MODEL, VLLMOptions, config_row, plan_rows, row_config
    from fuzz.targets.vllm.launch import engine_env
    from fuzz.targets.vllm.runner import VLLMRunner
    from fuzz.targets.vllm.target import simpler_configs

    cfg, opts = parse_cell_name("tp2pp1-eager+engine_core_process")
    assert opts == VLLMOptions(engine_core_process=True) and cell_name(cfg, opts) == "tp2pp1-eager+engine_core_process"
    assert engine_env(cfg, opts)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert engine_env(cfg)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert llm_kwargs(cfg, opts) == llm_kwargs(cfg) and VLLMRunner.config_key(cfg, opts) != VLLMRunner.config_key(cfg, VLLMOptions())
    rows, k = plan_rows(0)
    assert {r["core"] for r in rows[:k]} == {"inproc", "process"}
    assert all(config_row(*row_config(r)) == r for r in rows[:k])
    assert (cfg, VLLMOptions()) in simpler_configs(cfg, opts)
    assert config_row(VLLM_MODEL, VLLMOptions())["core"] == "inproc"
    # Off, it is not written: reproducers from before it keep their one form.
    assert "engine_core_process" not in VLLMOptions().to_dict() and opts.to_dict()["engine_core_process"] is True


def test_prefix_caching_that_can_never_hit_is_not_planned():
    """A block as long as max_model_len holds no prompt with a token left to compute: such a
    row would have prefix caching on in name only."""
    row = {n: v[0] for n, v in DIMENSIONS.items()}
    assert valid({**row, "prefix": True, "block": 64, "max_len": 128})
    assert not valid({**row, "prefix": True, "block": 128, "max_len": 128})
    assert valid({**row, "prefix": True, "block": 128, "max_len": 256}) and valid({**row, "block": 128})


# -- known default and one reproducer per signature --------------------------------------------

def test_known_defaults_to_committed_reproducers_and_the_known_file(tmp_path):
    from fuzz.targets.vllm.known import default_known

    assert "AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors" in default_known()
    (tmp_path / "reproducers" / "vllm" / "vllm_hang").mkdir(parents=True)
    (tmp_path / "reproducers" / "vllm" / "vllm_hang" / "a.json").write_text(json.dumps({"signature": "hang@vllm/x.py:f"}))
    (tmp_path / "fuzz" / "targets" / "vllm").mkdir(parents=True)
    (tmp_path / "fuzz" / "targets" / "vllm" / "known_failures.txt").write_text("# c\nKeyError@vllm/y.py:g  # why\n")
    assert default_known(str(tmp_path)) == {"hang@vllm/x.py:f", "KeyError@vllm/y.py:g"}


def test_same_signature_in_another_cell_is_counted_not_written_again():
    from fuzz.targets.runs import TargetFailure
    from fuzz.targets.vllm.checker import VLLMCrash, vllm_case
    from fuzz.targets.vllm.target import VLLMTarget

    t = VLLMTarget([], checker=object())
    f = TargetFailure("crash", "KeyError@vllm/v1/core/sched/scheduler.py:update_from_output", "x", "")
    a = VLLMCrash(f, vllm_case([([1], 1)], layout="tp1pp2"))
    b = VLLMCrash(f, vllm_case([([1], 1)], layout="tp2pp1"))
    assert t.triage(a, []) == "new" and t.triage(a, []) == "new"  # the campaign triages a finding twice
    assert t.triage(b, []) == "known" and t.duplicates[0]["first_cell"] == "tp1pp2-eager"


def test_start_estimates_learn_from_the_starts_measured_so_far():
    """A kind already started is estimated at its longest measured start; a kind not yet
    started at the plan's figure times the median slowdown against the plan of the
    pre-imported starts so far, within [1, SLOWDOWN_CAP]: under load the multi-process starts
    ran 1.4-2.3x the plan's, while a fresh machine's cold first start ran 10x, and one long
    estimate starves every config."""
    from types import SimpleNamespace

    from fuzz.targets.vllm.checker import vllm_case
    from fuzz.targets.vllm.covering import startup_cost
    from fuzz.targets.vllm.target import SLOWDOWN_CAP, VLLMTarget

    runner = SimpleNamespace(starts=[])
    t = VLLMTarget([], checker=SimpleNamespace(runner=runner))
    tp1, tp2 = vllm_case([([1], 1)]).config, vllm_case([([1], 1)], layout="tp2pp1").config
    plan_tp1 = startup_cost({"mode": "eager", "layout": "tp1pp1"})
    plan_tp2 = startup_cost({"mode": "eager", "layout": "tp2pp1"})
    plan_core = startup_cost({"mode": "eager", "layout": "tp1pp1", "core": "process"})

    def started(kind, init_s, warm=True, full_s=None):
        runner.starts.append({"kind": kind, "full_s": full_s or init_s, "init_s": init_s,
                              "ok": True, "warm": warm})

    assert t.startup_estimate(tp1) == plan_tp1 and t.startup_estimate(tp2) == plan_tp2
    started([1, False, False], 10 * plan_tp1, warm=False)  # a cold first start: its own kind only
    assert t.startup_estimate(tp1) == 10 * plan_tp1 and t.startup_estimate(tp2) == plan_tp2
    started([1, False, False], 0.5 * plan_tp1)  # faster than planned: the others are not expected faster
    assert t.startup_estimate(tp2) == plan_tp2
    started([1, False, True], 1.8 * plan_core)
    started([1, False, True], 1.6 * plan_core)  # slowdowns 0.5, 1.8, 1.6: the median
    assert t.startup_estimate(tp2) == pytest.approx(1.6 * plan_tp2)
    for _ in range(3):
        started([1, False, True], 5 * plan_core)
    assert t.startup_estimate(tp2) == pytest.approx(SLOWDOWN_CAP * plan_tp2)
    started([2, False, False], 47.0)
    assert t.startup_estimate(tp2) == 47.0


# -- hang signatures from faulthandler dumps ---------------------------------------------------

WORKER_DUMP = '''Thread 0x00007f1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/queue.py", line 180 in get
  File "/v/site-packages/vllm/v1/engine/core.py", line 900 in process_input_sockets
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f0 (most recent call first):
  File "/work/main/fuzz/targets/vllm/site/sitecustomize.py", line 48 in planted_hang
  File "/work/main/fuzz/targets/vllm/site/sitecustomize.py", line 110 in schedule
  File "/v/site-packages/vllm/v1/engine/core.py", line 390 in step
  File "/v/site-packages/vllm/v1/engine/llm_engine.py", line 300 in step
  File "/work/main/fuzz/targets/vllm/worker.py", line 120 in _run
'''
PP_DUMP = '''Current thread 0x00007f5 (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 2000 in recv
  File "/v/site-packages/vllm/distributed/parallel_state.py", line 800 in recv_tensor_dict
  File "/v/site-packages/vllm/v1/worker/gpu_worker.py", line 600 in execute_model
'''
IDLE_DUMP = '''Current thread 0x00007f9 (most recent call first):
  File "/v/site-packages/zmq/sugar/socket.py", line 700 in recv_multipart
  File "/v/site-packages/vllm/v1/engine/core_client.py", line 670 in get_output
  File "/v/site-packages/vllm/v1/engine/llm_engine.py", line 290 in step
'''


def test_parse_dump_threads_and_frames_innermost_first():
    threads = parse_dump(WORKER_DUMP)
    assert [t["current"] for t in threads] == [False, True]
    assert threads[1]["frames"][0] == {"file": "/work/main/fuzz/targets/vllm/site/sitecustomize.py", "line": 48,
                                       "func": "planted_hang"}


def test_the_stuck_thread_names_the_hang_not_the_waiting_ones():
    assert hang_signature({200: IDLE_DUMP, 100: WORKER_DUMP}) == \
        "hang@fuzz/targets/vllm/site/sitecustomize.py:planted_hang"
    # A PP worker blocked in a torch recv: its innermost vLLM frame (torch is not ours).
    assert hang_signature({7: PP_DUMP, 9: IDLE_DUMP}) == "hang@vllm/distributed/parallel_state.py:recv_tensor_dict"
    # Everything waiting: the innermost vLLM frame of a waiting thread, marked as such.
    fr = stuck_frame({9: IDLE_DUMP})
    assert fr["waiting"] and hang_signature({9: IDLE_DUMP}) == "hang@vllm/v1/engine/core_client.py:get_output"
    assert hang_signature({}) == "hang@run" and hang_signature({1: "garbage"}, "hang@startup") == "hang@startup"


# -- the n-gram draft oracle -------------------------------------------------------------------

def test_expected_draft_longest_then_earliest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # suffix [2, 3] (max_n 2) first occurs at 1: the draft follows it, k tokens
    assert expected_draft(toks, 11, 3, 1, 2, 128) == [9, 1, 2]
    # with max_n 3 the suffix [5, 2, 3] does not occur earlier, [2, 3] does
    assert expected_draft(toks, 11, 3, 1, 3, 128) == [9, 1, 2]
    assert expected_draft(toks, 4, 2, 1, 3, 128) == []  # [9] never seen before
    assert expected_draft(toks, 11, 3, 1, 2, 12) == [9]  # not past max_model_len
    assert expected_draft([4, 4, 4], 3, 4, 1, 3, 128) == [4]  # not past the context's end
    assert expected_draft([4], 1, 2, 2, 3, 128) == []  # shorter than prompt_lookup_min


def test_a_wrong_draft_is_a_mismatch_and_acceptance_is_counted():
    toks = (1, 2, 3, 1, 2, 3, 1, 2)
    good = {"r0": [[5, 3, expected_draft(toks, 5, 3, 1, 3, 128)]]}
    st = check_drafts(good, {"r0": toks}, 3, 1, 3, 128)
    assert st.mismatches == 0 and st.proposals == 1 and st.drafted == 3 and st.accepted == 3
    bad = {"r0": [[5, 3, [2, 3, 1]]]}  # the window one token early: a plausible draft, not vLLM's rule
    st = check_drafts(bad, {"r0": toks}, 3, 1, 3, 128)
    assert st.mismatches == 1 and st.accepted == 0 and "drafted [2, 3, 1]" in st.examples[0]


def test_the_acceptance_distribution_counts_each_case_by_its_best_step():
    """Per Case, the most drafts one step accepted; a cell's stats add Cases up, and a Case
    that proposed nothing is not a Case of the distribution."""
    toks = (1, 2, 3, 1, 2, 3, 1, 2)
    cell = DraftStats()
    cell.add(check_drafts({"a": [[4, 3, [2, 3, 9]], [5, 3, [3, 1, 2]]]}, {"a": toks}, 3, 1, 3, 128))  # best: 3
    cell.add(check_drafts({"b": [[5, 3, [3, 9]]]}, {"b": toks}, 3, 1, 3, 128))  # best: 1
    cell.add(check_drafts({}, {"c": toks}, 3, 1, 3, 128))  # nothing proposed
    got = cell.to_json()
    assert got["cases"] == 2 and got["cases_accepting_2plus"] == 1, got
    assert got["most_accepted_in_a_step"] == {"1": 1, "3": 1}, got


def test_the_table_says_what_each_cell_reached():
    from fuzz.targets.vllm.summary import reach

    notes = {"llm_kwargs": {"enable_prefix_caching": True}, "drafts": {"cases": 142, "cases_accepting_2plus": 82},
             "mix": {"hit_rate": 0.311, "sampled": 178, "requests": 730, "aborted": 14}}
    assert reach(notes) == "hit 0.31, accept>=2 82/142, sampled 178/730, aborted 14"
    assert reach({"llm_kwargs": {"enable_prefix_caching": False}, "mix": notes["mix"]}) == "sampled 178/730, aborted 14"
    assert reach({}) == ""
    seeded = {"mix": {**notes["mix"], "draws_checked": 40, "draws_near_tie": 3}}
    assert reach(seeded) == "sampled 178/730, aborted 14, seeded draws 40 checked, 3 near ties"


def test_a_short_budget_picks_pairs_per_second_not_just_the_cheapest():
    from fuzz.targets.vllm.covering import budget_plan, startup_cost

    rows, k = covering_plan(seed=0)
    short = budget_plan(rows, k, 400)
    assert 1 < len(short) < k
    assert coverage(short)[0] > coverage(rows[:len(short)])[0]  # more pairs than the cheapest prefix
    assert len({r["layout"] for r in short}) >= 2
    assert [startup_cost(r) for r in short] == sorted(startup_cost(r) for r in short)  # visited cheapest first
    assert budget_plan(rows, k, 900)[:k] == rows[:k]  # a budget that affords every pair: the plan itself


def test_a_drafter_bug_has_one_signature_and_is_written_once_across_cells():
    """How the first draft differs names the bug, whatever the config: a second cell's draft
    mismatch of the same kind is a duplicate, not a second reproducer."""
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.targets.vllm.checker import VLLMDraft
    from fuzz.targets.vllm.drafts import mismatch_kind
    from fuzz.targets.vllm.target import VLLMTarget

    assert [mismatch_kind(d, w) for d, w in (([1, 2, 3], [1, 2]), ([1], [1, 2]), ([5], [1]), ([1, 5], [1, 2]),
                                              ([1], []), ([], [1]))] == \
        ["too-long", "too-short", "wrong-tokens-at-start", "wrong-tokens-later", "drafted-without-match",
         "no-draft-for-match"]
    st = check_drafts({"r": [[5, 2, [2, 9]]]}, {"r": [1, 2, 3, 4, 1, 2, 3, 4]}, 3, 1, 3, 64)
    assert st.mismatches == 1 and st.first_kind == "wrong-tokens-later"
    target = VLLMTarget([], checker=object())
    verdicts = []
    for name in ("tp1pp1-eager-ngram3", "tp2pp1-eager-ngram1"):
        cfg, opts = parse_cell_name(name)
        v = VLLMDraft("drafts differ", opts.on(Case(cfg, Workload((RequestSpec((1, 2), 2),)))))
        v.signature = "vllm_draft:too-long"
        verdicts.append(target.triage(v, []))
    assert verdicts == ["new", "known"] and [d["cell"] for d in target.duplicates] == ["tp2pp1-eager-ngram1"]
