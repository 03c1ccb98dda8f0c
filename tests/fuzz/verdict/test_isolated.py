"""IsolatedHarness: Cases checked in a child process that is replaced when it dies."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
import signal
import threading
import time

import pytest

from fuzz.verdict.isolated import IsolatedHarness, is_fatal, make_harness
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import CrashViolation, LogitsMismatch
from fuzz.campaign.reproduce import load_reproducer

ROOT = str(Path(__file__).resolve().parents[3])
UNEVEN = os.path.join(ROOT, "reproducers/faults/pp_uneven_partition.json")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_violation_and_verdict_cross_the_process_boundary():
    case = load_reproducer(UNEVEN).case
    h = IsolatedHarness()
    try:
        with pytest.raises(LogitsMismatch) as ei:
            h.check(case)
        assert ei.value.case == case and "max |logits - reference|" in ei.value.message
        v = h.check(dataclasses.replace(case, faults=()))
        assert v.logits.ratio <= 1.0 and v.num_steps >= 1 and v.case.faults == ()
        assert h.starts == 1  # one child served both Cases
        pid = h.proc.pid
    finally:
        h.close()
    assert h.proc is None and not _alive(pid)


def test_killed_child_is_a_crash_of_that_case_and_the_next_case_gets_a_fresh_child():
    case = dataclasses.replace(load_reproducer(UNEVEN).case, faults=())
    h = IsolatedHarness()
    try:
        started = time.monotonic()
        pids = []

        def kill_soon():
            while h.proc is None:
                time.sleep(0.01)
            pids.append(h.proc.pid)
            time.sleep(0.5)  # the child is importing torch or running the Case
            os.kill(h.proc.pid, signal.SIGKILL)

        t = threading.Thread(target=kill_soon)
        t.start()
        with pytest.raises(CrashViolation) as ei:
            h.check(case)
        t.join()
        assert "SIGKILL" in ei.value.message and ei.value.case == case
        assert time.monotonic() - started < 30
        v = h.check(case)  # a fresh child
        assert v.logits.ratio <= 1.0 and h.starts == 2 and h.proc.pid != pids[0]
    finally:
        h.close()


def test_fatal_cuda_errors_are_recognised():
    assert is_fatal("CrashViolation: RuntimeError: CUDA error: an illegal memory access was encountered")
    assert is_fatal("torch.AcceleratorError: CUDA error: device-side assert triggered")
    assert not is_fatal("logits: request r0 position 0: max |logits - reference| = 0.9")


def test_make_harness_isolates_cuda_by_default_only():
    assert isinstance(make_harness("cpu"), Harness)
    h = make_harness("cuda")
    assert isinstance(h, IsolatedHarness) and h.proc is None  # nothing started until a check
    assert isinstance(make_harness("cpu", "on"), IsolatedHarness)
    assert isinstance(make_harness("cuda", "off"), Harness)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_fatal_cuda_error_is_reported_and_the_next_case_runs_in_a_fresh_child():
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL

    cfg = FUZZ_MODEL.replace(device="cuda", attention_backend="torch_flash", dtype="bfloat16")
    bad = Case(cfg, Workload((RequestSpec((127, 1, 2), 2, 0),)))
    good = Case(cfg, Workload((RequestSpec((5, 1, 2), 2, 0),)))
    h = IsolatedHarness(child=(os.path.join(os.path.dirname(__file__), "_fatal_child.py"),))
    try:
        with pytest.raises(CrashViolation) as ei:
            h.check(bad)
        assert is_fatal(ei.value.message) and h.fatal_errors == 1 and h.proc is None
        v = h.check(good)  # the poisoned context is gone with its process
        assert v.logits.ratio <= 1.0 and h.starts == 2
    finally:
        h.close()
