"""The vLLM runner's no-progress watchdog: how long a run may go without an engine step before
it is a hang candidate (`watchdog_s`), and waiting for a reply with it (`await_reply`), a
compiler on the stack waited for. Used by fuzz.targets.vllm.runner.VLLMRunner, which re-runs a
candidate on a fresh engine before calling it a hang.

The rule, from what this machine measured of the engine, not a constant:

    watchdog = max(floor, STEP_K x the slowest step the engine has made, START_K x its start-up)

Start-up includes the worker's warm-up generate (worker.py), so on a machine loaded enough
that the engine took 60 s to come up, a step gets 60 s; 10x the slowest step seen leaves room
for a step that meets a burst of load. `floor` is the runner's `hang_s` (40 s). A candidate
is re-run on a fresh engine with RERUN_K x the watchdog (capped by the run's bound): only a
second stall is a hang.
"""
from __future__ import annotations

import time
from typing import Callable

from fuzz.targets.vllm.process import _Worker
from fuzz.targets.vllm.stacks import compiling

STEP_K = 10.0
START_K = 1.0
RERUN_K = 4.0


def watchdog_s(floor: float, w: _Worker) -> float:
    """Seconds without a step's progress before a run of `w` is a hang candidate (above)."""
    return max(floor, STEP_K * w.slowest_step_s, START_K * w.start_s)


def await_reply(w: _Worker, read: Callable, dump: Callable, timeout: float, idle: float | None,
                extend_s: float = 0.0, deadline: float | None = None,
                waits: list | None = None) -> tuple[dict | None, dict[int, str] | None]:
    """(reply, None), or (None, the stacks dumped when it stopped) when nothing came within
    `timeout`, or within `idle` of the last progress (`read(w, timeout, idle)` reads). At each
    stop every process's stacks are dumped (`dump(w)`); one in a compiler is waited for again
    (each wait appended to `waits`), within `timeout` + `extend_s` in all: a cold compile on a
    busy machine is slow, not hung. Past `deadline` (time.monotonic()): (None, None)."""
    t0 = time.monotonic()
    end = t0 + timeout
    hard = end + extend_s
    while True:
        reply = read(w, max(0.0, end - time.monotonic()), idle)
        if reply is not None:
            return reply, None
        if deadline is not None and time.monotonic() >= deadline:
            return None, None
        dumps = dump(w)
        where = compiling(dumps)
        if where is None or time.monotonic() >= hard:
            return None, dumps
        if waits is not None:
            waits.append({"cell": w.cell, "where": where, "after_s": round(time.monotonic() - t0, 1)})
        end = max(end, min(hard, time.monotonic() + (idle or timeout)))
