"""The vLLM side of the vLLM target: one `vllm.LLM` in a process of its own.

Run as a script by `fuzz.targets.vllm.runner.VLLMRunner` with the Python that has vLLM
(`python /path/to/worker.py`); it imports only the standard library and vLLM, so that
Python needs nothing of llmfuzz. Keeping vLLM in a child process means a crash, a hang or a
leaked engine-core process is contained: the parent kills the process group it started and
starts a fresh one.

Protocol: one JSON object per line. stdin: commands. The original stdout: replies (fd 1 is
re-pointed at stderr before vLLM is imported, so vLLM's own logging, and that of the
engine-core and worker processes it spawns, goes to the log the parent reads crash
tracebacks from).

    argv[1] = JSON {"model": DIR, "llm_kwargs": {...}, "env": {...}}, or argv[1] = "--warm":
    vLLM is imported first and the spec is the first line of stdin (a pre-imported spare
    worker: the runner starts the next config's worker while the current one is fuzzed, so
    the ~7-16 s import of vLLM is off the critical path)
    -> {"event": "ready", "startup_s": S, "import_s": S, "warmup_s": S, "vllm_version": V, "vllm_file": F}
       or   {"event": "error", ...}   (startup_s includes the warm-up: a generate with logprobs and
       prompt logprobs that compiles vLLM's lazily compiled kernels before the first Case)
    {"cmd": "run", "requests": [{"id", "prompt_token_ids", "max_tokens", "arrival_step", "abort_step"?,
                                 "cache_salt"?, "sampling"?: {SamplingParams field: value}}],
     "logprobs": K, "prompt_logprobs": K or null}
    -> {"event": "result", "seconds": S, "steps": N,
        "results": {id: {"token_ids": [...], "logprobs": [[[tok, logprob], ...], ...],
                         "num_cached_tokens": N,   (prompt tokens the prefix cache served)
                         "prompt_logprobs": [...]}},   (prompt tokens 1.., when asked for)
        "drafts": {id: [[n, k, [draft...]], ...]},   (n-gram drafts, with LLMFUZZ_VLLM_DRAFTS)
        "aborted": {id: step},   (requests aborted before that driver step, still unfinished then)
        "free_blocks": [before, after]}   (the KV pool's free blocks around the run; null if unknown)
    while running: {"event": "progress", "step": N, "step_s": S} after every step, with its
    seconds (the runner's watchdog: no progress for a while is a hang candidate, and every
    process's stack is dumped; the slowest step seen sets how long "a while" is)
    {"cmd": "exit"}

A request with `arrival_step` a > 0 is added just before the driver's (a+1)-th call of
`LLMEngine.step()` (a driver step is one engine-core output), so requests arrive while
others run, as in the reference engine's driver; one with `abort_step` b is aborted
(`LLMEngine.abort_request`) just before the (b+1)-th call, after that step's arrivals, unless
it has finished. An exception in `run` is replied with its
traceback and the process exits: the engine's state is unknown after it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _error(exc: BaseException) -> dict:
    frames = [{"file": f.filename, "line": f.lineno, "func": f.name}
              for f in traceback.extract_tb(exc.__traceback__)]
    cause = exc.__cause__ or exc.__context__
    out = {"event": "error", "type": type(exc).__name__, "module": type(exc).__module__,
           "message": str(exc)[:2000], "frames": frames,
           "traceback": "".join(traceback.format_exception(exc))[-20000:]}
    if cause is not None:
        out["cause"] = {"type": type(cause).__name__, "message": str(cause)[:2000],
                        "frames": [{"file": f.filename, "line": f.lineno, "func": f.name}
                                   for f in traceback.extract_tb(cause.__traceback__)]}
    return out


def _positions(logprobs) -> list:
    out = []
    for pos in logprobs or []:
        if pos is None:
            out.append([])
            continue
        items = sorted(((int(t), float(lp.logprob)) for t, lp in pos.items()), key=lambda p: -p[1])
        out.append([[t, lp] for t, lp in items])
    return out


def _drafts_since(offsets: dict) -> dict:
    """The n-gram drafts the model runner(s) recorded since `offsets` (site/sitecustomize.py),
    by request id as given to add_request (vLLM appends '-<8 random chars>' internally); a
    draft recorded by several tp ranks is kept once."""
    d = os.environ.get("LLMFUZZ_VLLM_DRAFTS")
    out: dict = {}
    if not d or not os.path.isdir(d):
        return out
    seen = set()
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        with open(path) as f:
            f.seek(offsets.get(path, 0))
            data = f.read()
        offsets[path] = offsets.get(path, 0) + len(data.encode())
        for line in data.splitlines():
            for rid, n, k, draft in json.loads(line):
                ext = rid.rsplit("-", 1)[0]
                if (ext, n) not in seen:
                    seen.add((ext, n))
                    out.setdefault(ext, []).append([n, k, draft])
    return out


def _draft_offsets() -> dict:
    d = os.environ.get("LLMFUZZ_VLLM_DRAFTS")
    if not d or not os.path.isdir(d):
        return {}
    return {os.path.join(d, n): os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}


def _free_blocks(eng):
    """The KV blocks free in the engine core's pool: asked of the core as a utility call where
    it runs in its own process (site/sitecustomize.py gives EngineCore `llmfuzz_free_blocks`;
    the call is queued behind the aborts sent before it), read directly where it runs in this
    one; None where vLLM keeps the pool elsewhere."""
    client = eng.engine_core
    try:
        if hasattr(client, "call_utility"):
            return int(client.call_utility("llmfuzz_free_blocks"))
        return int(client.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    except (AttributeError, TypeError):
        return None


def _run(llm, cmd: dict, progress=None) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    k = int(cmd.get("logprobs", 5))
    pk = cmd.get("prompt_logprobs")
    pending = sorted(cmd["requests"], key=lambda r: int(r.get("arrival_step", 0)))
    aborts = sorted((int(r["abort_step"]), str(r["id"])) for r in cmd["requests"] if r.get("abort_step") is not None)
    results: dict = {}
    aborted: dict = {}  # request -> the driver step before which it was aborted
    free_before = _free_blocks(eng)
    t0 = time.perf_counter()
    offsets = _draft_offsets()
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and int(pending[0].get("arrival_step", 0)) <= step:
            r = pending.pop(0)
            kw = dict(r.get("sampling") or {"temperature": 0.0})
            if kw.get("logit_bias"):
                kw["logit_bias"] = {int(t): float(b) for t, b in kw["logit_bias"].items()}
            sp = SamplingParams(max_tokens=int(r["max_tokens"]), logprobs=k, ignore_eos=True, detokenize=False,
                                prompt_logprobs=int(pk) if pk is not None else None,
                                output_kind=RequestOutputKind.FINAL_ONLY, **kw)
            prompt = {"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]]}
            if r.get("cache_salt") is not None:
                prompt["cache_salt"] = str(r["cache_salt"])
            eng.add_request(str(r["id"]), prompt, sp)
        while aborts and aborts[0][0] <= step:  # after the step's arrivals, as the reference engine's driver
            rid = aborts.pop(0)[1]
            if rid not in results:
                eng.abort_request([rid])
                aborted[rid] = step
        t_step = time.perf_counter()
        if eng.has_unfinished_requests():
            for out in eng.step():
                c = out.outputs[0]
                results[out.request_id] = {"token_ids": [int(t) for t in c.token_ids],
                                           "logprobs": _positions(c.logprobs),
                                           "num_cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0)}
                if pk is not None:  # position 0 is None (nothing precedes the first token)
                    results[out.request_id]["prompt_logprobs"] = _positions((out.prompt_logprobs or [None])[1:])
        step += 1
        if progress is not None:
            progress(step, time.perf_counter() - t_step)
    return {"event": "result", "seconds": time.perf_counter() - t0, "steps": step, "results": results,
            "drafts": _drafts_since(offsets), "aborted": aborted,
            "free_blocks": [free_before, _free_blocks(eng)]}


# The warm-up's requests: two prompt lengths, so that vLLM's compiled logprob-rank kernel
# (torch.compile'd `batched_count_greater_than`) sees two shapes in the one step (sampled rows,
# prompt rows) and is compiled for dynamic shapes before the first Case. One step only
# (max_tokens 1): a planted `hang_schedule:N` still lands in the Case's run. Prompts shorter
# than any block: nothing enters the prefix cache.
WARMUP = [{"id": "llmfuzz-warmup-0", "prompt_token_ids": [1, 2, 3], "max_tokens": 1},
          {"id": "llmfuzz-warmup-1", "prompt_token_ids": [1, 2, 3, 4, 5], "max_tokens": 1}]


def _warm_up(llm) -> float:
    """The engine's first generate, with logprobs and prompt logprobs, before it is reported
    ready: vLLM compiles some kernels on their first call (torch.compile, e.g. the sampler's
    logprob ranks), which on a cold compile cache and a busy machine outlasted the runner's
    no-progress watchdog in the first Case. Run here, its time is start-up time (the runner's
    watchdog then scales with it) and a pre-started spare pays it off the critical path. The
    same request path as a Case (`_run`), so what is compiled is what the Cases call."""
    t0 = time.perf_counter()
    _run(llm, {"requests": WARMUP, "logprobs": 5, "prompt_logprobs": 5})
    return time.perf_counter() - t0


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints and logs (and its children's) go to the log, not the protocol
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    warm = sys.argv[1] == "--warm"
    t0 = time.perf_counter()
    try:
        if warm:  # import now, wait for the config: the import is paid before it is needed
            import vllm  # noqa: F401
            import vllm.entrypoints.llm  # noqa: F401
        import_s = time.perf_counter() - t0
        spec = json.loads(sys.stdin.readline() if warm else sys.argv[1])
        t0 = time.perf_counter()
        os.environ.update(spec.get("env") or {})  # vllm.envs reads the environment when asked
        import vllm
        from vllm import LLM

        llm = LLM(model=spec["model"], **spec["llm_kwargs"])
        warmup_s = _warm_up(llm)
    except BaseException as e:  # noqa: BLE001 - every start-up failure is reported
        reply(_error(e))
        return 3
    # vllm_file: which vLLM tree this process imported (llmfuzz mutate checks it is the mutant's copy).
    # ready_at: the wall clock, so that a start run ahead is timed to when it was up, not to
    # when the campaign came to read it.
    reply({"event": "ready", "startup_s": time.perf_counter() - t0, "import_s": import_s, "warmup_s": warmup_s,
           "ready_at": time.time(), "vllm_version": vllm.__version__, "vllm_file": vllm.__file__})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        try:
            reply(_run(llm, cmd, lambda step, s: reply({"event": "progress", "step": step, "step_s": round(s, 3)})))
        except BaseException as e:  # noqa: BLE001 - a crash is a finding; report it and stop
            reply(_error(e))
            return 3
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    sys.exit(main())
