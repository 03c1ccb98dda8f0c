"""VLLMRunner's process handling (reuse, restart, crash and hang with a time bound, killing
its process group) against a fake worker speaking the worker protocol: no vLLM needed."""
from __future__ import annotations

import json
import os
import time

import pytest

from fuzz.targets.runs import TargetFailure
from fuzz.targets.vllm import checker as vc
from fuzz.targets.vllm.configs import VLLM_MODEL
from fuzz.targets.vllm.launch import checkpoint_dir

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_engine_reused_then_restarted_for_another_config(fake):
    t = fake("ok")
    try:
        case = vc.vllm_case([([1, 2], 3)])
        run = t.run(case)
        assert run.results["r0"].token_ids == (7, 7, 7)
        t.run(case)
        assert t.stats["tp1pp1-eager"].starts == 1 and t.stats["tp1pp1-eager"].runs == 2
        t.run(vc.vllm_case([([1], 1)], max_num_seqs=2))
        assert t.stats["tp1pp1-eager-s2"].starts == 1
        assert os.path.exists(os.path.join(checkpoint_dir(case.config), "model.safetensors"))
    finally:
        t.close()


def test_a_prestarted_engine_is_not_waited_for(fake, monkeypatch):
    """The next config's engine started while the live one serves (`prestart`): moving on
    to it waits only for what is left of its start, and the start is recorded whole: as
    long as it took to come up, not as long as the campaign took to move on to it."""
    from fuzz.targets.vllm.configs import VLLMOptions

    monkeypatch.setenv("FAKE_START_S", "1.5")
    t = fake("ok")
    try:
        a, b = vc.vllm_case([([1, 2], 3)]), vc.vllm_case([([1], 1)], max_num_seqs=2)
        t.run(a)
        assert t.prestart(b.config, VLLMOptions()) and not t.prestart(b.config, VLLMOptions())
        assert not t.prestart(a.config, VLLMOptions())  # live already
        assert t.still_starting(b.config, VLLMOptions()) and not t.still_starting(a.config, VLLMOptions())
        time.sleep(3.0)
        assert t.prestarted_s(b.config, VLLMOptions()) >= 3.0 and not t.still_starting(b.config, VLLMOptions())
        assert t.run(b).results["r0"].token_ids == (7,)
        first, second = t.starts
        assert first["seconds"] >= 1.5 and first["ahead_s"] == 0.0, first
        assert second["seconds"] < 0.5 and second["ahead_s"] >= 3.0 and 1.5 <= second["full_s"] < 2.5, second
        assert t.stats["tp1pp1-eager-s2"].starts == 1
    finally:
        t.close()


def test_moving_to_another_config_does_not_wait_for_the_old_engine_to_exit(fake, monkeypatch):
    """The old engine is asked to exit and left to it (vLLM's shut-down takes seconds): the
    next config's engine serves at once; `close` waits for the exit, and nothing is left."""
    monkeypatch.setenv("FAKE_EXIT_S", "2.0")
    t = fake("ok")
    try:
        a, b = vc.vllm_case([([1, 2], 3)]), vc.vllm_case([([1], 1)], max_num_seqs=2)
        t.run(a)
        old = t._w.proc
        t0 = time.perf_counter()
        assert t.run(b).results["r0"].token_ids == (7,)
        assert time.perf_counter() - t0 < 1.5 and old.poll() is None  # still exiting
    finally:
        t.close()
    assert old.poll() is not None and not _alive(old.pid)


