"""`llmfuzz mutate --target vllm` without vLLM: its plan, the fixed Cases, digests and
classification, the scratch copy with bytecode, the environment the vLLM engine process gets
(the scratch copy first after the target's site directory), the check that an engine ran the
copy, and the kill of a mutant's processes in sessions of their own."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

import fuzz.mutate.sources as sources
from fuzz.mutate.cli import plan_from_args
from fuzz.mutate.points import points
from fuzz.mutate.report import counts
from fuzz.mutate.run import TAG_ENV, _kill, classify, mutant_env, mutant_timeout, tagged
from fuzz.mutate.sources import Source, scratch_copy
from fuzz.mutate.vllm import CASE_CONFIGS, DEFAULT_CASES, draw_vllm_cases, run_digest
from fuzz.mutate.vllm_worker import wrong_tree
from fuzz.targets.runs import RequestResult, TargetRun

SCHED = "def admit(n, limit):\n    return n < limit\n"


@pytest.fixture
def toy_vllm(tmp_path, monkeypatch):
    """A stand-in `vllm` package (its scheduler file and a compiled module) as the vllm target's source."""
    root = tmp_path / "site"
    sched = root / "vllm" / "v1" / "core" / "sched"
    (sched / "__pycache__").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (sched / "scheduler.py").write_text(SCHED)
    (sched / "utils.py").write_text("X = 1\n")
    for stem in ("scheduler", "utils"):
        (sched / "__pycache__" / f"{stem}.cpython-311.pyc").write_bytes(b"bytecode")
    src = Source("vllm", str(root), "vllm", bytecode=True)
    real = sources.find_source
    monkeypatch.setattr(sources, "find_source", lambda target: src if target == "vllm" else real(target))
    return src


def _args(**kw) -> argparse.Namespace:
    base = dict(target="vllm", paths=["vllm/v1/core/sched/*.py"], n=10, seed=3, budget_per_mutant=120.0, cases=None,
                layouts="", jobs=1, timeout=None, json=True, out="out")
    return argparse.Namespace(**{**base, **kw})


def test_the_vllm_target_is_planned_not_refused(toy_vllm) -> None:
    plan = plan_from_args(_args())
    assert plan.source is toy_vllm and plan.files == ["vllm/v1/core/sched/scheduler.py", "vllm/v1/core/sched/utils.py"]
    assert plan.num_cases == DEFAULT_CASES == 4 and plan.layouts == ()
    assert plan_from_args(_args(layouts="tp1pp1,tp2pp1")).layouts == ("tp1pp1", "tp2pp1")  # vLLM's layouts
    assert plan_from_args(_args(target="reference", paths=None)).num_cases == 24


def test_the_scratch_copy_keeps_bytecode_but_the_mutated_files(toy_vllm, tmp_path) -> None:
    rel = "vllm/v1/core/sched/scheduler.py"
    m = points(toy_vllm.read(rel), rel, ("cmp_flip",))[0]
    into = scratch_copy(toy_vllm, m, str(tmp_path / "scratch"))
    cache = os.path.join(into, "vllm/v1/core/sched/__pycache__")
    assert os.listdir(cache) == ["utils.cpython-311.pyc"]  # the mutated module's bytecode is gone
    with open(os.path.join(into, rel)) as f:
        assert f.read() == SCHED.replace("<", "<=")
    assert toy_vllm.read(rel) == SCHED and len(os.listdir(os.path.join(toy_vllm.root, "vllm/v1/core/sched/__pycache__"))) == 2


