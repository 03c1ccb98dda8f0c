"""The vLLM worker process from the outside: its handle (`_Worker`), reading its replies
with a no-progress watchdog and the stop flag, dumping every process's stacks, killing its
process group. Used by `fuzz.targets.vllm_target.VLLMTarget`; standard library only.

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


def kill_group(w: _Worker) -> None:
    """SIGKILL the process group this target started (the worker and vLLM's children)."""
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


def read_reply(w: _Worker, timeout: float, idle: float | None = None, on_stop=None) -> dict | None:
    """The next reply line other than progress; None after `timeout` in all or `idle`
    without any line (progress lines count: the worker writes one per engine step);
    EOFError if the worker's stdout closed. A stop (fuzz.stop) runs `on_stop`, kills the
    worker's group and raises StopRequested within half a second."""
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


def dump_stacks(w: _Worker, stacks_dir: str, wait_s: float = 2.0) -> dict[int, str]:
    """Every process of the worker's group dumps its Python stacks (SIGUSR1: faulthandler,
    registered by vllm_site/sitecustomize.py): pid -> dump."""
    pids = group_pids(w.proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass
    time.sleep(wait_s)
    out = {}
    for pid in pids:
        try:
            with open(os.path.join(stacks_dir, f"{pid}.txt")) as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            out[pid] = text
    return out


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (Linux /proc), the leader first."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid:
                out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out, key=lambda p: (p != pgid, p))
