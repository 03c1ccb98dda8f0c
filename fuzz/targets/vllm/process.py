"""The vLLM worker process from the outside: its handle (`_Worker`), reading its replies
with a no-progress watchdog and the stop flag, dumping every process's stacks, killing its
process group. Used by `fuzz.targets.vllm.runner.VLLMRunner`; standard library only.

Each worker is started in a session of its own (`start_new_session`), so its process group
holds the worker and everything vLLM spawns from it (tp/pp workers, their helpers): killing
the group leaves nothing behind, and signalling it reaches every Python process for a stack
dump.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass


@dataclass
class _Worker:
    """A worker process: its config's engine key and cell name once it has one."""

    proc: subprocess.Popen
    key: str
    cell: str
    log_path: str
    buf: bytes = b""
    spawned: float = 0.0  # time.monotonic() of its spawn
    sent: float = 0.0  # time.perf_counter() when its config was sent (0: not yet): it is starting since
    sent_at: float = 0.0  # the same moment by the wall clock, which the worker's `ready_at` is read against
    start_s: float = 0.0  # how long its engine took to come up, warm-up included (the watchdog scales with it)
    slowest_step_s: float = 0.0  # the slowest engine step it reported (`step_s` of its progress lines)
    cache: object = None  # what its engine's prefix cache can hold (fuzz.targets.vllm.prefix.EngineCache)
    stall_dumps: dict | None = None  # the stacks dumped when its last run stopped making progress


def kill_group(w: _Worker) -> None:
    """SIGKILL the process group of a worker the runner started (the worker and vLLM's children)."""
    try:
        os.killpg(w.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for f in (w.proc.stdin, w.proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def stop_worker(w: _Worker, kill=kill_group) -> None:
    """Ask a worker to exit (`{"cmd": "exit"}`, the protocol of both the vLLM and the
    transformers-cb workers); its whole group is killed after 5 s, or at once if it is dead."""
    try:
        if w.proc.poll() is None:
            w.proc.stdin.write(b'{"cmd": "exit"}\n')
            w.proc.stdin.flush()
            w.proc.wait(timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):  # ValueError: a stop closed its stdin meanwhile
        pass
    kill(w)


def read_reply(w: _Worker, timeout: float, idle: float | None = None, on_stop=None,
               on_progress=None) -> dict | None:
    """The next reply line other than progress; None after `timeout` in all or `idle`
    without any line (progress lines count: the worker writes one per engine step, and each
    is passed to `on_progress`); EOFError if the worker's stdout closed. A stop (fuzz.stop)
    runs `on_stop`, kills the worker's group and raises StopRequested within half a second."""
    from fuzz.stop import StopRequested, stop_requested

    t0 = time.monotonic()
    deadline, last = t0 + timeout, t0
    fd = w.proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in w.buf:
                line, w.buf = w.buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("event") != "progress":
                    return msg
                last = time.monotonic()
                if on_progress is not None:
                    on_progress(msg)
            if stop_requested():
                if on_stop is not None:
                    on_stop()
                kill_group(w)
                raise StopRequested
            now = time.monotonic()
            left = min(deadline - now, (last + idle - now) if idle is not None else deadline - now)
            if left <= 0:
                return None
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            w.buf += chunk


def answered(w: _Worker) -> bool:
    """Whether the worker has a reply line waiting (or has closed its stdout), without
    blocking: what is read is kept in its buffer for `read_reply`."""
    if b"\n" in w.buf:
        return True
    fd = w.proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        if not sel.select(timeout=0):
            return False
    chunk = os.read(fd, 1 << 20)
    if not chunk:
        return True
    w.buf += chunk
    return b"\n" in w.buf


def dump_stacks(w: _Worker, stacks_dir: str, wait_s: float = 2.0) -> dict[int, str]:
    """Every process of the worker's group dumps its Python stacks (SIGUSR1: faulthandler,
    registered by site/sitecustomize.py): pid -> this dump. faulthandler appends each dump to
    the process's file, so only what was written after the signal is read (a watchdog that
    looks again, at a compile, must not read the first dump twice); the files are polled until
    every process has written, at most `wait_s` (faulthandler writes from its signal handler,
    within milliseconds of the signal, unless the process is stopped)."""
    pids = group_pids(w.proc.pid)
    paths = {pid: os.path.join(stacks_dir, f"{pid}.txt") for pid in pids}
    sizes = {pid: _size(p) for pid, p in paths.items()}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + wait_s
    while time.monotonic() < end and any(_size(p) <= sizes[pid] for pid, p in paths.items()):
        time.sleep(0.05)
    time.sleep(min(0.1, wait_s))  # the last lines of a dump still being written
    out = {}
    for pid, path in paths.items():
        try:
            with open(path, "rb") as f:
                f.seek(sizes[pid])
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        if text.strip():
            out[pid] = text
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def proc_stats() -> dict[int, list[str]]:
    """Every live process's /proc/PID/stat fields after its name (state, ppid, pgrp, ...);
    zombies are left out: they are dead, only not yet reaped."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
        except (OSError, ValueError):
            continue
        if fields and fields[0] != "Z":
            out[int(d)] = fields
    return out


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (Linux /proc), the leader first."""
    out = [pid for pid, fields in proc_stats().items() if int(fields[2]) == pgid]
    return sorted(out, key=lambda p: (p != pgid, p))


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (by parent pid in /proc)."""
    children: dict[int, list[int]] = {}
    for p, fields in proc_stats().items():
        children.setdefault(int(fields[1]), []).append(p)
    out, stack = [], list(children.get(pid, []))
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out
