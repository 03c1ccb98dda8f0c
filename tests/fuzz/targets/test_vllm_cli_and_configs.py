"""`llmfuzz run --target vllm` parsing and errors, the vLLM config strategy, config names,
the campaign plan, and shrinking across configs: none of it needs vLLM (a fake worker
stands in where an engine is needed)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
from hypothesis import given, settings

from fuzz.campaign.loop import Campaign
from fuzz.cli import main as cli
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.targets.runs import TargetFailure
from fuzz.targets.vllm import checker as vc
from fuzz.targets.vllm.configs import (VLLM_LAYOUTS, VLLM_MODEL, VLLM_MODES, VLLMOptions, cell_name, parse_cell_name,
                                       plan_configs, vllm_configs)
from fuzz.targets.vllm.launch import llm_kwargs
from fuzz.targets.vllm.plan import campaign_configs
from fuzz.targets.vllm.target import VLLMTarget, simpler_configs, unsupported


def _no_vllm(monkeypatch):
    """As on a machine without vLLM, whichever Python runs the tests."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.delenv("LLMFUZZ_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent/llmfuzz-test-cache")  # nor the default venv (launch.default_venv)


def _one_line_exit_2(capsys, argv) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_target_vllm_without_vllm_is_one_line_exit_2(capsys, monkeypatch):
    _no_vllm(monkeypatch)
    err = _one_line_exit_2(capsys, ["run", "--target", "vllm", "--budget", "900"])
    assert "package vllm" in err and "scripts/setup_vllm_cpu.sh" in err and "LLMFUZZ_VLLM_PYTHON" in err
    # the alias says the same
    err = _one_line_exit_2(capsys, ["vllm", "run", "--budget", "900"])
    assert "package vllm" in err and "scripts/setup_vllm_cpu.sh" in err


def test_vllm_python_without_vllm_in_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LLMFUZZ_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    err = _one_line_exit_2(capsys, ["run", "--target", "vllm", "--budget", "60"])
    assert "no such file" in err and "setup_vllm_cpu.sh" in err
    py = tmp_path / "python"  # a Python that lacks vllm
    py.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    py.chmod(0o755)
    monkeypatch.setenv("LLMFUZZ_VLLM_PYTHON", str(py))
    err = _one_line_exit_2(capsys, ["run", "--target", "vllm", "--budget", "60"])
    assert "package vllm is not installed" in err


