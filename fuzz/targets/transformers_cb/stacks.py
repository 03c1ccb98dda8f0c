"""A transformers-cb hang named by its stuck frame: the worker's threads' stacks (faulthandler,
dumped when no batch finished for a while) read with the vLLM target's parser
(fuzz.targets.vllm.stacks). The library's background thread computes or sleeps somewhere a
batch should have returned from; the worker's main thread only waits for results. The
signature is `hang@<innermost transformers frame of the first thread not waiting>` (or of a
waiting one when every thread waits: a deadlock), without line numbers."""
from __future__ import annotations

import os

from fuzz.targets.runs import package_path
from fuzz.targets.vllm.stacks import parse_dump, waiting


def hang_signature(dumps: dict[int, str], fallback: str = "hang@run") -> tuple[str, str]:
    """(signature, the stuck thread's innermost frames) over every process's dump."""
    busy, idle = [], []
    for pid in sorted(dumps):
        for t in parse_dump(dumps[pid]):
            (idle if waiting(t) else busy).append(t)
    for group in (busy, idle):
        for t in group:
            for fr in t["frames"]:
                p = package_path(fr["file"], "transformers")
                if p is not None:
                    return f"hang@{p}:{fr['func']}", _describe(t)
    if busy:
        fr = busy[0]["frames"][0]
        return f"hang@{os.path.basename(fr['file'])}:{fr['func']}", _describe(busy[0])
    return fallback, "no Python stack was dumped"


def _describe(thread: dict, limit: int = 6) -> str:
    return " <- ".join(f"{package_path(f['file'], 'transformers') or os.path.basename(f['file'])}:{f['line']}:{f['func']}"
                       for f in thread["frames"][:limit])
