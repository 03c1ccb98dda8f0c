"""Runs Cases on a real vLLM: the same Cases as our reference engine, through `vllm.LLM`.

How it runs
-----------
`VLLMRunner` keeps ONE `vllm.LLM` alive across Cases (a run of a few requests costs well
under a second), in a child process (`worker.py`, run by the Python that has vLLM:
`LLMFUZZ_VLLM_PYTHON`, else this one), with vLLM's engine core in that same process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: one process fewer to spawn and import vLLM into), or in
its own where the config says so (`VLLMOptions.engine_core_process`, as vLLM serves). A
Case whose vLLM config differs from the live engine's shuts it down and starts another in
the SPARE worker, which imported vLLM while the previous config was fuzzed, or has been
starting that config's engine since a campaign named it as the next (`prestart`): then two
engines are up for a while, one serving, one starting. Each start is recorded in `starts`.
A crash (an exception out of `LLMEngine.step`, a dead worker process) kills the child's
process group and raises `TargetFailure` keyed by its signature: exception type +
innermost vLLM frame of the *root* traceback (the first ERROR-level traceback vLLM's
processes logged during the run, e.g. the PP worker's AssertionError, rather than the
engine client's generic EngineDeadError). A stall (no step's progress for `watchdog_s`,
scaled by the steps and start-up this machine measured: fuzz.targets.vllm.watchdog) first
has every process of the group dump its stacks: a compiler on the stack is waited for; otherwise the
run is re-run on a fresh engine with a longer watchdog, and only a second stall is a hang,
keyed by the stuck frame (fuzz.targets.vllm.stacks). The next Case starts a fresh engine.
Every run's reported prefix-cache hits are judged against the harness's own model of the
engine's cache (fuzz.targets.vllm.prefix; `last_prefix`).

What a process starts with (config -> `vllm.LLM` arguments, environment, checkpoint):
`fuzz.targets.vllm.launch`. The properties checked on a run and the tolerance:
`fuzz.targets.vllm.checker`.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from fuzz.cases.case import Case, RequestSpec
from fuzz.targets.blackbox import engine_items
from fuzz.targets.runs import (RequestResult, TargetFailure, TargetRun, package_path, parse_tracebacks,
                               signature)
from fuzz.targets.vllm import launch
from fuzz.targets.vllm.configs import VLLM_MODEL, VLLMOptions, cell_name
from fuzz.targets.vllm.launch import checkpoint_dir, engine_env, llm_kwargs, worker_env
from fuzz.targets.vllm.process import _Worker, answered, dump_stacks, kill_group, read_reply, stop_worker
from fuzz.targets.vllm.stacks import vllm_frames
from fuzz.targets.vllm.watchdog import RERUN_K, await_reply, watchdog_s


def start_kind(cfg: EngineConfig, opts: VLLMOptions) -> tuple[int, bool, bool]:
    """What an engine start's cost depends on: workers, compiled, the core in its own process."""
    return cfg.world_size, cfg.cudagraph_mode != "NONE", opts.engine_core_process


@dataclass
class EngineStats:
    """One config's engines: how often one started and the seconds that took, the runs they
    served (more runs than starts: an engine reused across Cases), and how many ended in a
    failure (a runner that saw none removes its own log directory)."""

    starts: int = 0
    startup_s: float = 0.0
    runs: int = 0
    failures: int = 0