def test_a_start_for_another_config_keeps_the_prestarted_engine(fake, monkeypatch):
    """A shrink candidate's config started while the spare pre-starts the next cell's: the
    candidate gets a fresh worker and the pre-started engine is still there for its own config."""
    from fuzz.targets.vllm.configs import VLLMOptions

    monkeypatch.setenv("FAKE_START_S", "1.0")
    t = fake("ok")
    try:
        a, b, c = (vc.vllm_case([([1], 1)], max_num_seqs=n) for n in (8, 2, 4))
        t.run(a)
        t.prestart(b.config, VLLMOptions())
        t.run(c)
        assert t.prestarted_s(b.config, VLLMOptions()) is not None
        t.run(b)
        assert [s["cell"] for s in t.starts] == ["tp1pp1-eager", "tp1pp1-eager-s4", "tp1pp1-eager-s2"]
        assert t.starts[1]["ahead_s"] == 0.0 and t.starts[2]["ahead_s"] >= 1.0, t.starts
    finally:
        t.close()


def test_crash_signature_from_the_root_traceback_and_restart(fake):
    t = fake("crash")
    case = vc.vllm_case([([1, 2], 3)])
    with pytest.raises(TargetFailure) as ei:
        t.run(case)
    f = ei.value
    assert f.kind == "crash"
    assert f.signature == "AssertionError@vllm/v1/worker/r.py:step_fn"
    assert "Worker_PP1" in f.detail and "EngineDeadError@vllm/v1/engine/core_client.py:get_output" in f.detail
    with pytest.raises(TargetFailure):
        t.run(case)  # a fresh engine was started for the next Case
    assert t.stats["tp1pp1-eager"].starts == 2 and t.stats["tp1pp1-eager"].failures == 2
    t.close()


def test_hang_is_a_failure_within_the_bound_and_the_group_is_killed(fake):
    t = fake("hang", run_timeout_s=2.0, run_timeout_per_token_s=0.0)
    t.ensure(VLLM_MODEL)
    pid = t._w.proc.pid
    t0 = time.monotonic()
    with pytest.raises(TargetFailure) as ei:
        t.run(vc.vllm_case([([1], 1)]))
    # The worker's stack was dumped (faulthandler on SIGUSR1, vllm_site/sitecustomize.py) and
    # the hang named by its stuck frame: the fake sleeps at module level.
    assert ei.value.kind == "hang" and ei.value.signature == "hang@fake_worker.py:<module>"
    assert time.monotonic() - t0 < 30
    assert not _alive(pid)
    t.close()


def test_no_progress_is_a_hang_long_before_the_run_bound(fake):
    """The watchdog: `hang_s` without a progress line is a hang, whatever the run's bound."""
    t = fake("hang", run_timeout_s=600.0, hang_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(TargetFailure) as ei:
        t.run(vc.vllm_case([([1], 1)]))
    assert ei.value.kind == "hang" and time.monotonic() - t0 < 15
    t.close()


def test_a_hang_after_a_worker_raised_is_named_by_the_workers_traceback(fake):
    """A worker raised (its ERROR traceback in the log) and the engine then waited forever:
    the hang is named by that traceback, not by the generic frame everyone waits in."""
    t = fake("raise_then_hang", run_timeout_s=600.0, hang_s=2.0)
    with pytest.raises(TargetFailure) as ei:
        t.run(vc.vllm_case([([1], 1)]))
    assert ei.value.kind == "hang" and ei.value.signature == "AssertionError@vllm/v1/worker/r.py:step_fn"
    assert "Worker_PP1: AssertionError" in ei.value.detail and "stuck:" in ei.value.detail
    t.close()


def test_stop_kills_the_worker_group_within_seconds(fake):
    """SIGTERM sets the stop flag (fuzz.stop): a run waiting on a hung worker kills the whole
    group (worker and spare) within a second, not after the run's bound."""
    import threading

    from fuzz.stop import StopRequested, clear_stop, request_stop

    t = fake("hang", run_timeout_s=600.0, hang_s=600.0)
    t.ensure(VLLM_MODEL)
    pids = [t._w.proc.pid, t._spare.proc.pid]
    threading.Timer(1.0, request_stop).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StopRequested):
            t.run(vc.vllm_case([([1], 1)]))
    finally:
        clear_stop()
    assert time.monotonic() - t0 < 5
    assert not any(_alive(p) for p in pids)
    t.close()


