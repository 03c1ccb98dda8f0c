"""Hangs told apart: every process's Python stacks, dumped by faulthandler when progress stops
(fuzz/targets/vllm/site/sitecustomize.py registers it on SIGUSR1), and the hang's signature
read off them: `hang@<innermost vLLM or llmfuzz frame of the stuck thread>`, e.g.
`hang@vllm/v1/core/sched/scheduler.py:schedule`.

Which thread is stuck: a hung vLLM has many threads that merely wait (the engine client for
outputs, the engine core's input queue, ZMQ and tokio pollers, executor futures); they sit in
a waiting primitive. The stuck thread is the one whose innermost frame is NOT such a wait:
it is computing or sleeping somewhere a step should have returned from. Without one (every
thread waits: a lost message, a deadlock), the innermost vLLM frame of a waiting main thread
names the hang instead. No line numbers, so a signature survives small upstream edits.

Not every stall is a hang: a process sitting in a compiler (`compiling`: torch.compile's
dynamo and inductor, its C++ builder, triton, vLLM's compilation layer) is compiling, which
on a cold cache and a busy machine takes minutes; the runner waits for it instead.
"""
from __future__ import annotations

import os
import re

from fuzz.targets.runs import package_path

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)\s*$')

# Innermost frames that only wait for something else (file basename, function).
_WAIT_FILES = {"threading.py", "queue.py", "selectors.py", "socket.py", "connection.py", "synchronize.py",
               "popen_fork.py", "subprocess.py", "selector_events.py", "base_events.py", "socket.pyi",
               "poll.py", "_futures.py", "thread.py", "shm_broadcast.py", "managers.py", "resource_tracker.py",
               "pool.py", "process.py"}
_WAIT_FUNCS = {"wait", "select", "poll", "recv", "recv_multipart", "get", "acquire", "_recv", "_recv_bytes",
               "accept", "readline", "read", "dequeue", "_poll", "join", "_wait_for_tstate_lock", "run_forever",
               "_run_once", "recv_pyobj", "get_output", "busy_loop", "_worker", "wait_for"}


def parse_dump(text: str) -> list[dict]:
    """faulthandler output -> [{"current": bool, "frames": [{"file", "line", "func"}, ...]}],
    frames innermost first (faulthandler's order)."""
    threads: list[dict] = []
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            threads.append({"current": m.group(1) == "Current thread", "id": m.group(2), "frames": []})
            continue
        f = _FRAME.match(line)
        if f and threads:
            threads[-1]["frames"].append({"file": f["file"], "line": int(f["line"]), "func": f["func"]})
    return [t for t in threads if t["frames"]]


def llmfuzz_path(path: str) -> str | None:
    """'.../fuzz/targets/vllm/site/sitecustomize.py' -> 'fuzz/targets/vllm/site/sitecustomize.py':
    llmfuzz's own code in a vLLM process (this package: the worker, the site hooks); None
    otherwise. This package's directory is named vllm too, so it is told from vLLM's by the
    fuzz/targets before it."""
    p = package_path(path, "fuzz")
    return p if p is not None and p.startswith("fuzz/targets/vllm/") else None


def vllm_frames(frames: list[dict]) -> list[dict]:
    """`frames` without llmfuzz's own, for a signature keyed by the innermost vLLM frame."""
    return [f for f in frames if llmfuzz_path(f["file"]) is None]


def ours(path: str) -> str | None:
    """'.../site-packages/vllm/v1/x.py' -> 'vllm/v1/x.py'; '.../fuzz/targets/y.py' ->
    'fuzz/targets/y.py'; None for anything else (stdlib, torch, ...)."""
    return llmfuzz_path(path) or package_path(path, "vllm") or package_path(path, "fuzz")


def waiting(thread: dict) -> bool:
    top = thread["frames"][0]
    return os.path.basename(top["file"]) in _WAIT_FILES or top["func"] in _WAIT_FUNCS


