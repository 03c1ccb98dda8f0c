"""A transformers-cb hang named by its stuck frame: the worker's threads' stacks (faulthandler,
dumped when no batch finished for a while) read with the vLLM target's parser
(fuzz.targets.vllm.stacks). The library's background thread computes or sleeps somewhere a
batch should have returned from; the worker's main thread only waits for results. The
signature is `hang@<innermost transformers frame of the first thread not waiting>` (or of a
waiting one when every thread waits: a deadlock), without line numbers. A worker that died of
a signal (a native abort, a segfault) is named the same way from the dump faulthandler writes
as it dies: `ProcessDied(rc=-6)@<innermost transformers frame of the thread that died>`."""
from __future__ import annotations

import os
import re

from fuzz.targets.runs import package_path
from fuzz.targets.vllm.stacks import parse_dump, waiting

_FATAL = re.compile(r"^Fatal Python error: (.+)$")


def hang_signature(dumps: dict[int, str], fallback: str = "hang@run") -> tuple[str, str]:
    """(signature, the stuck thread's innermost frames) over every process's dump."""
    busy, idle = [], []
    for pid in sorted(dumps):
        for t in parse_dump(dumps[pid]):
            (idle if waiting(t) else busy).append(t)
    for group in (busy, idle):
        for t in group:
            if (named := _library_frame(t)) is not None:
                return f"hang@{named}", _describe(t)
    if busy:
        fr = busy[0]["frames"][0]
        return f"hang@{os.path.basename(fr['file'])}:{fr['func']}", _describe(busy[0])
    return fallback, "no Python stack was dumped"


def _library_frame(thread: dict) -> str | None:
    """'transformers/x.py:func' of the thread's innermost transformers frame; None without one."""
    for fr in thread["frames"]:
        if (p := package_path(fr["file"], "transformers")) is not None:
            return f"{p}:{fr['func']}"
    return None


def _describe(thread: dict, limit: int = 6) -> str:
    return " <- ".join(f"{package_path(f['file'], 'transformers') or os.path.basename(f['file'])}:{f['line']}:{f['func']}"
                       for f in thread["frames"][:limit])


def death_signature(log: str, rc: int | None) -> tuple[str, str]:
    """(signature, detail) of a worker that died, from its log: faulthandler's dump of the
    fatal signal names the thread it hit ("Current thread") and its frames; the lines printed
    just before it say why, where the library or torch said anything (a C++ `terminate called
    ... what(): CUDA error ...`). Without a dump, the log's last lines."""
    base, lines = f"ProcessDied(rc={rc})", log.splitlines()
    at = next((i for i in range(len(lines) - 1, -1, -1) if _FATAL.match(lines[i])), None)
    if at is None:
        return f"{base}@transformers_cb_worker", " | ".join(lines[-3:])[:400]
    said = [ln.strip()[:200] for ln in lines[max(0, at - 6):at] if ln.strip()][-3:]
    threads = sorted(parse_dump("\n".join(lines[at:])), key=lambda t: not t["current"])
    named = next(((t, n) for t in threads if (n := _library_frame(t)) is not None), None)
    if named is not None:
        sig, where = f"{base}@{named[1]}", _describe(named[0])
    else:
        sig, where = f"{base}@transformers_cb_worker", _describe(threads[0]) if threads else "no Python stack was dumped"
    detail = f"Fatal Python error: {_FATAL.match(lines[at]).group(1)}"
    if said:
        detail += "; printed before it: " + " / ".join(said)
    return sig, f"{detail}; thread: {where}"[:800]