def test_the_vllm_engine_process_gets_the_scratch_copy_first(monkeypatch, tmp_path) -> None:
    from fuzz.targets.vllm.configs import VLLM_MODEL
    from fuzz.targets.vllm.launch import SITE, worker_env

    scratch = str(tmp_path / "llmfuzz-mutant-x")
    env = mutant_env(scratch, {"PYTHONPATH": "/elsewhere"})
    for k, v in env.items():  # the mutant process's environment, as the vLLM runner sees it
        monkeypatch.setenv(k, v)
    path = worker_env(VLLM_MODEL)["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [SITE, scratch] and "/elsewhere" in path  # SITE holds only sitecustomize.py
    assert worker_env(VLLM_MODEL)[TAG_ENV] == scratch


def test_an_engine_on_another_vllm_tree_is_a_wrong_tree(tmp_path) -> None:
    class Runner:
        vllm_files = {str(tmp_path / "scratch" / "vllm" / "__init__.py")}

    assert wrong_tree(Runner, str(tmp_path / "scratch")) is None
    Runner.vllm_files = Runner.vllm_files | {"/venv/site-packages/vllm/__init__.py"}
    assert "site-packages" in wrong_tree(Runner, str(tmp_path / "scratch"))


def _run(tokens, steps=3, lp=-0.5) -> TargetRun:
    return TargetRun({"r0": RequestResult(tuple(tokens), tuple(((t, lp),) for t in tokens))}, 0.1, steps)


def test_digests_separate_outputs_from_the_schedule() -> None:
    a = run_digest(_run([1, 2]))
    assert run_digest(_run([1, 2])) == a
    assert run_digest(_run([1, 3]))["outputs"] != a["outputs"]
    steps = run_digest(_run([1, 2], steps=4))
    assert steps["outputs"] == a["outputs"] and steps["fa"] != a["fa"]
    assert run_digest(_run([1, 2], lp=-0.25), logprobs=False)["outputs"] == run_digest(_run([1, 2]), logprobs=False)["outputs"]
    assert run_digest(_run([1, 2], lp=-0.25), logprobs=True)["outputs"] != a["outputs"]


def test_a_schedule_only_difference_is_observable_as_such() -> None:
    base = {"digests": [{"outputs": "a", "fa": "s1"}, {"outputs": "b", "fa": "s2"}], "second": "schedule"}
    res = {"stage": "done", "digests": [{"outputs": "a", "fa": "s1"}, {"outputs": "b", "fa": "S2"}],
           "campaign": {"failures": [], "examples": 5}, "timed_out": False, "rc": 0, "log_tail": ""}
    r = classify(res, base)
    assert r["status"] == "silent" and r["observed_by"] == "schedule" and r["fa_only_cases"] == [1]
    assert counts([r])["silent_fa_only"] == 1
    wrong = {**res, "stage": "wrong_tree", "campaign": None, "rc": 3}
    assert classify(wrong, base)["status"] == "error"  # never scored on the original tree


def test_the_fixed_cases_are_vllm_cases_on_the_cheap_configs_and_seeded() -> None:
    from fuzz.cases.case import Case
    from fuzz.targets.vllm.configs import VLLMOptions, cell_name

    cases = draw_vllm_cases(5, 4)
    assert cases == draw_vllm_cases(5, 4) and cases != draw_vllm_cases(6, 4)
    names = [cell_name(c.config, VLLMOptions.of(c)) for c in map(Case.from_dict, cases)]
    # Grouped by config (two engine starts), the last the config the campaign starts on.
    assert names == [CASE_CONFIGS[0]] * 2 + [CASE_CONFIGS[1]] * 2 and all(c["target"] == "vllm" for c in cases)
    assert [cell_name(c.config, VLLMOptions.of(c)) for c in map(Case.from_dict, draw_vllm_cases(5, 3))] == \
        [CASE_CONFIGS[0]] * 2 + [CASE_CONFIGS[1]]


def test_a_mutant_campaign_starts_on_the_live_engine_and_adds_configs_with_budget() -> None:
    from fuzz.mutate.vllm import S_PER_CONFIG, campaign_configs
    from fuzz.targets.vllm.configs import cell_name

    names = [cell_name(*c) for c in campaign_configs(120.0, 43)[0]]
    assert names == [CASE_CONFIGS[-1]]  # no engine start at all
    more = [cell_name(*c) for c in campaign_configs(3 * S_PER_CONFIG, 43)[0]]
    assert more[0] == CASE_CONFIGS[-1] and len(more) == 3 and all(n.startswith("tp1pp1-eager") for n in more)


def test_the_timeout_is_the_budget_plus_the_start_up_allowance() -> None:
    from fuzz.mutate.run import Plan

    plan = Plan(Source("vllm", "/x", "vllm"), [], 0, 1, 120.0)
    assert mutant_timeout(plan, {"startup_seconds": 40.0, "cases_seconds": 10.0}) == pytest.approx(132 + 150 + 120)
    plan.timeout_s = 50.0
    assert mutant_timeout(plan, {"cases_seconds": 10.0}) == 50.0


def test_a_hung_mutant_is_killed_with_the_processes_it_started_in_their_own_sessions(tmp_path) -> None:
    tag = str(tmp_path / "llmfuzz-mutant-kill")
    child = ("import subprocess, sys, time\n"
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
             "print(p.pid, flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", child], env={**os.environ, TAG_ENV: tag}, stdout=subprocess.PIPE,
                         start_new_session=True)
    grandchild = int(p.stdout.readline())
    assert set(tagged(tag)) == {p.pid, grandchild}
    _kill(p, tag)
    p.wait(timeout=10)
    t0 = time.monotonic()
    while tagged(tag) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert tagged(tag) == []
