"""Runs Cases on transformers' continuous batching (`model.init_continuous_batching`: paged KV
cache, chunked prefill, its scheduler and background thread) as a black box.

`CBRunner` keeps one worker process (`worker.py`, this Python) at a time: the model loaded
with the config's attention implementation, dtype and device (`configs.process_spec`), told
the ContinuousBatchingConfig its runs use (`configs.cb_config`) whenever it changes (the
library checks it then; no restart). Each run builds a fresh manager
in the worker, adds the requests (arrivals while others run: `tap.Arrivals`) and returns a
`fuzz.targets.runs.TargetRun` with top-k logprobs per generated token (`tap.LogitsTap`).
Prompt logprobs: the library has none; `prompt_logprobs=True` returns none (an oracle
asking for them gets empty tuples; `supports_prompt_logprobs` is False). Sampling: greedy
only (`supports_sampling` False).

Failures (`fuzz.targets.runs.TargetFailure`), each ending the worker:
- "startup": the library refused the config or failed to load it (`unsupported` tells a
  refusal by its config checks from a crash);
- "crash": the background thread died (its fatal error), a request failed or was lost
  (signature: exception type + innermost transformers frame of the logged traceback); on
  the CPU a run the library failed cleanly (its thread stopped, nothing left behind) keeps
  the worker, anything else ends it;
- "hang": no batch finished for `hang_s` (every thread's stack is dumped into the log,
  faulthandler on SIGUSR1, and the stuck frame named);
- "leak": after the manager was stopped and destroyed, its thread still runs, its KV cache
  is still referenced, or CUDA memory is above what it was before the run;
- "inconsistent": the tokens the library returned are not those its sampler produced
  at the tapped positions (or the tap saw another number of positions).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from fuzz.cases.case import Case, RequestSpec
from fuzz.targets.base import Unsupported
from fuzz.targets.runs import RequestResult, TargetFailure, TargetRun, adapter_error, request_items, signature
from fuzz.targets.transformers_cb.configs import CBOptions, cb_config, cell_name, process_spec
from fuzz.targets.checkpoint import checkpoint_dir
from fuzz.targets.vllm.process import _Worker, kill_group, read_reply, stop_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
STACKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm", "site")
# What the library raises when its config checks refuse a combination (at manager creation
# or when its batch processor is built): an unsupported config, not a crash.
REFUSALS = ("ValueError", "NotImplementedError", "ImportError")


def unsupported(f: TargetFailure) -> bool:
    """A start-up refused by the library's checks: a ValueError / NotImplementedError /
    ImportError (a kernel package missing) from transformers, or a RuntimeError raised by a
    constructor of its continuous batching (async batching without CUDA)."""
    if f.kind != "startup":
        return False
    typ, _, where = f.signature.partition("@")
    if typ in REFUSALS:
        return where.startswith("transformers/")
    return typ == "RuntimeError" and where.startswith("transformers/generation/continuous_batching/") \
        and where.endswith(":__init__")


class CBRunner:
    """One worker per engine key at a time. `hang_s`: seconds without a finished batch;
    `run_timeout_s` + per token: a whole run; `startup_timeout_s`: loading and the config
    checks. `deadline` (time.monotonic()): no start or run goes past it. A runner of the
    black-box protocol (fuzz.targets.blackbox): greedy only, no prompt logprobs."""

    supports_sampling = False
    supports_prompt_logprobs = False

    def __init__(self, *, top_k: int = 5, hang_s: float = 30.0, run_timeout_s: float = 120.0,
                 run_timeout_per_token_s: float = 0.5, startup_timeout_s: float = 120.0,
                 log_dir: str | None = None) -> None:
        self.top_k, self.hang_s = top_k, hang_s
        self.run_timeout_s, self.run_timeout_per_token_s = run_timeout_s, run_timeout_per_token_s
        self.startup_timeout_s = startup_timeout_s
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="llmfuzz-tcb-logs-")
        self.stacks_dir = os.path.join(self.log_dir, "stacks")
        os.makedirs(self.stacks_dir, exist_ok=True)
        self.deadline: float | None = None
        self.version: str | None = None
        self.starts: list[dict] = []
        self.failures = 0
        self.last_run: dict = {}  # the last result reply's extras: own_logprobs, memory
        self._w: _Worker | None = None
        self._cb: dict | None = None  # the config the worker last checked
        self._n_logs = 0

    # -- engine lifecycle -------------------------------------------------------------------
    @staticmethod
    def process_key(case: Case) -> str:
        return json.dumps(process_spec(case.config, CBOptions.of(case), checkpoint_dir(case.config)), sort_keys=True)

    @classmethod
    def engine_key(cls, case: Case) -> str:
        """The model as loaded and the continuous-batching config (a solo-run cache's key)."""
        return cls.process_key(case) + json.dumps(cb_config(case.config, CBOptions.of(case)), sort_keys=True)

    def _cap(self, timeout: float) -> float:
        return timeout if self.deadline is None else max(0.0, min(timeout, self.deadline - time.monotonic()))

    def _spawn(self, tag: str) -> _Worker:
        self._n_logs += 1
        log_path = os.path.join(self.log_dir, f"{self._n_logs:03d}-{tag.replace('|', '_')}.log")
        # PYTHONFAULTHANDLER: a native death (SIGABRT, SIGSEGV) dumps every thread into the log,
        # which names it (stacks.death_signature).
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   LLMFUZZ_VLLM_STACKS=self.stacks_dir,
                   PYTHONPATH=os.pathsep.join([STACKS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=env, start_new_session=True)
        return _Worker(proc, "", tag, log_path, spawned=time.monotonic())

    def ensure(self, case: Case) -> None:
        """A worker with `case`'s model loaded and its continuous-batching config checked;
        TargetFailure("startup") if either fails (`unsupported` says whether the library
        refused the config)."""
        key, cb = self.process_key(case), cb_config(case.config, CBOptions.of(case))
        if self._w is not None and (self._w.key != key or self._w.proc.poll() is not None):
            self.shutdown()
        if self._w is None:
            self._w, self._cb = self._start(case, key), None
        if self._cb != cb:
            self._cb = None
            self._command(self._w, {"cmd": "configure", "cb": cb}, "configured")
            self._cb = cb

    def _start(self, case: Case, key: str) -> _Worker:
        cell = cell_name(case.config, CBOptions.of(case))
        w = self._spawn(cell)
        w.key, w.cell = key, cell
        t0 = time.perf_counter()
        reply = self._command(w, process_spec(case.config, CBOptions.of(case), checkpoint_dir(case.config)), "ready")
        self.starts.append({"cell": cell, "seconds": round(time.perf_counter() - t0, 1)})
        self.version = reply.get("version")
        return w

    def _command(self, w: _Worker, cmd: dict, expect: str) -> dict:
        """Send a start-up line and read its reply; unless the reply is `expect`, TargetFailure
        ("startup") is raised and the worker ended (kept for a config the library refused)."""
        try:
            w.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            w.proc.stdin.flush()
            reply = self._read(w, self._cap(self.startup_timeout_s))
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        if reply is not None and reply.get("event") == expect:
            return reply
        if reply is not None and reply.get("phase") == "configure" and w.proc.poll() is None:
            f = TargetFailure("startup", *self._describe(reply), w.log_path)
            if unsupported(f):
                raise f  # refused before it was used: the worker serves the next config
        if w is self._w:
            self._w = None
        if reply is None:
            raise self._hang("startup", w, "no reply within the start-up bound")
        raise self._failure("startup", w, reply)

    def check_supported(self, case: Case) -> None:
        """Start `case`'s engine; Unsupported with the library's message if it refuses the
        config, or where the start failed before entering the library (fuzz.targets.runs.
        adapter_error): a harness error, not a finding, shown on the config's row."""
        try:
            self.ensure(case)
        except TargetFailure as f:
            if unsupported(f):
                raise Unsupported(f"unsupported by transformers: {f.signature}: {f.detail}") from None
            if (why := adapter_error(f, "transformers")) is not None:
                raise Unsupported(why) from None
            raise

    def shutdown(self) -> None:
        w, self._w, self._cb = self._w, None, None
        if w is not None:
            stop_worker(w)

    def close(self) -> None:
        self.shutdown()
        if self._own_log_dir and not self.failures:
            import shutil

            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- failures ---------------------------------------------------------------------------
    def _read(self, w: _Worker, timeout: float, idle: float | None = None) -> dict | None:
        return read_reply(w, timeout, idle, on_stop=self.shutdown)

    def _hang(self, kind: str, w: _Worker, detail: str) -> TargetFailure:
        from fuzz.targets.vllm.process import dump_stacks
        from fuzz.targets.transformers_cb.stacks import hang_signature

        dumps = dump_stacks(w, self.stacks_dir)
        kill_group(w)
        self.failures += 1
        sig, stuck = hang_signature(dumps, f"hang@{kind}")
        return TargetFailure("hang" if kind == "run" else kind, sig, f"{detail}; stuck: {stuck}"[:600], w.log_path)

    def _failure(self, kind: str, w: _Worker, reply: dict) -> TargetFailure:
        """The worker's error reply (or its death) as a TargetFailure; the worker is ended."""
        if reply.get("event") == "died":
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        kill_group(w)
        self.failures += 1
        if reply.get("event") != "error":
            from fuzz.targets.transformers_cb.stacks import death_signature
            return TargetFailure(kind, *death_signature(self._log(w), w.proc.poll()), w.log_path)
        return TargetFailure(kind, *self._describe(reply), w.log_path)

    @staticmethod
    def _describe(reply: dict) -> tuple[str, str]:
        """(signature, detail) of an error reply: the exception type and innermost transformers frame."""
        sig = signature(reply["type"], reply.get("frames", []), "transformers")
        detail = f"{reply['type']}: {reply.get('message', '')}"
        if reply.get("failed"):
            detail += f"; failed requests: {json.dumps(reply['failed'])[:300]}"
        if reply.get("missing"):
            detail += f"; no output for {reply['missing']}"
        return sig, detail[:800]

    @staticmethod
    def _log(w: _Worker) -> str:
        try:
            with open(w.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace").strip()
        except OSError:  # no log to read: the report says only that the process died
            return ""

    # -- running ----------------------------------------------------------------------------
    def run(self, case: Case, items: list[tuple[str, RequestSpec]] | None = None,
            prompt_logprobs: bool = False) -> TargetRun:
        """The Case's workload (or `items`) on the library; TargetFailure on a crash, a hang,
        a leak, a failed start. Greedy requests only (ValueError otherwise)."""
        items = request_items(case) if items is None else items
        for rid, r in items:
            if r.sampling is not None or r.abort_step is not None:
                raise ValueError(f"request {rid}: the transformers-cb target runs greedy requests without aborts")
        self.ensure(case)
        w = self._w
        tokens = sum(len(r.prompt_token_ids) + r.max_tokens for _, r in items)
        cmd = {"cmd": "run", "top_k": self.top_k,
               "requests": [{"id": rid, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                             "arrival_step": r.arrival_step} for rid, r in items]}
        try:
            w.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            w.proc.stdin.flush()
            reply = self._read(w, self._cap(self.run_timeout_s + self.run_timeout_per_token_s * tokens),
                               idle=self.hang_s)
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        except BaseException:
            self._w = None
            kill_group(w)
            raise
        if reply is None:
            self._w = None
            raise self._hang("run", w, f"no batch finished for {self.hang_s:.0f}s")
        if reply.get("event") == "error" and reply.get("alive") and w.proc.poll() is None:
            self.failures += 1  # the library failed the run; the worker serves the next one
            raise TargetFailure("crash", *self._describe(reply), w.log_path)
        if reply.get("event") != "result":
            self._w = None
            raise self._failure("crash", w, reply)
        return self._result(w, reply)

    def _result(self, w: _Worker, reply: dict) -> TargetRun:
        mem = reply.get("memory") or {}
        leaks = [k for k in ("thread_alive", "cache_alive") if mem.get(k)]
        leaks += [f"{k}={mem[k]}" for k in ("leaked_bytes", "threads_left") if mem.get(k, 0) > 0]
        if leaks:
            self._w = None
            kill_group(w)
            self.failures += 1
            raise TargetFailure("leak", f"leak@transformers:{leaks[0].split('=')[0]}",
                                f"after stop() and destroy(): {', '.join(leaks)}", w.log_path)
        results, own = {}, {}
        for rid, r in reply["results"].items():
            if r["tap_tokens"] != r["token_ids"]:
                self._w = None
                kill_group(w)
                self.failures += 1
                raise TargetFailure("inconsistent", "tokens@transformers:returned_vs_sampled",
                                    f"request {rid}: returned {r['token_ids']}, sampled {r['tap_tokens']}", w.log_path)
            results[rid] = RequestResult(tuple(r["token_ids"]), tuple(tuple((int(t), float(lp)) for t, lp in pos)
                                                                       for pos in r["logprobs"]))
            own[rid] = tuple(r["own_logprobs"])
        self.last_run = {"own_logprobs": own, "memory": mem, "offloads": int(reply.get("offloads", 0))}
        return TargetRun(results, float(reply["seconds"]), int(reply["steps"]))