def stuck_frame(dumps: dict[int, str]) -> dict | None:
    """The stuck frame over every process's dump (pid -> text): the innermost vLLM/llmfuzz
    frame of the first thread not waiting (processes in pid order, main threads first), with
    `where`: its path and the process; else the innermost vLLM/llmfuzz frame of a waiting
    thread. None when no stack has one."""
    busy, idle = [], []
    for pid in sorted(dumps):
        threads = parse_dump(dumps[pid])
        threads.sort(key=lambda t: not t["current"])  # the signalled (main) thread first
        for t in threads:
            (idle if waiting(t) else busy).append((pid, t))
    for group in (busy, idle):
        for pid, t in group:
            for fr in t["frames"]:
                p = ours(fr["file"])
                if p is not None:
                    return {**fr, "path": p, "pid": pid, "waiting": group is idle}
    for pid, t in busy:  # nothing of ours: the busy thread's own innermost frame
        fr = t["frames"][0]
        return {**fr, "path": os.path.basename(fr["file"]), "pid": pid, "waiting": False}
    return None


def hang_signature(dumps: dict[int, str], fallback: str = "hang@run") -> str:
    fr = stuck_frame(dumps)
    return f"hang@{fr['path']}:{fr['func']}" if fr else fallback


def describe(dumps: dict[int, str], limit: int = 6) -> str:
    """The stuck thread's innermost frames, for the failure's message."""
    fr = stuck_frame(dumps)
    if fr is None:
        return "no Python stack was dumped"
    for t in parse_dump(dumps[fr["pid"]]):
        if any(f["file"] == fr["file"] and f["line"] == fr["line"] for f in t["frames"]):
            frames = " <- ".join(f"{ours(f['file']) or os.path.basename(f['file'])}:{f['line']}:{f['func']}"
                                 for f in t["frames"][:limit])
            return f"pid {fr['pid']}{' (every thread waiting)' if fr['waiting'] else ''}: {frames}"
    return f"pid {fr['pid']}: {fr['path']}:{fr['func']}"


# Compilers a vLLM process may sit in for minutes on a cold cache: torch.compile's tracer
# (dynamo) and code generator (inductor: C++ built by cpp_builder, Triton kernels), and
# vLLM's own compilation layer around them. A frame counts only where the file is one of
# compilation, or the function one that compiles: compiled code *runs* under frames of the
# same packages (dynamo's eval_frame wrapper, inductor's output_code), and a hang there is the
# engine's, not the compiler's.
_COMPILER_DIRS = ("torch/_dynamo/", "torch/_inductor/", "triton/", "vllm/compilation/")
_COMPILER_FILES = {"convert_frame.py", "output_graph.py", "symbolic_convert.py", "compile_fx.py", "codecache.py",
                   "cpp_builder.py", "async_compile.py", "graph.py", "lowering.py", "scheduler.py", "codegen",
                   "compiler.py", "compiler_interface.py", "backends.py", "autotune_process.py"}


def compiler_frame(frame: dict) -> bool:
    """Whether a stack frame is a compiler's (above): its file under torch._dynamo,
    torch._inductor, triton or vllm.compilation, and either a compiling file or a function
    whose name says it compiles."""
    path = frame["file"].replace("\\", "/")
    if not any(d in path for d in _COMPILER_DIRS):
        return False
    return os.path.basename(path) in _COMPILER_FILES or "/codegen/" in path or "compile" in frame["func"].lower()


def compiling(dumps: dict[int, str]) -> str | None:
    """Where a process of the dumps is compiling (`pid N: file:func`, its innermost compiler
    frame), or None. Any thread counts, waiting or not: inductor waits on its C++ compiler's
    subprocess or its compile workers, a wait inside a compile."""
    for pid in sorted(dumps):
        for t in parse_dump(dumps[pid]):
            for fr in t["frames"]:
                if compiler_frame(fr):
                    return f"pid {pid}: {os.path.basename(fr['file'])}:{fr['func']}"
    return None
