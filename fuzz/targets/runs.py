"""What a black-box target returns: per request the generated token ids with top-k logprobs
at every position (`TargetRun`), or a `TargetFailure` (a crash or a hang, keyed by its
signature: exception type and innermost frame inside the target's package)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays light to import (the CLI imports it for --help)
    from fuzz.cases.case import Case, RequestSpec

Position = tuple[tuple[int, float], ...]  # top-k (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class RequestResult:
    token_ids: tuple[int, ...]
    logprobs: tuple[Position, ...]  # one per generated token
    # Teacher-forced prompt logprobs where the target returned them: one Position per prompt
    # token from the second on (the logprob of prompt token j given tokens [:j], with that
    # token included even outside the top-k); () when not asked for.
    prompt_logprobs: tuple[Position, ...] = ()
    num_cached_tokens: int = 0  # prompt tokens the target's prefix cache served (where it says)

    def top(self, i: int) -> dict[int, float]:
        return dict(self.logprobs[i])


@dataclass(slots=True)
class TargetRun:
    results: dict[str, RequestResult]
    seconds: float = 0.0
    steps: int = 0
    aborted: dict[str, int] = field(default_factory=dict)  # request -> driver step it was aborted before
    free_blocks: tuple[int | None, int | None] = (None, None)  # the KV pool's free blocks before, after


class TargetFailure(Exception):
    """The target crashed, hung or failed to start. `signature` keys it: exception type and
    innermost frame inside the target's package (no line numbers, so it survives small
    upstream edits), or `hang@<phase>`."""

    def __init__(self, kind: str, signature: str, detail: str = "", log_path: str | None = None) -> None:
        super().__init__(f"{kind}: {signature}" + (f" ({detail})" if detail else ""))
        self.kind, self.signature, self.detail, self.log_path = kind, signature, detail, log_path


class TargetUnavailable(RuntimeError):
    """The target's engine is not installed or cannot be found."""


def adapter_error(f: TargetFailure, package: str) -> str | None:
    """A start-up that failed before any of `package`'s code ran (no frame of it in the
    traceback: our adapter's own call, say an option the installed version lacks) is a harness
    error, not the engine's finding: the line its config's row shows, else None."""
    if f.kind == "startup" and f.signature.endswith(f"@<outside {package}>"):
        return (f"not run: the adapter failed before entering {package}, a harness error, not the "
                f"engine's: {f.signature}: {f.detail}")
    return None


def request_items(case: Case) -> list[tuple[str, RequestSpec]]:
    """Request ids as the reference engine names them (r0, r1, ...)."""
    return [(f"r{i}", r) for i, r in enumerate(case.workload.requests)]


# -- signatures -------------------------------------------------------------------------------

_LOG_PREFIX = re.compile(r"^(?:\((?P<proc>[^)]*?) pid=\d+\) )?(?:(?P<level>INFO|WARNING|ERROR|DEBUG|CRITICAL) "
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?)?")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Failure|Dead\w*)"
                  r"|AssertionError|KeyError|IndexError)(?::\s?(?P<msg>.*))?$")


def package_path(path: str, package: str) -> str | None:
    """'.../site-packages/vllm/v1/worker/x.py' -> 'vllm/v1/worker/x.py' (None if outside)."""
    parts = path.replace("\\", "/").split("/")
    if package not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index(package)
    return "/".join(parts[i:])


def signature(exc_type: str, frames: list[dict], package: str) -> str:
    """'AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors'."""
    for f in reversed(frames):
        p = package_path(f["file"], package)
        if p is not None:
            return f"{exc_type}@{p}:{f['func']}"
    return f"{exc_type}@<outside {package}>"


@dataclass(slots=True)
class LoggedTraceback:
    process: str  # the log prefix's process name (EngineCore, Worker_PP1, ...), '' if none
    level: str  # the log record's level (ERROR, WARNING, ...), '' for a bare traceback
    exc_type: str
    message: str
    frames: list[dict] = field(default_factory=list)
    text: str = ""


def parse_tracebacks(log: str) -> list[LoggedTraceback]:
    """Every Python traceback in a log, in order (logger prefixes stripped per line)."""
    out: list[LoggedTraceback] = []
    cur: LoggedTraceback | None = None
    for raw in log.splitlines():
        m = _LOG_PREFIX.match(raw)
        proc = (m.group("proc") or "") if m else ""
        level = (m.group("level") or "") if m else ""
        line = raw[m.end():] if m else raw
        if line.startswith("Traceback (most recent call last):"):
            cur = LoggedTraceback(proc, level, "", "", [], line + "\n")
            continue
        if cur is None:
            continue
        cur.text += line + "\n"
        fm = _FRAME.match(line)
        if fm:
            cur.frames.append({"file": fm.group("file"), "line": int(fm.group("line")), "func": fm.group("func")})
            continue
        if line.startswith((" ", "\t")) or not line.strip():
            code = line.strip()
            if cur.frames and code and "code" not in cur.frames[-1] and set(code) - set("^~ "):
                cur.frames[-1]["code"] = code
            continue
        em = _EXC.match(line.strip())
        if em and cur.frames:
            cur.exc_type = em.group("type").rsplit(".", 1)[-1]
            cur.message = (em.group("msg") or "").strip()
            out.append(cur)
            cur = None
    return out
