"""Robustness of the harness, done for real: interrupted campaigns keep what they found and
stop promptly, a SIGKILLed gloo rank becomes a named failure and the campaign goes on with a
fresh world, bad files and unwritable directories lose nothing, and memory and open file
descriptors stay flat over a campaign."""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time

import pytest

from fuzz.campaign.reproduce import load_reproducer
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.targets.vllm.process import descendants

REPO = str(Path(__file__).resolve().parents[3])


def _start(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen([sys.executable, "-m", "fuzz.cli", "run", "--out", str(tmp_path / "repro"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def _wait_for(proc, pattern: str, timeout: float) -> str:
    """Read stderr until `pattern` shows up (the campaign prints progress and FOUND lines)."""
    seen, t0 = "", time.monotonic()
    box: list[str] = []

    def reader():
        for line in proc.stderr:
            box.append(line)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    while time.monotonic() - t0 < timeout:
        seen = "".join(box)
        if pattern in seen:
            return seen
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"{pattern!r} not seen within {timeout}s; stderr so far:\n{seen[-2000:]}")


def _wait_for_file(proc, out: Path, timeout: float) -> None:
    """Wait until a reproducer is written under `out` (its write is atomic: a .json there is whole)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(not f.name.startswith(".") for f in out.rglob("*.json")):  # not a .tmp- one being written
            return
        if proc.poll() is not None:
            pytest.fail(f"the campaign ended ({proc.returncode}) before writing a reproducer: "
                        f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no reproducer under {out} within {timeout}s")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_keeps_found_failure_and_prints_summary(tmp_path, sig):
    # A fault the simplest Case shows, at the first example (~4 s). Its reproducer is on disk at
    # once, before shrinking; the signal lands while Hypothesis shrinks (here for minutes: a
    # longer Case of the same run fails another property too, and both are minimized).
    proc = _start(["--budget", "300", "--fault", "pp_uneven_partition", "--keep-going",
                   "--layouts", "tp1pp3", "--modes", "eager"], tmp_path)
    _wait_for_file(proc, tmp_path / "repro", 240)
    proc.send_signal(sig)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()  # never leave a campaign running behind a failed test
    # A few seconds on an idle machine (measured: ~1 s); the bound leaves room for a loaded CI.
    assert time.monotonic() - t0 < 30, "did not stop within a few seconds"
    assert proc.returncode == 1  # failures found still means 1
    assert "layout" in out and "total" in out and "interrupted" in out  # the summary so far
    files = list((tmp_path / "repro").rglob("*.json"))
    assert files and all(load_reproducer(str(f)).case.faults == ("pp_uneven_partition",) for f in files)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped interrupt, on purpose
def test_interrupt_lost_in_a_gc_callback_still_stops_the_campaign(tmp_path):
    """A signal landing in a gc callback (Hypothesis 6.170 installs one) or a __del__ has its
    KeyboardInterrupt printed as "Exception ignored" and dropped: in CI a SIGINT'd campaign
    ran on to its budget. The handler's stop flag must end the run at the next Case anyway."""
    import gc

    from fuzz.campaign.loop import Campaign
    from fuzz.stop import request_stop
    from fuzz.verdict.harness import Harness

    def swallowing_callback(phase, info):  # what the signal handler does inside a gc callback
        if phase == "start" and h.checks >= 1:
            gc.callbacks.remove(swallowing_callback)
            request_stop()
            raise KeyboardInterrupt  # printed and dropped by the interpreter

    class CountingHarness(Harness):
        checks = 0

        def check(self, case):
            self.checks += 1
            if self.checks == 1:
                gc.callbacks.append(swallowing_callback)
            out = super().check(case)
            gc.collect()  # the callback fires here; its exception never reaches us
            return out

    h = CountingHarness()
    try:
        summary = Campaign(layouts=("tp1pp1",), modes=("eager",), budget_s=60, seed=0, out_dir=str(tmp_path),
                           harness=h, progress=False).run()
    finally:
        if swallowing_callback in gc.callbacks:
            gc.callbacks.remove(swallowing_callback)
        h.close()
    assert summary.interrupted and summary.seconds < 30, summary
    assert h.checks <= 2, "the campaign ran on after the stop was requested"


@pytest.mark.slow
def test_sigterm_during_selftest_stops_it_and_prints_the_faults_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "fuzz.cli", "selftest", "--out", str(tmp_path / "repro"),
                             "--budget-per-fault", "120", "--fault", "pp_shared_staging_buffer",
                             "--fault", "pp_stale_new_token_ids"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    _wait_for(proc, "campaign started", 60)
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 30, "did not stop within a few seconds"
    assert proc.returncode == 130  # no verdict on the faults not run
    assert "interrupted" in out or "yes" in out, out  # the first fault's row is printed
    assert "pp_stale_new_token_ids" not in out, "the selftest went on to the next fault"


EXEC_CHILD = """
import os, signal, sys
from fuzz.stop import terminate_as_interrupt
signal.signal(signal.SIGTERM, terminate_as_interrupt)
try:
    exec("import os, signal, time\\nos.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(30)", {})
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_signal_inside_exec_of_a_string_still_exits_with_the_code(tmp_path):
    """The window of the selftest's death by SIGINT (-2 instead of 130): a SIGTERM whose handler
    raises while the main thread runs code from a source string (Hypothesis builds its test
    wrappers with exec(str)). CPython then remembers an 'unhandled' KeyboardInterrupt although
    it was caught, and a `python -m` process kills itself with SIGINT at exit. The handler's
    StopRequested (a KeyboardInterrupt subclass) is not remembered: the exit code stands."""
    (tmp_path / "exec_child.py").write_text(EXEC_CHILD)
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "exec_child"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])


def test_signal_after_the_command_finished_does_not_kill_it(tmp_path):
    """Once main() is done, the `llmfuzz` command keeps a handler that only sets the stop flag:
    a SIGTERM arriving while the process exits cannot turn its exit code into a signal death."""
    child = ("import os, signal, sys\nfrom fuzz.cli import main as cli\n"
             "code = cli.main(['faults', '--json'], restore_signals=False)\n"
             "os.kill(os.getpid(), signal.SIGTERM)\nos.kill(os.getpid(), signal.SIGINT)\nsys.exit(code + 5)\n")
    (tmp_path / "after_child.py").write_text(child)
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-m", "after_child"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 5, (r.returncode, r.stderr[-2000:])


@pytest.mark.slow
def test_sigterm_on_clean_campaign_exits_zero_quickly(tmp_path):
    proc = _start(["--budget", "300", "--layouts", "tp2pp2", "--modes", "eager", "--json"], tmp_path)
    _wait_for(proc, "campaign started", 60)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads(out)
    assert summary["interrupted"] is True and summary["failures"] == 0


def test_bad_reproducer_files_exit_2_without_executing(tmp_path):
    bad = {"truncated.json": '{"format": 1, "case": {"config": {', "notjson.json": "hello",
           "newer.json": json.dumps({"format": 99, "case": {}}),
           "pickle.json": "cos\nsystem\n(S'touch PWNED'\ntR.",
           "impossible.json": json.dumps({"format": 1, "case": {"format": 1, "config": {"tensor_parallel_size": 3},
                                                                "workload": [{"prompt_token_ids": [1], "max_tokens": 1}]}})}
    env = dict(os.environ, PYTHONPATH=REPO)
    for name, text in bad.items():
        p = tmp_path / name
        p.write_text(text)
        r = subprocess.run([sys.executable, "-m", "fuzz.cli", "replay", str(p)], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=180)
        assert r.returncode == 2, (name, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
    assert not (tmp_path / "PWNED").exists()


def test_unwritable_output_prints_case_and_exits_3(tmp_path):
    """/proc refuses new files even for root: the failure must reach stderr whole."""
    env = dict(os.environ, PYTHONPATH=REPO)
    # A fault the simplest Case shows (found and minimal at the first example): the write
    # fails within seconds.
    r = subprocess.run([sys.executable, "-m", "fuzz.cli", "run", "--out", "/proc/llmfuzz-unwritable",
                        "--budget", "15", "--shrink-budget", "2", "--fault", "pp_uneven_partition",
                        "--layouts", "tp1pp3", "--modes", "eager", "--quiet"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=400)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "cannot write reproducer" in r.stderr
    line = r.stderr.split("the failing Case follows as JSON:\n", 1)[1].splitlines()[0]
    from fuzz.cases.case import Case

    assert Case.from_json(line).faults == ("pp_uneven_partition",)
    assert "replay None" not in r.stdout + r.stderr and "no reproducer written" in r.stdout


# -- processes and memory, read from /proc ------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))  # glibc: mallinfo2 and malloc_trim


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


def _heap_mb() -> float:
    """Bytes malloc has handed out and not had back (glibc's mallinfo2: in-use chunks plus
    mmapped ones). Unlike RSS it does not count freed memory the allocator keeps, so what it
    adds over a repeat is what was retained, not fragmentation."""
    _LIBC.mallinfo2.restype = _Mallinfo2
    m = _LIBC.mallinfo2()
    return (m.uordblks + m.hblkhd) / 2**20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- a rank killed with SIGKILL during a campaign -------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_sigkilled_gloo_rank_is_a_named_failure_and_campaign_goes_on(tmp_path):
    """A real campaign on the torch.distributed world (gloo ranks), rank 1 of the running
    Case's world SIGKILLed after its first step: the Case is a crash failure naming rank 1,
    on disk within seconds; the campaign goes on, and its next Cases pass on a fresh world;
    nothing of either world is left running."""
    from fuzz.campaign.loop import Campaign
    from fuzz.verdict.harness import Harness
    from fuzz.verdict.properties import Violation

    class KillingHarness(Harness):
        """Kills rank 1 in the second test run; stops the campaign (as Ctrl-C does) once two
        Cases have passed after the failure was recorded."""

        def __init__(self) -> None:
            super().__init__()
            self.runs, self.victim = 0, None
            self.kill_t = self.fail_t = self.on_disk_t = None  # time.time() of each event
            self.worlds: list[list[int]] = []  # rank pids of every test run
            self.after: list[list[int]] = []  # worlds of the Cases that passed after the failure
            self.campaign = None

        def check(self, case):
            if self.fail_t is not None and self.on_disk_t is None and list(out.rglob("*.json")):
                self.on_disk_t = time.time()  # the campaign's next check: is the failure on disk?
            if self.campaign.summary.failures and len(self.after) >= 2:
                raise KeyboardInterrupt  # seen enough: stop the campaign (as Ctrl-C does)
            if self.kill_t is not None and time.time() - self.kill_t > 180:
                raise KeyboardInterrupt  # something is wrong; the asserts below say what
            recorded = bool(self.campaign.summary.failures)
            try:
                verdict = super().check(case)
            except Violation:
                if self.kill_t is not None and self.fail_t is None:
                    self.fail_t = time.time()
                raise
            if recorded:
                self.after.append(self.worlds[-1])
            return verdict

        def _run(self, case, forced):
            if case.config.world != "torch":
                return super()._run(case, forced)  # the in-process reference
            eng = self.pool.get(case.config)
            self.worlds.append(list(eng.executor.pids))
            self.runs += 1
            if self.runs == 2:
                step = eng.step

                def killing_step():
                    result = step()  # rank 1 has work in flight now (pp2)
                    if self.kill_t is None:
                        self.victim = eng.executor.pids[1]
                        os.kill(self.victim, signal.SIGKILL)
                        self.kill_t = time.time()
                    return result
                eng.step = killing_step  # this engine only; a crash discards it
            return super()._run(case, forced)

    out = tmp_path / "repro"
    out.mkdir()
    h = KillingHarness()
    camp = Campaign(layouts=("tp1pp2",), modes=("eager",), base=FUZZ_MODEL.replace(world="torch"),
                    budget_s=400, chunk=2, out_dir=str(out), harness=h, progress=False)
    h.campaign = camp
    try:
        summary = camp.run()
    finally:
        h.close()
    assert h.kill_t is not None, "the second Case never ran"
    # The Case failed as a crash of rank 1, killed by signal 9, and its reproducer was on disk
    # within the bound (measured on 2 loaded cores: 0.07 s to the failure, 0.12 s to disk).
    assert h.fail_t is not None and h.fail_t - h.kill_t < 15.0, (h.kill_t, h.fail_t)
    assert h.on_disk_t is not None and h.on_disk_t - h.kill_t < 15.0, (h.kill_t, h.on_disk_t)
    assert [(f.property, f.message) for f in summary.failures] == [("crash", "crash on rank(s) [1]: exit code -9")]
    repro = load_reproducer(summary.failures[0].path)
    assert repro.property == "crash" and repro.case.config.world == "torch"
    # The campaign went on: two more Cases passed, on ranks other than the killed world's.
    assert summary.interrupted and len(h.after) >= 2
    killed_world = next(w for w in h.worlds if h.victim in w)
    assert all(not set(w) & set(killed_world) for w in h.after)
    # Nothing is left: every rank ever started is gone, and the fork server that started them
    # has no children.
    assert not [p for w in h.worlds for p in w if _alive(p)]
    servers = [p for p in descendants(os.getpid()) if "multiprocessing.forkserver" in _cmdline(p)]
    assert not [c for s in servers for c in descendants(s)]


# -- memory and file descriptors over a campaign ---------------------------------------------
def _census(h) -> dict:
    """What the harness retains once its engines are dropped: live tensors and engine
    internals (after a full collection), open fds, threads, resident memory."""
    import gc

    import hypothesis.strategies._internal.utils
    import torch

    from engine.executor import InProcExecutor
    from engine.llm_engine import LLMEngine
    from engine.worker import Worker

    h.pool.close()  # as eviction would: every engine is shut down and dropped
    # Hypothesis' own strategy cache (an LRU of 1024 strategies; ours are built per config,
    # so it fills over the first few hundred examples): bounded, and not ours to measure.
    getattr(hypothesis.strategies._internal.utils, "clear_strategy_cache", lambda: None)()
    gc.collect()
    # Freed heap handed back to the system: what remains resident is what is retained, not
    # the allocator's high-water mark (glibc keeps freed arenas unless trimmed).
    _LIBC.malloc_trim(0)
    objs = gc.get_objects()
    kinds = [type(o) for o in objs]  # type(), not isinstance: some objects warn on __class__
    return {"tensors": sum(issubclass(k, torch.Tensor) for k in kinds),
            "engines": sum(issubclass(k, (LLMEngine, InProcExecutor, Worker)) for k in kinds),
            "fds": _fds(), "threads": threading.active_count(), "rss_mb": _rss_mb(), "heap_mb": _heap_mb(),
            # cached runs: references, and the alone runs of sampled requests (cached alike)
            "refs": len(h.ref_cache) + len(h.alone_cache)}


@pytest.mark.slow
def test_memory_and_fds_stay_flat_over_a_campaign(tmp_path):
    """A warm-up campaign, then a measured one, then its Cases again, on one harness whose pool holds only 2
    engines so that engines are built and evicted all the time (where leaks hide). Between
    them, nothing may grow but the bounded reference cache, by its logits alone.

    The campaigns' budgets are in examples (a clock each check moves: `_memory_census`), so a
    loaded machine runs as many. Measured (2 cores, 17-24 measured examples): no engine internals left, fds and threads
    equal, 20-45 tensors per cached run; malloc's in-use bytes +0.5 MB over the repeat (the
    measured Cases again), +1.8 MB over the measured campaign; 1 MB kept a check (planted)
    read +16.4 MB over the repeat (RSS: +6.5, the pages never touched). Before the fixes this test found
    the same campaign keeping every engine ever built (the custom-op registries held their
    groups: 390 engines, executors and workers alive after the pool was closed, RSS +116 MB)
    and each cached reference holding its FA records (68 tensors per reference); a 30-minute
    `llmfuzz run` then grew from 381 MB at minute 1 to 1217 MB at minute 30."""
    # In a fresh interpreter: the campaign's memory, not the test runner's. pytest 9.2 itself
    # kept ~30 MB more across the same campaign than 9.0 (a fresh venv measured +55..+59 MB
    # here with no tensor, engine or fd retained, 9.0.3 +25 MB).
    code = (f"import json, runpy; from fuzz import profiles; profiles.load(); m = runpy.run_path({__file__!r}); "
            f"print(json.dumps(m['_memory_census']({str(tmp_path / 'repro')!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    before, warm, end, mid, bare, cached = (d[k] for k in ("before", "warm", "end", "mid", "bare", "cached"))
    warm_up, measured = d["warm_up"], d["measured"]
    assert not warm_up["failures"] and not measured["failures"]
    assert measured["examples"] >= 10, "too few examples to say anything"
    # No engine outlives the pool; no fd or thread is left over (<=: a daemon thread of an
    # earlier test in this process may end meanwhile).
    assert warm["engines"] == end["engines"] == bare["engines"] == 0, (warm, end)
    assert end["fds"] <= warm["fds"], (warm, end)
    assert end["threads"] <= warm["threads"] <= before["threads"], (before, warm, end)
    # The reference cache holds each cached run's token rows (at most 4 requests x 8 tokens: a
    # logits row, with top logprobs where asked, each a view that keeps its step's block;
    # measured 20-45 tensors a run), not its FA records (+48 a run when it did); the oracles'
    # caches one logits block per request; nothing else is retained.
    assert end["refs"] > 0 and (end["tensors"] - mid["tensors"]) / end["refs"] <= 64, (end, mid)
    assert mid["tensors"] - bare["tensors"] <= cached, (mid, bare, cached)
    assert bare["tensors"] <= warm["tensors"] + 16, (warm, bare)
    # Memory, each time with the pool closed and the caches cleared: what malloc has handed out
    # and not had back (heap_mb), which tensors and most of what else a leak keeps are made of.
    # Measured over 17-19 examples: +0.5 MB over the repeat, +1.8 MB over the measured campaign,
    # the same in six runs. RSS is reported, not bounded tightly: it counts freed memory the
    # allocator keeps, and moved -26..+39 MB over the same Cases with nothing retained (+55 in
    # CI over a second campaign, which drew other Cases).
    again = d["again"]
    assert not d["measured_again"]["failures"]
    assert again["engines"] == 0 and again["tensors"] <= bare["tensors"] + 16, (bare, again)
    assert again["heap_mb"] - bare["heap_mb"] < 8, (bare, again, d["measured_again"]["examples"])
    assert bare["heap_mb"] - warm["heap_mb"] < 16, (warm, bare, measured["examples"])
    # A gross bound on what malloc does not see (Python's own arenas, mmaps): twice the noise.
    assert again["rss_mb"] - bare["rss_mb"] < 112, (bare, again)


CHECK_S = 0.5  # what a check costs the census campaigns' clock


def _memory_census(out_dir: str) -> dict:
    """The campaigns of test_memory_and_fds_stay_flat_over_a_campaign and the census between
    them, for a fresh interpreter to run (runpy) and print."""
    from engine import cpu_graph
    from engine.attention import reference
    from fuzz.campaign.loop import Campaign
    from fuzz.verdict.harness import Harness

    from fuzz_testutil import FakeClock

    base = FUZZ_MODEL.replace(num_hidden_layers=2)  # small and quick: many examples, same machinery
    h = Harness(pool_capacity=2)
    # The campaigns run on a clock each check moves by CHECK_S: a budget is a number of
    # examples (budget / CHECK_S), however loaded the machine (a loaded one fit 7 in 10 s).
    clock = FakeClock()

    def campaign(seed: int, budget_s: float):
        s = Campaign(layouts=("tp1pp2", "tp2pp1"), modes=("eager", "graph"), base=base, max_requests=4,
                     seed=seed, budget_s=budget_s, out_dir=out_dir, harness=h, progress=False, clock=clock).run()
        return {"failures": len(s.failures), "examples": s.examples}

    # The measured campaign's Cases, in the order it checked them: the repeat checks exactly
    # these. A second campaign would not (the round robin gives each cell time, not examples, so
    # a rerun reaches other chunks, and their first-use memory reads as growth).
    checked, check = [], h.check

    def timed_check(case):
        clock.sleep(CHECK_S)
        return check(case)

    def recording_check(case):
        checked.append(case)
        return timed_check(case)

    out = {"before": _census(h)}
    try:
        # The warm-up draws what the measured campaign starts with (same seed): the code paths
        # those Cases take are met before the census, so less first use reads as growth.
        h.check = timed_check
        out["warm_up"] = campaign(1, 16 * CHECK_S)  # about 16 examples
        h.clear_caches()
        out["warm"] = _census(h)
        h.check = recording_check
        out["measured"] = campaign(1, 20 * CHECK_S)  # about 20
        h.check = check
        out["end"] = _census(h)
        h.ref_cache.clear()
        h.alone_cache.clear()  # the runs of sampled requests alone: cached as references are
        cpu_graph.clear_templates()  # the engine's bounded process-wide caches: traces, launch plans
        reference.clear_plans()
        out["mid"] = _census(h)
        out["cached"] = len(h.solo.results) + (len(h.transformers.results) if h.transformers else 0)
        h.clear_caches()  # the oracles' result caches too (bounded)
        out["bare"] = _census(h)
        # The same Cases again, in the same order: every code path they take has been met, so
        # what they add is retention, not first use.
        for case in checked:
            check(case)  # a failure raises (Violation): the interpreter exits, the test shows it
        out["measured_again"] = {"failures": 0, "examples": len(checked)}
        h.clear_caches()
        out["again"] = _census(h)
    finally:
        h.close()
    return out
