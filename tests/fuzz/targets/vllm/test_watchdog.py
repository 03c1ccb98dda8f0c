"""The load-aware watchdog of VLLMRunner, against a fake worker (no vLLM needed): a slow first
compile (the worker sleeping in a function of a file at torch/_inductor/compile_fx.py, as
inductor's frames are) is waited for and is no finding; a stall in a non-compiler frame that
a fresh engine does not repeat is a slow step, no finding; one it repeats is a hang. The
threshold scales with the steps and start-up measured; stack dumps are read one at a time."""
from __future__ import annotations

import sys
import textwrap
import time

import pytest

from fuzz.targets.runs import TargetFailure
from fuzz.targets.vllm import checker as vc
from fuzz.targets.vllm.process import _Worker
from fuzz.targets.vllm.watchdog import RERUN_K, START_K, STEP_K

# A compile frame where inductor's are: loaded from a file under torch/_inductor/ (not
# importable as torch: the fake never imports the real one).
COMPILE_FX = textwrap.dedent('''
    import time

    def compile_fx_inner(seconds):
        time.sleep(seconds)
''')

WORKER = textwrap.dedent('''
    import importlib.util, json, os, sys, time
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    spec = json.loads(sys.stdin.readline() if sys.argv[1] == "--warm" else sys.argv[1])
    mode, sleep_s, mark = os.environ["WD_MODE"], float(os.environ["WD_SLEEP"]), os.environ["WD_MARK"]

    def slow_step(seconds):  # a stall outside any compiler
        time.sleep(seconds)

    def compile_fx_inner(seconds):
        s = importlib.util.spec_from_file_location("compile_fx", os.environ["WD_COMPILE_FX"])
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        m.compile_fx_inner(seconds)

    proto.write(json.dumps({"event": "ready", "startup_s": 0.0, "warmup_s": 0.2, "ready_at": time.time(),
                            "vllm_version": "fake"}) + "\\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        proto.write(json.dumps({"event": "progress", "step": 1, "step_s": 0.01}) + "\\n")
        first = not os.path.exists(mark)
        open(mark, "a").close()
        if mode == "compile_once" and first:
            compile_fx_inner(sleep_s)
        elif mode == "slow_once" and first or mode == "stall":
            slow_step(sleep_s)
        res = {r["id"]: {"token_ids": [7] * r["max_tokens"], "logprobs": [[[7, -0.5], [8, -1.0]]] * r["max_tokens"]}
               for r in cmd["requests"]}
        proto.write(json.dumps({"event": "result", "seconds": 0.0, "steps": 1, "results": res}) + "\\n")
''')


@pytest.fixture
def wd(tmp_path, monkeypatch):
    """make(mode, sleep_s, **VLLMRunner kwargs): a runner whose worker is WORKER in `mode`
    (compile_once, slow_once, stall), with a watchdog floor of 1.5 s."""
    from fuzz.targets.vllm import launch
    from fuzz.targets.vllm.runner import VLLMRunner

    (tmp_path / "wd_worker.py").write_text(WORKER)
    fx = tmp_path / "fake" / "torch" / "_inductor" / "compile_fx.py"
    fx.parent.mkdir(parents=True)
    fx.write_text(COMPILE_FX)
    monkeypatch.setattr(launch, "WORKER", str(tmp_path / "wd_worker.py"))
    monkeypatch.setattr(launch, "vllm_python", lambda: sys.executable)
    monkeypatch.setenv("LLMFUZZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WD_COMPILE_FX", str(fx))
    monkeypatch.setenv("WD_MARK", str(tmp_path / "ran_once"))
    made = []

    def make(mode: str, sleep_s: float, **kw):
        monkeypatch.setenv("WD_MODE", mode)
        monkeypatch.setenv("WD_SLEEP", str(sleep_s))
        kw.setdefault("hang_s", 1.5)
        kw.setdefault("run_timeout_s", 60.0)
        r = VLLMRunner(python=sys.executable, log_dir=str(tmp_path / "logs"), run_timeout_per_token_s=0.0, **kw)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def test_a_slow_first_compile_is_waited_for_not_a_finding(wd):
    """The first run sits in an inductor compile frame for 5 s, past a 1.5 s watchdog: the
    stacks show the compiler, so the watchdog waits again; the run answers on the same
    engine, nothing is re-run, and the checker finds nothing of vLLM's liveness (the fake
    answers token 7, which only the reference comparison rejects)."""
    t = wd("compile_once", 5.0)
    run = t.run(vc.vllm_case([([1, 2], 2)]))
    assert run.results["r0"].token_ids == (7, 7)
    assert len(t.compile_waits) >= 2 and "compile_fx.py:compile_fx_inner" in t.compile_waits[0]["where"]
    assert len(t.starts) == 1 and t.slow_steps == []
    chk = vc.VLLMChecker(t, transformers=False)
    with pytest.raises(vc.VLLMvsReference):  # not VLLMHang: the same engine answers at once now
        chk.check(vc.vllm_case([([1, 2, 3], 2)]))