class VLLMRunner:
    """One live vLLM engine serving at a time, reused across Cases with the same config, and
    one spare worker with vLLM already imported, waiting for the next config or starting it
    (`prestart`).

    Time bounds: start-up `startup_timeout_s`; a run `run_timeout_s` + per token, and
    `watchdog_s` without a step's progress (the worker reports every step; `hang_s` is the
    watchdog's floor, fuzz.targets.vllm.watchdog): then every process of the group dumps its stacks
    (SIGUSR1, faulthandler). A stack in a compiler (fuzz.targets.vllm.stacks.compiling) is a
    compile, not a hang: the watchdog waits again, within the run's bound (`compile_waits`).
    Otherwise the run is re-run on a fresh engine with RERUN_K x the watchdog, and only a
    second stall is a hang, named by the stuck frame; a re-run that finishes is a slow step
    (`slow_steps`). `deadline` (time.monotonic(), set by the campaign): no start or run goes
    past it. A stop (SIGINT/SIGTERM: fuzz.stop) kills the group at once."""

    def __init__(self, *, python: str | None = None, top_k: int = 5, startup_timeout_s: float = 300.0,
                 run_timeout_s: float = 180.0, run_timeout_per_token_s: float = 1.0, hang_s: float = 40.0,
                 log_dir: str | None = None, spare: bool = True) -> None:
        # vllm_python and WORKER are looked up on their module, so either can be pointed elsewhere.
        self.python = python or launch.vllm_python()
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
        self.vllm_files: set = set()  # the vllm/__init__.py each started engine imported (llmfuzz mutate)
        self.deadline: float | None = None
        self.last_drafts: dict = {}  # the last run's n-gram drafts, by request (worker.py)
        # The last run's prefix-cache judgement (fuzz.targets.vllm.prefix.EngineCache.judge).
        self.last_prefix = None
        # Runs that stalled past the watchdog and then finished on a fresh engine (not hangs),
        # and watchdog expiries spent waiting for a compiler: each a dict with its cell.
        self.slow_steps: list[dict] = []
        self.compile_waits: list[dict] = []
        self._w: _Worker | None = None
        self._spare: _Worker | None = None
        self._retiring: list[tuple[threading.Thread, _Worker]] = []  # engines left behind, exiting
        self._n_logs = 0

    # -- engine lifecycle -------------------------------------------------------------------
    # The black-box runner protocol (fuzz.targets.blackbox): run, engine_key, close.
    supports_sampling = True  # launch.request_payload: vLLM's own SamplingParams, ignore_eos
    supports_aborts = True  # worker.py aborts a request before a driver step
    supports_prompt_logprobs = True

    def engine_key(self, case: Case) -> str:
        return self.config_key(case.config, VLLMOptions.of(case))

    @staticmethod
    def config_key(cfg: EngineConfig, opts: VLLMOptions) -> str:
        return json.dumps({"model": checkpoint_dir(cfg), "kw": llm_kwargs(cfg, opts), "env": engine_env(cfg, opts)},
                          sort_keys=True)

    def _spawn(self, tag: str) -> _Worker:
        """A worker that imports vLLM and waits for its config (`--warm`)."""
        self._n_logs += 1
        log_path = os.path.join(self.log_dir, f"{self._n_logs:03d}-{tag}.log")
        env = worker_env(VLLM_MODEL)
        env.update(LLMFUZZ_VLLM_STACKS=self.stacks_dir, LLMFUZZ_VLLM_DRAFTS=self.drafts_dir)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([self.python, launch.WORKER, "--warm"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        return _Worker(proc, "", tag, log_path, spawned=time.monotonic())

    def _cap(self, timeout: float) -> float:
        return timeout if self.deadline is None else max(0.0, min(timeout, self.deadline - time.monotonic()))

    @staticmethod
    def _send_config(w: _Worker, cfg: EngineConfig, opts: VLLMOptions) -> None:
        """Give a waiting worker its config: from now on it starts that engine (OSError if it died)."""
        spec = json.dumps({"model": checkpoint_dir(cfg), "llm_kwargs": llm_kwargs(cfg, opts),
                           "env": engine_env(cfg, opts)})
        w.key, w.cell = VLLMRunner.config_key(cfg, opts), cell_name(cfg, opts)
        w.proc.stdin.write((spec + "\n").encode())
        w.proc.stdin.flush()
        w.sent, w.sent_at = time.perf_counter(), time.time()

    def prestart(self, cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> bool:
        """Start the engine for (cfg, opts) in the spare worker now, while the live engine
        serves, so that the campaign does not wait for it when it moves on to that config: its
        `ensure` then waits only for what is left of the start. False when there is nothing to do
        (that engine is live, or the spare already starts one); the spare is spawned if missing."""
        if self.is_live(cfg, opts) or (self._spare is not None and self._spare.sent):
            return False
        if self._spare is None or self._spare.proc.poll() is not None:
            if self._spare is not None:
                self._kill(self._spare)
            self._spare = self._spawn(cell_name(cfg, opts))
        try:
            self._send_config(self._spare, cfg, opts)
        except OSError:  # it died: the next start spawns another
            self._kill(self._spare)
            self._spare = None
            return False
        return True

    def prestarted_s(self, cfg: EngineConfig, opts: VLLMOptions) -> float | None:
        """Seconds the spare has been starting the engine for (cfg, opts) (None: it is not)."""
        w = self._spare
        if w is None or not w.sent or w.key != self.config_key(cfg, opts) or w.proc.poll() is not None:
            return None
        return time.perf_counter() - w.sent

    def still_starting(self, cfg: EngineConfig, opts: VLLMOptions) -> bool:
        """Whether the spare is pre-starting the engine for (cfg, opts) and has not answered
        yet (up or failed), within the start-up bound (past it, `ensure` names the hang)."""
        ahead = self.prestarted_s(cfg, opts)
        return ahead is not None and ahead < self.startup_timeout_s and not answered(self._spare)

    def _start(self, cfg: EngineConfig, opts: VLLMOptions) -> _Worker:
        """The engine for (cfg, opts): the spare's, already starting it (`prestart`) or waiting
        for a config; a fresh worker where the spare starts another config (kept for that one)."""
        key = self.config_key(cfg, opts)
        cell = cell_name(cfg, opts)
        st = self.stats.setdefault(cell, EngineStats())
        w, self._spare = self._spare, None
        if w is not None and w.sent and w.key != key:  # pre-started for another config: keep it for that
            self._spare, w = w, None
        # A worker given this config ahead is read even if it died: its reply says why.
        warm = w is not None and (bool(w.sent) or w.proc.poll() is None)
        if not warm:
            if w is not None:
                self._kill(w)
            w = self._spawn(cell)
        ahead = 0.0 if not w.sent else time.perf_counter() - w.sent  # started ahead, while another served
        t0 = time.perf_counter()
        st.starts += 1
        try:
            if not w.sent:
                self._send_config(w, cfg, opts)
            timeout = self._cap(max(1.0, self.startup_timeout_s - ahead))
            # A start sitting in a compiler at its bound gets the bound once more.
            reply, _ = self._await(w, timeout, None, extend_s=self._cap(self.startup_timeout_s))
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        except BaseException:  # a stop raised mid-start (fuzz.stop): the engine starting goes too
            self._kill(w)
            raise
        wall = time.perf_counter() - t0
        # Every start is recorded, failed ones too: their time is start-up time as well, and
        # the campaign's and the shrinker's estimates of what a start costs come from here.
        # `seconds`: what the campaign waited; `ahead_s`: how long before that it was sent;
        # `full_s`: how long the start took, config sent to engine up. A start run ahead is
        # often up long before the campaign reads it, so `full_s` is timed by the worker's
        # `ready_at` (counting `ahead_s` + `seconds` made every start as long as the cell before
        # it, ~70 s for a 4 s start under load, and the estimates with it).
        full = ahead + wall
        if reply and reply.get("ready_at") and w.sent_at:
            full = min(full, max(0.0, float(reply["ready_at"]) - w.sent_at))
        self.starts.append({"cell": cell, "seconds": round(wall, 1), "warm": warm, "kind": list(start_kind(cfg, opts)),
                            "ahead_s": round(ahead, 1), "full_s": round(full, 1),
                            "import_s": round(float((reply or {}).get("import_s", 0.0)), 1),
                            "init_s": round(float((reply or {}).get("startup_s", 0.0)), 1),
                            "warmup_s": round(float((reply or {}).get("warmup_s", 0.0)), 1),
                            "ok": bool(reply and reply.get("event") == "ready")})
        st.startup_s += wall
        if self.spare and self._spare is None and (self.deadline is None or time.monotonic() < self.deadline):
            self._spare = self._spawn("spare")  # imports vLLM while this engine is fuzzed (or the next starts)
        if reply is None:
            st.failures += 1
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._kill(w)
                raise TargetFailure("deadline", "deadline", "the campaign's time ran out during start-up", w.log_path)
            raise self._hang("startup", w, f"no reply within {ahead + timeout:.0f}s of start-up", "hang@startup")
        if reply.get("event") != "ready":
            raise self._ended("startup", w, st, reply, 0)
        w.start_s = full
        self.vllm_version = reply.get("vllm_version")
        self.vllm_files.add(reply.get("vllm_file"))
        return w

    def ensure(self, cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> None:
        key = self.config_key(cfg, opts)
        if self._w is not None and (self._w.key != key or self._w.proc.poll() is not None):
            self.shutdown(wait=False)
        if self._w is None:
            self._w = self._start(cfg, opts)

    def is_live(self, cfg: EngineConfig, opts: VLLMOptions) -> bool:
        return self._w is not None and self._w.key == self.config_key(cfg, opts) and self._w.proc.poll() is None

    def shutdown(self, wait: bool = True) -> None:
        """Stop the live engine: asked to exit, killed (its whole group) after 5 s. With
        `wait=False` (a move to another config) that happens in a thread: vLLM's shut-down
        takes 3-5 s, which the next engine spends serving (`close` waits for it)."""
        w, self._w = self._w, None
        if w is None:
            return
        if wait:
            stop_worker(w, self._kill)
            return
        t = threading.Thread(target=stop_worker, args=(w, self._kill), name=f"llmfuzz-stop-{w.cell}", daemon=True)
        t.start()
        self._retiring = [(x, y) for x, y in self._retiring if x.is_alive()] + [(t, w)]

    def kill_all(self) -> None:
        """SIGKILL every process group this runner started, now (a stop)."""
        for w in (self._w, self._spare, *(w for _, w in self._retiring)):
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
        for t, _ in self._retiring:
            t.join()
        self._retiring = []
        if self._own_log_dir and not any(s.failures for s in self.stats.values()):
            import shutil

            shutil.rmtree(self.log_dir, ignore_errors=True)

    # -- I/O ---------------------------------------------------------------------------------
    _kill = staticmethod(kill_group)

    def _read(self, w: _Worker, timeout: float, idle: float | None = None) -> dict | None:
        """The next reply other than progress (fuzz.targets.vllm.process.read_reply), keeping
        the worker's slowest step; a stop kills this runner's every process group first."""
        def progress(msg: dict) -> None:
            w.slowest_step_s = max(w.slowest_step_s, float(msg.get("step_s") or 0.0))

        return read_reply(w, timeout, idle, on_stop=self.kill_all, on_progress=progress)

    def watchdog_s(self, w: _Worker) -> float:
        """Seconds without a step's progress before a run is a hang candidate
        (fuzz.targets.vllm.watchdog: max(hang_s, STEP_K x slowest step, START_K x start-up))."""
        return watchdog_s(self.hang_s, w)

    def _await(self, w: _Worker, timeout: float, idle: float | None,
               extend_s: float = 0.0) -> tuple[dict | None, dict[int, str] | None]:
        """fuzz.targets.vllm.watchdog.await_reply on this runner's reads, dumps and deadline."""
        return await_reply(w, self._read, self.dump_stacks, timeout, idle, extend_s, self.deadline, self.compile_waits)

    def dump_stacks(self, w: _Worker, wait_s: float = 2.0) -> dict[int, str]:
        return dump_stacks(w, self.stacks_dir, wait_s)

    def _hang(self, kind: str, w: _Worker, detail: str, fallback: str, log_offset: int = 0,
              dumps: dict[int, str] | None = None) -> TargetFailure:
        """No progress: every process's stacks (`dumps`, else dumped now), and kill. A worker
        that raised before the engine stalled (its ERROR traceback in the log) names the hang,
        as its crash would: the stuck frame is then only a generic wait. Otherwise the stuck
        frame names it."""
        from fuzz.targets.vllm.stacks import describe, hang_signature

        if dumps is None:
            dumps = self.dump_stacks(w)
        self._kill(w)
        stuck = f"stuck: {describe(dumps)}"
        root = self._root_traceback(self._log_since(w, log_offset))
        if root is not None:
            sig, raised = root
            return TargetFailure(kind, sig, f"{detail}; after {raised}; {stuck}"[:800], w.log_path)
        return TargetFailure(kind, hang_signature(dumps, fallback), f"{detail}; {stuck}"[:600], w.log_path)

    def _ended(self, kind: str, w: _Worker, st: EngineStats, reply: dict, log_offset: int) -> TargetFailure:
        """The worker answered with an error or died instead of the expected event: let a dying
        process finish (its last log lines name the crash), end the group, count the failure."""
        if reply.get("event") == "died":
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._kill(w)
        st.failures += 1
        return self._failure(kind, w, reply if reply.get("event") == "error" else None, log_offset)

    def _failure(self, kind: str, w: _Worker, reply: dict | None, log_offset: int) -> TargetFailure:
        """Signature from the root traceback in the log since `log_offset`, else the reply's."""
        log = self._log_since(w, log_offset)
        root = self._root_traceback(log)
        client = None
        if reply is not None and reply.get("event") == "error":
            client = signature(reply["type"], vllm_frames(reply.get("frames", [])), "vllm")
        if root is not None:
            sig, detail = root
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

    @staticmethod
    def _log_since(w: _Worker, log_offset: int) -> str:
        try:
            with open(w.log_path, "rb") as f:
                f.seek(log_offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    @staticmethod
    def _root_traceback(log: str) -> tuple[str, str] | None:
        """(signature, what was raised where) of the first error traceback through vLLM's code
        in `log`, or None."""
        roots = [tb for tb in parse_tracebacks(log)
                 if tb.level not in ("INFO", "WARNING", "DEBUG")
                 and any(package_path(fr["file"], "vllm") for fr in vllm_frames(tb.frames))]
        if not roots:
            return None
        r = roots[0]
        last = r.frames[-1]
        where = f"{os.path.basename(last['file'])}:{last['line']}" + (f" `{last['code']}`" if last.get("code") else "")
        detail = f"{r.process or 'vLLM'}: {r.exc_type}" + (f": {r.message}" if r.message else "") + f" at {where}"
        return signature(r.exc_type, vllm_frames(r.frames), "vllm"), detail[:400]

    # -- running ------------------------------------------------------------------------------
    def run(self, case: Case, items: list[tuple[str, RequestSpec]] | None = None, prompt_logprobs: bool = False,
            opts: VLLMOptions | None = None) -> TargetRun:
        """Run the Case's workload (or `items`, (request id, spec) pairs) on the engine for
        its config and options (`opts`, else the Case's), with top-k prompt logprobs if asked;
        raise TargetFailure on a crash, a hang or a failed start."""
        if items is None:  # the engine's requests: n > 1 as its children, as the reference runs them
            items = engine_items(case)
        opts = VLLMOptions.of(case) if opts is None else opts
        requests = [launch.request_payload(rid, r) for rid, r in items]  # refused before any engine starts
        self.ensure(case.config, opts)
        w = self._w
        st = self.stats[w.cell]
        tokens = sum(len(r.prompt_token_ids) + r.max_tokens for _, r in items)
        timeout = self._cap(self.run_timeout_s + self.run_timeout_per_token_s * tokens)
        cmd = {"cmd": "run", "logprobs": self.top_k, "prompt_logprobs": self.top_k if prompt_logprobs else None,
               "requests": requests}
        watchdog = self.watchdog_s(w)
        reply, log_offset = self._send_run(w, cmd, timeout, watchdog)
        st.runs += 1
        if reply is None:
            reply, w, log_offset = self._confirm_hang(case, opts, cmd, w, st, timeout, watchdog, log_offset)
        if reply.get("event") != "result":
            self._w = None
            raise self._ended("crash", w, st, reply, log_offset)
        results = {}
        for rid, r in reply["results"].items():
            results[rid] = RequestResult(
                tuple(r["token_ids"]), tuple(tuple((int(t), float(lp)) for t, lp in pos) for pos in r["logprobs"]),
                tuple(tuple((int(t), float(lp)) for t, lp in pos) for pos in r.get("prompt_logprobs") or ()),
                int(r.get("num_cached_tokens") or 0))
        fb = reply.get("free_blocks") or (None, None)
        run = TargetRun(results, float(reply["seconds"]), int(reply["steps"]), dict(reply.get("aborted") or {}),
                        (fb[0], fb[1]))
        self.last_drafts = reply.get("drafts") or {}
        self.last_prefix = self._cache(w, case.config, opts).judge(items, run, prompt_logprobs)
        return run

    @staticmethod
    def _cache(w: _Worker, cfg: EngineConfig, opts: VLLMOptions):
        """The worker's engine's prefix-cache ledger, made at its first run."""
        from fuzz.targets.vllm.prefix import EngineCache

        if w.cache is None:
            w.cache = EngineCache(cfg.block_size, opts.enable_prefix_caching,
                                  cfg.num_speculative_tokens if cfg.speculative_method != "none" else 0)
        return w.cache

    def _send_run(self, w: _Worker, cmd: dict, timeout: float, watchdog: float) -> tuple[dict | None, int]:
        """Send a run to the worker and await its reply with the watchdog: (reply or None on a
        stall, the worker's log offset before the run). A dead worker is a `died` reply; a
        stop raised meanwhile kills it."""
        log_offset = os.path.getsize(w.log_path)
        try:
            w.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            w.proc.stdin.flush()
            reply, w.stall_dumps = self._await(w, timeout, watchdog)
        except (EOFError, BrokenPipeError, OSError):
            reply = {"event": "died"}
        except BaseException:  # a stop raised mid-run (fuzz.stop): its engine is in an unknown state
            self._w = None
            self._kill(w)
            raise
        return reply, log_offset

    def _confirm_hang(self, case: Case, opts: VLLMOptions, cmd: dict, w: _Worker, st: EngineStats, timeout: float,
                      watchdog: float, log_offset: int) -> tuple[dict, _Worker, int]:
        """A run stalled past the watchdog: not a hang yet. Unless the worker's log already
        shows a raised exception (the engine is broken, not slow: reported at once), the same
        run goes to a fresh engine with RERUN_K x the watchdog (capped by the run's bound): a
        second stall is the hang, named by its stuck frame; a reply is returned as the run's,
        and the stall recorded in `slow_steps`."""
        self._w = None
        dumps = getattr(w, "stall_dumps", None)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            st.failures += 1
            self._kill(w)
            raise TargetFailure("deadline", "deadline", "the campaign's time ran out during a run", w.log_path)
        first = self._hang("hang", w, f"no progress for {min(watchdog, timeout):.0f}s", "hang@run", log_offset, dumps)
        if self._root_traceback(self._log_since(w, log_offset)) is not None:
            st.failures += 1
            raise first
        rerun = min(RERUN_K * watchdog, timeout)
        self.ensure(case.config, opts)
        w2 = self._w
        reply, offset2 = self._send_run(w2, cmd, timeout, rerun)
        if reply is None:
            self._w = None
            st.failures += 1
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._kill(w2)
                raise TargetFailure("deadline", "deadline", "the campaign's time ran out during a run", w2.log_path)
            raise self._hang("hang", w2, f"no progress for {rerun:.0f}s on a fresh engine, after {watchdog:.0f}s "
                             f"on the first (first {first.signature})", "hang@run", offset2,
                             getattr(w2, "stall_dumps", None))
        self.slow_steps.append({"cell": w.cell, "watchdog_s": round(watchdog, 1), "rerun_watchdog_s": round(rerun, 1),
                                "first": first.signature, "rerun_event": reply.get("event")})
        return reply, w2, offset2