def test_start_failure(fake):
    t = fake("nostart")
    with pytest.raises(TargetFailure) as ei:
        t.ensure(VLLM_MODEL)
    assert ei.value.kind == "startup"
    assert ei.value.signature == "ValueError@vllm/engine/arg_utils.py:create_engine_config"
    t.close()


def test_checker_turns_failures_into_violations(fake, write_vllm, tmp_path):
    from fuzz.campaign.reproduce import load_reproducer

    chk = vc.VLLMChecker(fake("crash"))
    case = vc.vllm_case([([1, 2, 3], 2)], layout="tp1pp2")
    with pytest.raises(vc.VLLMCrash) as ei:
        chk.check(case)
    v = ei.value
    assert v.property == "vllm_crash" and v.case == case and v.signature.startswith("AssertionError@")
    path = write_vllm(str(tmp_path / "out"), v, chk.runner)
    repro = load_reproducer(path)
    assert repro.case == case and repro.meta["signature"] == v.signature
    assert json.load(open(path))["llm_kwargs"]["pipeline_parallel_size"] == 2
    chk.close()


def test_disagreement_with_the_reference_is_a_violation(fake):
    """The fake always answers token 7: the reference engine does not."""
    chk = vc.VLLMChecker(fake("ok"))
    with pytest.raises(vc.VLLMvsReference):
        chk.check(vc.vllm_case([([1, 2, 3], 4)]))
    chk.close()


def test_a_check_that_cannot_start_before_the_deadline_is_skipped_not_failed(fake):
    """The campaign's hard deadline: a Case whose engine would have to start (estimated from
    the starts measured so far, else the plan's estimate) and could not before it is not run;
    it counts as not failing (a shrink candidate not taken) and the reproducer says how many
    candidates were skipped, so a `minimal` claim can be judged."""
    from fuzz.targets.vllm.target import Unchecked, VLLMTarget

    ft = VLLMTarget([], checker=vc.VLLMChecker(fake("ok"), transformers=False))
    ft.deadline = time.monotonic() + 1.0  # a tp1 eager start is estimated at 6 s
    case = vc.vllm_case([([1, 2], 2)])
    assert isinstance(ft.check(case), Unchecked) and ft.unchecked == 1
    assert ft.checker.runner.starts == []  # nothing was started
    assert ft.reproducer_meta(case, None)["shrink_candidates_skipped_for_time"] == 1
    assert ft.reproducer_meta(case, None)["shrink_candidates_skipped_for_time"] == 0
    ft.deadline = None
    with pytest.raises(vc.VLLMvsReference):  # the fake answers token 7: with time, it is checked
        ft.check(case)
    ft.checker.close()


def test_unchecked_cases_are_not_examples_and_a_cut_shrink_is_not_minimal(tmp_path):
    """A Case past the deadline is counted apart (`unchecked`), not as an example; a
    reproducer written after its shrink skipped candidates for time says `minimal: false`."""
    from fuzz.campaign.recorder import Recorder
    from fuzz.campaign.summary import CellStats, Summary
    from fuzz.targets.vllm.target import Unchecked, VLLMTarget
    from fuzz.verdict.properties import LogitsMismatch

    from types import SimpleNamespace

    ft = VLLMTarget([], checker=SimpleNamespace(runner=SimpleNamespace(vllm_version="0.0")))
    case = vc.vllm_case([([1, 2], 2)])
    assert not ft.checked(Unchecked(case))
    stats = CellStats()
    ft.record(stats, Unchecked(case))
    assert stats.notes["unchecked"] == 1 and stats.examples == 0
    ft._unchecked_since_write = 3
    rec = Recorder(str(tmp_path), ft, Summary(), progress=False)
    path = rec.write(LogitsMismatch("wrong", case), {"minimal": True})
    doc = json.load(open(path))
    assert doc["minimal"] is False and doc["shrink_candidates_skipped_for_time"] == 3
    assert json.load(open(rec.write(LogitsMismatch("wrong", case), {"minimal": True})))["minimal"] is True