def test_a_stall_a_fresh_engine_does_not_repeat_is_a_slow_step(wd):
    """A first run stalls 4 s in a non-compiler frame (a burst of load): the watchdog (1.5 s)
    sends it to a fresh engine with RERUN_K x the watchdog, where it finishes: a slow step,
    recorded, no failure."""
    t = wd("slow_once", 4.0)
    run = t.run(vc.vllm_case([([1, 2], 2)]))
    assert run.results["r0"].token_ids == (7, 7)
    assert len(t.starts) == 2 and len(t.slow_steps) == 1 and t.compile_waits == []
    slow = t.slow_steps[0]
    assert slow["cell"] == "tp1pp1-eager" and slow["watchdog_s"] == 1.5 and slow["rerun_watchdog_s"] == 1.5 * RERUN_K
    assert slow["first"] == "hang@wd_worker.py:slow_step"
    assert t.stats["tp1pp1-eager"].failures == 0


def test_a_stall_repeated_on_a_fresh_engine_is_a_hang(wd):
    """A real stall: the same non-compiler frame on the first engine and on the fresh one."""
    t = wd("stall", 3600.0)
    t0 = time.monotonic()
    with pytest.raises(TargetFailure) as ei:
        t.run(vc.vllm_case([([1, 2], 2)]))
    assert ei.value.kind == "hang" and ei.value.signature == "hang@wd_worker.py:slow_step"
    assert "on a fresh engine" in ei.value.detail
    assert len(t.starts) == 2 and t.slow_steps == [] and t.stats["tp1pp1-eager"].failures == 1
    assert time.monotonic() - t0 < 1.5 + 1.5 * RERUN_K + 10


def test_the_watchdog_scales_with_the_steps_and_start_up_measured(wd):
    t = wd("compile_once", 0.0, hang_s=30.0)
    w = _Worker(proc=None, key="", cell="c", log_path="")
    assert t.watchdog_s(w) == 30.0  # nothing measured: the floor
    w.slowest_step_s, w.start_s = 4.0, 20.0
    assert t.watchdog_s(w) == STEP_K * 4.0
    w.start_s = 90.0  # a start-up of 90 s (warm-up compile included) on a loaded machine
    assert t.watchdog_s(w) == START_K * 90.0
    t.run(vc.vllm_case([([1], 1)]))
    assert t._w.slowest_step_s == 0.01 and t.starts[0]["warmup_s"] == 0.2


def test_stack_dumps_are_read_one_at_a_time(wd, tmp_path):
    """faulthandler appends each dump to the process's file: the second look reads only the second."""
    from fuzz.targets.vllm.process import dump_stacks

    t = wd("stall", 3600.0)
    t.ensure(vc.vllm_case([([1], 1)]).config)
    first = dump_stacks(t._w, t.stacks_dir, wait_s=5.0)
    second = dump_stacks(t._w, t.stacks_dir, wait_s=5.0)
    assert first and second
    for text in (*first.values(), *second.values()):
        assert text.count("most recent call first") == text.count("Current thread") + text.count("\nThread ") \
            and text.count("Current thread") <= 1


def test_compiler_frames_are_told_from_compiled_code_running():
    from fuzz.targets.vllm.stacks import compiler_frame, compiling

    def fr(path, func):
        return {"file": path, "line": 1, "func": func}

    site = "/v/lib/python3.11/site-packages/"
    assert compiler_frame(fr(site + "torch/_inductor/compile_fx.py", "compile_fx_inner"))
    assert compiler_frame(fr(site + "torch/_inductor/cpp_builder.py", "build"))
    assert compiler_frame(fr(site + "torch/_dynamo/convert_frame.py", "_compile"))
    assert compiler_frame(fr(site + "vllm/compilation/backends.py", "__call__"))
    # compiled code running: dynamo's wrapper, inductor's compiled module
    assert not compiler_frame(fr(site + "torch/_dynamo/eval_frame.py", "_fn"))
    assert not compiler_frame(fr(site + "torch/_inductor/output_code.py", "__call__"))
    assert not compiler_frame(fr(site + "vllm/v1/core/sched/scheduler.py", "schedule"))
    dump = ("Current thread 0x00007f (most recent call first):\n"
            '  File "/usr/lib/python3.11/subprocess.py", line 1 in wait\n'
            f'  File "{site}torch/_inductor/cpp_builder.py", line 2 in build\n'
            f'  File "{site}vllm/v1/sample/ops/logprobs.py", line 3 in batched_count_greater_than\n')
    assert compiling({5: dump}) == "pid 5: cpp_builder.py:build"  # waiting on the C++ compiler is compiling
    assert compiling({5: dump.replace("torch/_inductor/cpp_builder.py", "torch/_dynamo/eval_frame.py")}) is None
