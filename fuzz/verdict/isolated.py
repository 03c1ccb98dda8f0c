"""IsolatedHarness: run each Case's check in a worker process the harness can replace.

A fatal CUDA error (an illegal memory access from a bad `cu_seqlens`, a device-side
assert from a poisoned index) poisons the CUDA context for the rest of the process: every
later kernel fails. So on GPU the Harness lives in a child process (`python -m
fuzz.verdict.isolated`), one Case per request over a pipe of JSON lines (never pickle). The child
answers with a verdict or the Violation; after a fatal CUDA error it says so and exits, and
the next check starts a fresh child. A child that dies outright (segfault, SIGKILL, OOM
killer) or does not answer in time becomes a CrashViolation or LivenessViolation of that
Case, so the failure is still reported, shrunk (each shrink step is one more check) and
written as a reproducer.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

from fuzz.cases.case import Case
from fuzz.verdict.harness import Verdict
from fuzz.verdict.properties import CrashViolation, LivenessViolation, LogitsReport, Violation

_FATAL_MARKERS = ("CUDA error", "AcceleratorError", "device-side assert", "illegal memory access")


def is_fatal(message: str) -> bool:
    """The error leaves the CUDA context unusable: the process must not run another Case."""
    return any(m in message for m in _FATAL_MARKERS)


def _violation_class(prop: str) -> type[Violation]:
    stack = [Violation]
    while stack:
        cls = stack.pop()
        if cls.property == prop:
            return cls
        stack.extend(cls.__subclasses__())
    return CrashViolation


class IsolatedHarness:
    """The Harness API (`check`, `close`) with the work done in a replaceable child."""

    def __init__(self, startup_timeout_s: float = 300.0, child: tuple[str, ...] = ("-m", "fuzz.verdict.isolated"),
                 pool_capacity: int = 16, oracles: frozenset[str] = frozenset()) -> None:
        self.oracles = frozenset(oracles)  # of the child's Harness
        self.child = child  # the interpreter's arguments that run `main` (tests wrap it)
        self.pool_capacity = pool_capacity  # of the child's Harness
        self.proc: subprocess.Popen | None = None
        self.startup_timeout_s = startup_timeout_s
        self.starts = 0  # children started (1 + restarts)
        self.fatal_errors = 0

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env["LLMFUZZ_POOL_CAPACITY"] = str(self.pool_capacity)
        env["LLMFUZZ_ORACLES"] = ",".join(sorted(self.oracles))
        self.proc = subprocess.Popen([sys.executable, *self.child], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.starts += 1
        return self.proc

    def _bound(self, case: Case) -> float:
        # Every step has its own timeout inside the child; this bounds the whole Case,
        # generously, including a first engine start and graph captures.
        from fuzz.verdict.runner import max_steps_for
        return 120.0 + case.config.step_timeout_s + 0.5 * max_steps_for(case.workload)

    def check(self, case: Case) -> Verdict:
        case.validate()
        fresh = self.proc is None or self.proc.poll() is not None
        proc = self._start() if fresh else self.proc
        try:
            proc.stdin.write((json.dumps({"case": case.to_dict()}) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # died already: read_reply reports how
        try:
            reply = self._read_reply(proc, self._bound(case) + (self.startup_timeout_s if fresh else 0.0))
        except TimeoutError:
            raise LivenessViolation("worker process gave no answer within its time bound "
                                    "(killed with its process group)", case) from None
        if reply is None:
            raise self._dead(case, proc)
        if "violation" in reply:
            v = reply["violation"]
            if reply.get("fatal"):
                self.fatal_errors += 1
                self._stop(proc)
            e = _violation_class(v["property"])(v["message"], case, v.get("error_ratio"), v.get("oracle"))
            e.second_opinion = v.get("second_opinion")
            raise e
        ok = reply["ok"]
        worst = LogitsReport(ok["oracle"], ok["max_error"], ok["tolerance"], ok["positions"])
        return Verdict(case, worst, {ok["oracle"]: worst}, ok["fa_calls"], ok["steps"], ok["preemptions"],
                       ok["max_in_flight"], ok["seconds"], ok["engine_seconds"],
                       ok.get("prefix_queried_tokens", 0), ok.get("prefix_hit_tokens", 0), ok.get("skipped", {}),
                       ok.get("async_steps", 0))

    def _read_reply(self, proc: subprocess.Popen, timeout_s: float) -> dict | None:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout_s):
                self._stop(proc)
                raise TimeoutError
            line = proc.stdout.readline()
        finally:
            sel.close()
        return json.loads(line) if line else None

    def _dead(self, case: Case, proc: subprocess.Popen) -> Violation:
        rc = proc.wait()
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        self.proc = None
        return CrashViolation(f"worker process died ({how}) while running the Case", case)

    def _stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its torch.distributed ranks too
            except ProcessLookupError:
                pass
        proc.wait()
        self.proc = None

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()  # EOF: the child closes its engines and exits
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._stop(self.proc)


def make_harness(device: str, isolate: str = "auto", pool_capacity: int = 16,
                 oracles: frozenset[str] = frozenset()):
    """The harness a command uses: isolated in a child process on CUDA (or when asked)."""
    from fuzz.verdict.harness import Harness

    if isolate == "on" or (isolate == "auto" and device.startswith("cuda")):
        return IsolatedHarness(pool_capacity=pool_capacity, oracles=oracles)
    return Harness(pool_capacity, oracles)


def main() -> None:
    """Child: one JSON request per line on stdin, one reply per line on the real stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, not into the protocol
    from fuzz.verdict.harness import Harness

    from fuzz.verdict.oracles import parse_oracles

    harness = Harness(int(os.environ.get("LLMFUZZ_POOL_CAPACITY", "16")),
                      parse_oracles(os.environ.get("LLMFUZZ_ORACLES")))
    try:
        for line in sys.stdin:
            case = Case.from_dict(json.loads(line)["case"])
            t0 = time.perf_counter()
            fatal = False
            try:
                v = harness.check(case)
                reply = {"ok": {"oracle": v.logits.oracle, "max_error": v.logits.max_error, "tolerance": v.logits.tolerance,
                                "positions": v.logits.positions, "fa_calls": v.fa_calls_checked,
                                "steps": v.num_steps, "preemptions": v.num_preemptions,
                                "max_in_flight": v.max_in_flight, "seconds": time.perf_counter() - t0,
                                "engine_seconds": v.engine_seconds,
                                "prefix_queried_tokens": v.prefix_queried_tokens,
                                "prefix_hit_tokens": v.prefix_hit_tokens, "skipped": v.skipped,
                                "async_steps": v.async_steps}}
            except Violation as e:
                fatal = is_fatal(e.message)
                reply = {"violation": {"property": e.property, "message": e.message,
                                       "error_ratio": e.error_ratio, "oracle": e.oracle,
                                       "second_opinion": e.second_opinion}, "fatal": fatal}
            out.write(json.dumps(reply) + "\n")
            out.flush()
            if fatal:
                os._exit(0)  # the context is poisoned: shutting engines down would fail too
    finally:
        harness.close()


if __name__ == "__main__":
    main()
