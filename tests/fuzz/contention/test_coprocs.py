"""Contention co-processes are the tool's own: they run while held, pause and resume per
level, and leave nothing behind, even when the process that started them is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fuzz.contention import Contention, Profile, active
from fuzz.contention.coprocs import ENV


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


def _wait_gone(pids, timeout=10.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def test_cpu_contention_runs_while_held_and_leaves_nothing_behind():
    before = os.environ.get(ENV)
    with Contention(Profile(cpu=2)) as c:
        pids = c.pids
        assert len(pids) == 2 and all(not _gone(p) for p in pids)
        assert active() == "cpu:2"  # what a reproducer written now records
        time.sleep(0.3)
        assert all(_state(p) in ("R", "S") for p in pids)
    assert _wait_gone(pids, 0.5) == []  # reaped by stop(), not left to the kernel
    assert os.environ.get(ENV) == before


def test_a_level_pauses_the_co_processes_it_does_not_use():
    with Contention(Profile(cpu=2)) as c:
        c.use(Profile(cpu=1))
        time.sleep(0.2)
        assert [_state(p) for p in c.pids][1] == "T"  # stopped
        assert active() == "cpu:1"
        c.use(Profile())
        assert active() is None
        c.use(Profile(cpu=2))
        time.sleep(0.2)
        assert all(_state(p) != "T" for p in c.pids)
        pids = c.pids
    assert _wait_gone(pids, 0.5) == []  # a paused co-process is killed too


def test_a_killed_campaign_leaves_no_co_process():
    code = ("import sys, time; from fuzz.contention import Contention, Profile\n"
            "c = Contention(Profile(cpu=2)).start(); print(*c.pids, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and all(not _gone(x) for x in pids)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert _wait_gone(pids) == []


def test_a_co_process_that_cannot_start_is_an_error_and_nothing_stays(monkeypatch):
    import fuzz.contention.coprocs as coprocs

    monkeypatch.setattr(coprocs, "READY_S", 90.0)  # importing torch on a busy machine
    c = Contention(Profile(gpu=1), device="cuda:99")  # no such device here: the co-process exits
    with pytest.raises(RuntimeError, match="exited with"):
        c.start()
    assert c.pids == [] and active() is None