@pytest.mark.parametrize("argv, needle", [
    (["run", "--target", "nosuch"], "unknown target 'nosuch' (known: reference, vllm, transformers-cb)"),
    (["run", "--target", "vllm", "--modes", "fast"], "--modes: 'fast'"),
    (["run", "--target", "vllm", "--layouts", "tp3pp1"], "--layouts"),
    (["run", "--target", "vllm", "--cells", "tp1pp2-lazy"], "--cells"),
    (["run", "--target", "vllm", "--cells", "tp1pp1-eager+turbo"], "unknown option"),
    (["run", "--target", "vllm", "--configs", "0"], "--configs"),
    (["run", "--target", "vllm", "--budget", "0"], "--budget"),
    (["run", "--target", "vllm", "--fault", "skip_kv_write"], "--fault"),
    (["run", "--known", "fuzz/targets/vllm/known_failures.txt"], "--known: applies to --target vllm only"),
    (["run", "--target", "vllm", "--known", "/nonexistent/known.txt"], "--known"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, monkeypatch, argv, needle):
    _no_vllm(monkeypatch)  # argument errors come first, vLLM or not
    if "--budget" not in argv:
        argv = argv + ["--budget", "60"]
    assert needle in _one_line_exit_2(capsys, argv)


def test_default_target_is_reference():
    args = cli.build_parser().parse_args(["run"])
    assert args.target == "reference" and args.out is None and args.known is None


# -- configs ----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(vllm_configs())
def test_drawn_configs_are_valid_and_named_reversibly(c):
    cfg, opts = c
    name = cell_name(cfg, opts)
    assert parse_cell_name(name) == (cfg, opts)
    kw = llm_kwargs(cfg, opts)
    assert kw["block_size"] % 32 == 0 and kw["max_num_batched_tokens"] >= kw["max_num_seqs"]
    assert not (opts.async_scheduling and "speculative_config" in kw)  # vLLM refuses that pair


def test_configs_shrink_open():
    from hypothesis import find

    cfg, opts = find(vllm_configs(), lambda c: True)
    assert (cfg, opts) == (VLLM_MODEL, VLLMOptions())
    cfg, opts = find(vllm_configs(), lambda c: c[0].speculative_method != "none" and c[0].cudagraph_mode != "NONE")
    assert cell_name(cfg, opts) == "tp1pp1-compiled-ngram2"


def test_plan_is_deterministic_cheapest_first_and_restricted_to_the_layouts_given():
    from fuzz.targets.vllm.configs import config_row
    from fuzz.targets.vllm.covering import startup_cost

    plan = plan_configs(14, seed=0)
    names = [cell_name(*c) for c in plan]
    assert len(set(names)) == len(names) and names[0].startswith("tp1pp1-eager")
    assert plan == plan_configs(14, seed=0)  # deterministic for a seed
    assert plan != plan_configs(14, seed=3)  # another seed, another plan
    groups = {(c.layout, c.cudagraph_mode != "NONE") for c, _ in plan}
    # every layout x mode but pp2 eager: a known crash on the first step (KNOWN_CRASHES)
    assert groups == {(lay, m == "compiled") for lay in VLLM_LAYOUTS for m in VLLM_MODES} - {("tp1pp2", False)}
    costs = [startup_cost(config_row(*c)) for c in plan]
    from fuzz.targets.vllm.configs import plan_rows
    k = plan_rows(0)[1]
    assert costs[:k] == sorted(costs[:k])  # the pair-covering configs, cheapest first
    only = plan_configs(3, seed=1, layouts=("tp1pp2",), modes=("eager",))  # asked for: planned anyway
    assert len(only) == 3 and all(c.layout == "tp1pp2" and c.cudagraph_mode == "NONE" for c, _ in only)


def test_campaign_configs_from_arguments():
    assert len(campaign_configs(budget_s=900)) >= 12  # the covering plan's pairs, cheapest first
    assert len(campaign_configs(budget_s=20)) == 1
    assert len(campaign_configs(budget_s=300)) < len(campaign_configs(budget_s=900))
    names = ("tp1pp2-eager", "tp1pp1-compiled-b16-s2-blk64-ngram2+enable_prefix_caching")
    assert [cell_name(*c) for c in campaign_configs(budget_s=900, cells=names)] == list(names)
    ex = campaign_configs(budget_s=1500, exclude=("tp2pp1-eager",))
    assert len(ex) >= 10 and not any(cell_name(*c).startswith("tp2pp1-eager") for c in ex)
    one = campaign_configs(budget_s=900, layouts=("tp1pp2",), modes=("eager",), count=1)
    assert len(one) == 1 and cell_name(*one[0]).startswith("tp1pp2-eager")
    assert len(campaign_configs(budget_s=900, count=3)) == 3


def test_simpler_configs_one_knob_each():
    cfg, opts = parse_cell_name("tp2pp1-compiled-b16-s2-blk64-ngram2+enable_prefix_caching")
    names = [cell_name(*c) for c in simpler_configs(cfg, opts)]
    assert names == ["tp2pp1-compiled-b16-s2-blk64-ngram2", "tp2pp1-compiled-b16-s2-blk64+enable_prefix_caching",
                     "tp2pp1-compiled-b16-s2-ngram2+enable_prefix_caching",
                     "tp2pp1-compiled-s2-blk64-ngram2+enable_prefix_caching",
                     "tp2pp1-compiled-b16-blk64-ngram2+enable_prefix_caching",
                     "tp2pp1-eager-b16-s2-blk64-ngram2+enable_prefix_caching",
                     "tp1pp1-compiled-b16-s2-blk64-ngram2+enable_prefix_caching"]
    assert simpler_configs(VLLM_MODEL, VLLMOptions()) == []
    # The covering plan's knobs shrink too; a start-up failure tries eager first (cheaper starts).
    cfg, opts = parse_cell_name("tp1pp2-compiled-ngram1-bf16-len256-kv5")
    names = [cell_name(*c) for c in simpler_configs(cfg, opts, eager_first=True)]
    assert names == ["tp1pp2-eager-ngram1-bf16-len256-kv5", "tp1pp2-compiled-ngram1-bf16-len256",
                     "tp1pp2-compiled-bf16-len256-kv5", "tp1pp2-compiled-ngram1-len256-kv5",
                     "tp1pp2-compiled-ngram1-bf16-kv5", "tp1pp1-compiled-ngram1-bf16-len256-kv5"]


# -- with a fake worker -------------------------------------------------------------------------

def _minimize(v, checker, configs: bool = True):
    """The shared minimizer (fuzz.campaign.shrink) over the vLLM target's candidates, a
    candidate kept when it fails the same way: the smallest violation."""
    import time

    from fuzz.campaign.shrink import Shrinker, minimize

    target = VLLMTarget([], checker=checker, shrink_configs=configs)
    sh = Shrinker(v, target.check)
    minimize(v.case, sh.still_fails, 60, time.monotonic() + 120, target.simpler)
    return sh.best


def test_crash_shrinks_across_configs_to_the_plain_one(fake):
    """The fake crashes on every config: the shrinker walks the config back to defaults."""
    chk = vc.VLLMChecker(fake("crash"), transformers=False)
    cfg, opts = parse_cell_name("tp1pp2-eager-b16-ngram2+enable_prefix_caching")
    case = Case(cfg, Workload((RequestSpec((1, 2, 3, 4, 5), 3), RequestSpec((6,) * 40, 2, 2))))
    with pytest.raises(vc.VLLMCrash) as ei:
        chk.check(case, opts)
    v = _minimize(ei.value, chk)
    assert cell_name(v.case.config, VLLMOptions.of(v.case)) == "tp1pp1-eager"
    assert len(v.case.workload.requests) == 1 and len(v.case.workload.requests[0].prompt_token_ids) == 1
    assert v.signature == ei.value.signature
    v2 = _minimize(ei.value, chk, configs=False)
    assert cell_name(v2.case.config, VLLMOptions.of(v2.case)) == "tp1pp2-eager-b16-ngram2+enable_prefix_caching"
    chk.close()


def test_a_refused_config_is_unsupported_not_a_failure(fake, tmp_path):
    assert unsupported(TargetFailure("startup", "ValueError@vllm/engine/arg_utils.py:create_engine_config"))
    assert unsupported(TargetFailure("startup", "NotImplementedError@vllm/platforms/cpu.py:check_and_update_config"))
    assert not unsupported(TargetFailure("startup", "AssertionError@vllm/v1/worker/cpu_worker.py:init_device"))
    assert not unsupported(TargetFailure("crash", "ValueError@vllm/config/vllm.py:__post_init__"))
    chk = vc.VLLMChecker(fake("nostart"), transformers=False)
    target = VLLMTarget([(VLLM_MODEL, VLLMOptions())], checker=chk)
    s = Campaign(target=target, budget_s=30, out_dir=str(tmp_path / "out"), progress=False).run().to_json()
    chk.close()
    assert s["failures"] == [] and "ValueError@vllm/engine/arg_utils.py" in s["unsupported"]["tp1pp1-eager"]


def test_the_campaign_takes_the_vllm_targets_policies(tmp_path):
    """Time and shrinking are the target's: 10-example chunks, at least 10 s a cell,
    min(300 s, budget/5) to shrink a failure, 2 % of the budget after it, and a hard deadline
    at budget x 1.03 from when the campaign's clock starts."""
    import time

    target = VLLMTarget([(VLLM_MODEL, VLLMOptions())], checker=object())
    camp = Campaign(target=target, budget_s=1000, out_dir=str(tmp_path), progress=False)
    assert (camp.chunk, camp.min_cell_s, camp.shrink_s, camp.shrink_budget_s) == (10, 10.0, 200.0, 20.0)
    assert Campaign(target=target, budget_s=1000, shrink_s=7, min_cell_s=1, out_dir=str(tmp_path)).shrink_s == 7
    t0 = time.monotonic()
    target.begin(1000)
    assert t0 + 1029.999 <= target.deadline <= time.monotonic() + 1030.001


def test_cli_campaign_against_a_fake_vllm_finds_shrinks_and_writes(fake, tmp_path, capsys):
    """`llmfuzz run --target vllm` end to end, the fake answering token 7 always (wrong)."""
    fake("ok")
    out = tmp_path / "repros"
    rc = cli.main(["run", "--target", "vllm", "--budget", "8", "--cells", "tp1pp1-eager", "--json", "--quiet",
                   "--out", str(out), "--shrink-budget", "30", "--max-requests", "3"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 1 and summary["target"] == "vllm" and summary["planned_configs"] == ["tp1pp1-eager"]
    f = summary["failures"][0]
    assert f["property"] in ("vllm_vs_reference", "vllm_vs_transformers") and f["config"] == "tp1pp1-eager"
    doc = json.load(open(f["path"]))
    assert doc["target"] == "vllm" and doc["replay"] == f"llmfuzz replay {f['path']}"
    assert len(doc["case"]["workload"]) == 1
    cell = summary["per_cell"]["tp1pp1-eager"]
    assert cell["engine_starts"] >= 1 and cell["examples"] >= 1


def test_startup_crash_is_shrunk_by_config_and_written_once_across_cells(fake, tmp_path, capsys):
    """A start-up crash is its cell's first example's failure, shrunk one config knob at a
    time (no workload steps: the engine never ran); the same signature in a later cell is
    counted as a duplicate, not written again."""
    fake("startcrash_tp2")
    out = tmp_path / "repros"
    rc = cli.main(["run", "--target", "vllm", "--budget", "20", "--cells", "tp2pp1-eager-b16-blk64,tp2pp1-eager-blk128",
                   "--json", "--quiet", "--out", str(out), "--known", os.devnull])
    s = json.loads(capsys.readouterr().out)
    assert rc == 1 and len(s["failures"]) == 1
    f = s["failures"][0]
    assert f["property"] == "vllm_crash" and f["signature"] == "RuntimeError@vllm/v1/executor/multiproc_executor.py:_init_executor"
    doc = json.load(open(f["path"]))
    cfg = doc["case"]["config"]
    assert (cfg["block_size"], cfg["max_num_batched_tokens"], cfg["tensor_parallel_size"]) == (32, 128, 2), (f, s["per_cell"])
    assert f["shrink_checks"] <= 6  # config steps and the one-request workload, not a workload search
    assert [d["cell"] for d in s["duplicate_signatures"]] == ["tp2pp1-eager-blk128"]
    assert len(list(out.rglob("*.json"))) == 1
    # The plan is in the summary, and neither cell exercised its pairs (both died starting).
    assert [c["name"] for c in s["plan"]["configs"]] == ["tp2pp1-eager-b16-blk64", "tp2pp1-eager-blk128"]
    assert s["plan"]["pairs_covered"] > 0 and s["pairs_exercised"]["covered"] == 0
    # (The starts before: the known crashes' reproducers, replayed to report their state.)
    assert [x["ok"] for x in s["engine_starts"] if x["cell"].startswith("tp2")][:1] == [False]
    assert s["startup_fraction"] is not None


def test_prompt_logprobs_asked_for_unless_prefix_caching(fake):
    """The checker asks vLLM for prompt logprobs (for the transformers oracle) except with
    prefix caching on: vLLM skips reading the prefix cache for such a request."""
    chk = vc.VLLMChecker(fake("ok"))
    asked = []

    def run(case, opts, items=None, prompt_logprobs=False):
        asked.append(prompt_logprobs)
        raise TargetFailure("crash", "X@vllm/x.py:f")
    chk.runner.run = run
    for opts in (VLLMOptions(), VLLMOptions(enable_prefix_caching=True)):
        with pytest.raises(vc.VLLMCrash):
            chk.check(vc.vllm_case([([1, 2, 3], 2)]), opts)
    assert asked == [chk.hf is not None, False]
    chk.close()


def test_fake_prompt_logprobs_travel_through_the_protocol(fake):
    t = fake("ok")
    r = t.run(vc.vllm_case([([1, 2, 3], 2)]), prompt_logprobs=True).results["r0"]
    assert [dict(p) for p in r.prompt_logprobs] == [{2: -1.0}, {3: -1.0}]
    assert t.run(vc.vllm_case([([1, 2, 3], 2)])).results["r0"].prompt_logprobs == ()
    t.close()


def test_known_crashes_left_out_are_replayed_and_their_state_reported(fake, write_vllm, tmp_path):
    """Each known crash whose configs the plan left out replays its reproducer once: "still
    fails" with its signature, "passes now" when nothing fails, "fails differently" naming the
    other failure; a crash the plan did not leave out is not replayed."""
    from fuzz.campaign.vllm_replays import known_crash_states
    from fuzz.targets.vllm.known import KnownCrash
    from fuzz.verdict.properties import LogitsMismatch

    runner = fake("crash")
    chk = vc.VLLMChecker(runner, transformers=False)
    cfg, opts = parse_cell_name("tp1pp2-eager")
    with pytest.raises(vc.VLLMCrash) as ei:
        chk.check(Case(cfg, Workload((RequestSpec((1, 2, 3), 2),))), opts)
    path = write_vllm(str(tmp_path / "reproducers"), ei.value, runner)
    k = KnownCrash(ei.value.signature, os.path.relpath(path, tmp_path), ({"layout": "tp1pp2", "mode": "eager"},))
    plan = {"pairs_excluded": {"layout=tp1pp2 x mode=eager": f"known crash {k.short}"}}
    target = VLLMTarget([], checker=chk)
    [state] = known_crash_states(target, plan, crashes=[k], root=str(tmp_path))
    chk.close()
    assert state["state"] == "still fails" and state["signature"] == ei.value.signature

    class Passes:
        def check(self, case):
            return None

    class Differs:
        def check(self, case):
            raise LogitsMismatch("wrong token", case)

    assert known_crash_states(Passes(), plan, crashes=[k], root=str(tmp_path))[0]["state"] == "passes now"
    other = known_crash_states(Differs(), plan, crashes=[k], root=str(tmp_path))[0]
    assert (other["state"], other["detail"]) == ("fails differently", "logits")
    assert known_crash_states(Passes(), {"pairs_excluded": {}}, crashes=[k], root=str(tmp_path)) == []
    gone = KnownCrash("X@y.py:z", "reproducers/none.json", k.combos)
    plan_gone = {"pairs_excluded": {"p": "known crash none"}}
    assert known_crash_states(Passes(), plan_gone, crashes=[gone], root=str(tmp_path))[0]["state"] == "no reproducer"


def _workers_of(script: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if script.encode() in f.read():
                    out.append(int(d))
        except (OSError, ValueError):
            continue
    return out


def test_replays_beside_the_campaign_are_listed_not_replayed_when_time_runs_out(fake, tmp_path, monkeypatch):
    """The known crashes replay in a process beside the campaign (fuzz.campaign.vllm_replays).
    One still starting its engine when the campaign's time is up is stopped, with its engines,
    and listed as not replayed, with why."""
    import time

    from fuzz.campaign.vllm_replays import BackgroundReplays

    monkeypatch.setenv("FAKE_START_S", "120")
    fake("ok")
    script = str(tmp_path / "fake_worker.py")
    replays = BackgroundReplays({"pairs_excluded": {}}, set())  # the workload crash only
    t0 = time.monotonic()
    while not _workers_of(script) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert _workers_of(script), "the replay process started no engine"
    t1 = time.monotonic()
    [row] = replays.result(0.5)
    assert time.monotonic() - t1 < 20
    assert row["state"] == "not replayed" and row["detail"] == "the campaign's time ran out", row
    assert row["reproducer"].endswith("9dd4428c4117.json") and replays.proc.poll() is not None
    t2 = time.monotonic()
    while _workers_of(script) and time.monotonic() - t2 < 10:
        time.sleep(0.2)
    assert not _workers_of(script), "the replay's engines outlived it"
    replays.stop()


def test_the_summary_names_configs_not_reached_and_pairs_excluded():
    from fuzz.campaign.summary import CellStats, Summary
    from fuzz.targets.vllm.summary import not_reached, summary_table

    s = Summary(planned=["a", "b", "c"], budget_s=10, seed=0)
    s.cells[("a", 0)] = CellStats(examples=3)
    s.cells[("b", 0)] = CellStats()
    target = VLLMTarget([], checker=object(), plan={"pairs_total": 256, "pairs_excluded": {
        "layout=tp1pp2 x mode=eager": "known crash 402ca48c42d3"}})
    target.known_crashes = [{"reproducer": "r.json", "state": "still fails", "detail": "", "signature": "S@x.py:f"}]
    assert not_reached(s) == ["b", "c"]
    table = summary_table(s, target)
    assert "not reached: b" in table and "not reached: c" in table
    assert "pairs excluded: 1 of 256 (not covered): layout=tp1pp2 x mode=eager (known crash 402ca48c42d3)" in table
    assert "known crash r.json: still fails  [S@x.py:f]" in table
