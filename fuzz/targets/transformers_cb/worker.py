"""The transformers side of the transformers-cb target: a model and its continuous-batching
manager in a process of their own, so that a crash, a hang or a leak in the library's
background thread is contained (the runner kills the process group and starts another).

Run as a script by `fuzz.targets.transformers_cb.runner.CBRunner`; it imports only the
standard library, torch and transformers. Protocol: one JSON object per line; stdin:
commands; the original stdout: replies (fd 1 is pointed at stderr, the log, first).

    first line: {"model": DIR, "attn": IMPL, "dtype": D, "device": DEV}
    -> {"event": "ready", "startup_s", "import_s", "version"} or {"event": "error", "phase": "startup", ...}
    {"cmd": "configure", "cb": {ContinuousBatchingConfig arguments}}
    -> {"event": "configured"} or {"event": "error", "phase": "configure", ...} (the library's
       checks: one manager and its batch processor are built with it, then dropped)
    {"cmd": "run", "top_k": K, "requests": [{"id", "prompt_token_ids", "max_tokens", "arrival_step"}]}
    -> {"event": "progress", "step": N} while batches run, then
       {"event": "result", "seconds", "steps", "results": {id: {"token_ids", "logprobs", "own_logprobs"}},
        "memory": {...}}  or  {"event": "error", "phase": "run", ...} (and the process exits)
    {"cmd": "exit"}

Each run builds a fresh manager (`init_continuous_batching`, `warmup`, `start`, the user
entry points), adds the requests with `add_request` and reads `get_result`, as a server
would; `stop` and `destroy` end it. Greedy decoding, every request exactly max_tokens
(eos_token_id -1). Top-k logprobs: the library returns only the chosen token's logprob
(`return_logprobs`), so `fuzz.targets.transformers_cb.tap.LogitsTap` copies the LM head's
output rows (what the library samples from) and maps them to requests at each batch
update; the library's own logprob is returned beside them (`own_logprobs`).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
import weakref


def _frames(tb) -> list[dict]:
    return [{"file": f.filename, "line": f.lineno, "func": f.name} for f in traceback.extract_tb(tb)]


def _error(exc: BaseException, phase: str) -> dict:
    return {"event": "error", "phase": phase, "type": type(exc).__name__, "message": str(exc)[:2000],
            "frames": _frames(exc.__traceback__), "traceback": "".join(traceback.format_exception(exc))[-20000:]}


# Words of a CUDA error the library logs and goes on past ("Failed to warm up: CUDA error:
# device-side assert triggered", a WARNING): the device is broken from then on, whatever the
# run returns next, so the run is a crash where the error was logged.
CUDA_ERROR_WORDS = ("CUDA error", "device-side assert", "AcceleratorError", "illegal memory access")


class _LoggedErrors:
    """The library's logged failures. Exceptions (`logger.error(..., exc_info=True)`): a
    request that fails is reported by the library only as a string in its output; its
    logged record has the traceback, which names the frame that raised. CUDA errors logged
    at any level from WARNING up, with or without a traceback: the library swallows them."""

    def __init__(self) -> None:
        import logging

        self.records: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = self._emit
        logging.getLogger("ContinuousBatchingLogger").addHandler(handler)

    def _emit(self, rec) -> None:
        import logging

        if (rec.levelno >= logging.ERROR and rec.exc_info) or any(w in rec.getMessage() for w in CUDA_ERROR_WORDS):
            self.records.append(rec)

    def failure(self) -> dict | None:
        """The first logged failure as an error reply: its exception's, or for a CUDA error
        logged without one, `LoggedCUDAError` at the library's frame that logged it."""
        if not self.records:
            return None
        rec = self.records[0]
        if rec.exc_info and rec.exc_info[1] is not None:
            return _error(rec.exc_info[1], "run")
        msg = rec.getMessage()
        return {"event": "error", "phase": "run", "type": "LoggedCUDAError", "message": msg[:2000],
                "frames": [{"file": rec.pathname, "line": rec.lineno, "func": rec.funcName}],
                "traceback": f"{rec.levelname} {rec.name} ({rec.pathname}:{rec.lineno}): {msg}"[-20000:]}


def _plant(what: str) -> None:
    """Planted bugs for the tests that show a failure is caught (`LLMFUZZ_TCB_PLANT`):
    `raise_schedule:N` / `hang_schedule:N` / `abort_schedule:N`: the N-th call of the FIFO
    scheduler's `schedule_batch` raises / sleeps forever / aborts the process as a native
    error would (SIGABRT, in the library's thread); `leak_cache`: every KV cache the library builds
    is kept referenced; `warmup_cuda_error:N`: a CUDA error the library logs at the N-th warm-up and swallows."""
    if not what:
        return
    from transformers.generation.continuous_batching import cache, scheduler

    name, _, n = what.partition(":")
    if name == "warmup_cuda_error":
        _plant_warmup_cuda_error(int(n or 1))
        return
    if name == "leak_cache":
        kept, init = [], cache.PagedAttentionCache.__init__

        def leaky_init(self, *a, **kw):
            init(self, *a, **kw)
            kept.append(self)

        cache.PagedAttentionCache.__init__ = leaky_init
        return
    original, calls = scheduler.FIFOScheduler.schedule_batch, [0]

    def planted_schedule_batch(self, *a, **kw):
        calls[0] += 1
        if calls[0] == int(n or 1):
            if name == "hang_schedule":
                while True:
                    time.sleep(1)
            if name == "abort_schedule":
                print("terminate called after throwing an instance of 'planted' what(): planted abort",
                      file=sys.stderr, flush=True)
                os.abort()
            raise RuntimeError("planted scheduler failure")
        return original(self, *a, **kw)

    scheduler.FIFOScheduler.schedule_batch = planted_schedule_batch


def _plant_warmup_cuda_error(nth: int) -> None:
    """`warmup_cuda_error:N`: the N-th warm-up (the worker's configure check is the first) meets a CUDA error, as it did on a
    shared H100 (docs/findings/transformers_cb_async_race.md): it logs "Failed to warm up:
    CUDA error: device-side assert triggered" as a warning and goes on."""
    from transformers.generation.continuous_batching import model_runner

    warmup, calls = model_runner.ModelRunner.warmup, [0]

    def planted_warmup(self, model, *a, **kw):
        calls[0] += 1
        if calls[0] != nth:  # once, as the other plants: the worker's next run is clean
            return warmup(self, model, *a, **kw)

        def failing(*_a, **_kw):
            raise RuntimeError("CUDA error: device-side assert triggered (planted)")

        self.compute_batch = failing
        try:
            self.run_one_warmup(model, num_q_tokens=1, max_kv_read=None)  # logs the error and goes on
        finally:
            del self.compute_batch
        return warmup(self, model, *a, **kw)

    model_runner.ModelRunner.warmup = planted_warmup


def _load(spec: dict):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], attn_implementation=spec["attn"], dtype=dtype)
    model = model.to(spec["device"]).eval()
    if model.device.type == "cuda":  # what a first forward initializes lazily is not a Case's leak
        with torch.no_grad():
            model(torch.ones((1, 1), dtype=torch.long, device=model.device))
    return model


def cb_kwargs(fields: set[str], kw: dict) -> dict:
    """`kw` (configs.cb_config) in the installed version's spelling: the page size was
    `block_size` before it was `page_size`; `auto_switch_to_flash` (off here: the attention
    implementation is the config's) is absent where the library switches to flash only when a
    flash kernel imports, which the plan's flash_available mirrors. Anything else the version
    lacks stays, and fails the start as the adapter's error."""
    kw = dict(kw)
    if "page_size" not in fields and "block_size" in fields:
        kw["block_size"] = kw.pop("page_size")
    if "auto_switch_to_flash" not in fields:
        kw.pop("auto_switch_to_flash", None)
    return kw


def _configs(spec: dict):
    import inspect

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    fields = set(inspect.signature(ContinuousBatchingConfig).parameters)
    return gen, ContinuousBatchingConfig(**cb_kwargs(fields, spec["cb"]))


def _manager(model, spec: dict):
    gen, cbc = _configs(spec)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)


def _memory(model) -> int:
    """CUDA memory held by live tensors. cuBLAS keeps a workspace per stream it has run on,
    and each manager has a compute stream of its own: those workspaces are dropped first, so
    that only what the library keeps counts."""
    import torch

    if model.device.type != "cuda":
        return 0
    torch.cuda.synchronize(model.device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated(model.device)


def _end(held: list, timeout_s: float) -> dict:
    """Stop and destroy the manager (`held`, a list of one, is its last reference: it is
    dropped, as a user who is done with it drops it); what it left behind: a live thread, a
    KV cache still referenced after collection (device memory is the caller's to compare)."""
    import torch

    manager = held.pop()
    thread = manager._generation_thread
    bp = manager.batch_processor  # read before stop(), which drops it
    cache = weakref.ref(bp.cache) if bp is not None else None
    del bp
    manager.stop(block=True, timeout=timeout_s)
    alive = thread is not None and thread.is_alive()
    manager.destroy()
    del manager, thread
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    # None: no batch processor was built (warmup failed), so there was no cache to check.
    return {"thread_alive": alive, "cache_alive": None if cache is None else cache() is not None}


def _run(model, spec: dict, cmd: dict, progress, errors: _LoggedErrors) -> dict:
    from tap import Arrivals, LogitsTap  # the worker's own directory is on sys.path

    base_mem, base_threads = _memory(model), threading.active_count()
    errors.records.clear()
    held = [_manager(model, spec)]  # the manager's one reference, dropped by _end
    tap = LogitsTap(model, held[0], spec["cb"]["max_batch_tokens"], int(cmd.get("top_k", 5)))
    arrivals = Arrivals(held[0], cmd["requests"])
    t0 = time.perf_counter()
    try:
        held[0].warmup()  # builds the batch processor (and captures CUDA graphs, if on)
        tap.wrap(held[0].batch_processor.inputs_and_outputs, arrivals.after_batch)
        offloads = _count_offloads(held[0].batch_processor.offloading_manager)
        arrivals.add_due(0)
        held[0].start()
        outputs = _collect(held[0], arrivals, progress)
    finally:
        tap.remove()
        # The failure as a reply now: the exception's frames hold the library's batch processor
        # (and its KV cache) for as long as the exception lives.
        exc = arrivals.fatal
        failure = _error(exc, "run") if exc is not None else errors.failure()
        del exc
        arrivals.fatal = tap.manager = arrivals.manager = None
        errors.records.clear()
        memory = _end(held, timeout_s=30.0)
    memory.update(leaked_bytes=_memory(model) - base_mem, threads_left=threading.active_count() - base_threads)
    failed = {rid: o.error for rid, o in outputs.items() if o.error is not None}
    if failure is not None or failed or len(outputs) < len(cmd["requests"]):
        out = failure or {"event": "error", "phase": "run", "type": "RequestFailed", "message": "", "frames": []}
        out.update(failed=failed, missing=sorted({r["id"] for r in cmd["requests"]} - set(outputs)), memory=memory)
        # The library failed its requests and stopped its thread; the manager is gone and the
        # model untouched: on the CPU the worker serves the next run (a shrink is no restart
        # per check) unless something was left behind. On CUDA an error may be sticky: it ends.
        out["alive"] = model.device.type == "cpu" and not any(memory.values())
        return out
    results = {rid: {"token_ids": list(o.generated_tokens), "own_logprobs": list(o.logprobs),
                     **tap.result(rid, list(o.generated_tokens))} for rid, o in outputs.items()}
    return {"event": "result", "seconds": time.perf_counter() - t0, "steps": tap.batches, "results": results,
            "memory": memory, "offloads": offloads[0]}


def _count_offloads(om) -> list[int]:
    """How often the cache was full and the library evicted something (cached blocks, or
    requests: prefilled again, or swapped to CPU): the reach of a small KV cache."""
    count, original = [0], om.offload_requests

    def offload_requests():
        done = original()
        count[0] += bool(done)
        return done

    om.offload_requests = offload_requests
    return count


def _collect(manager, arrivals, progress) -> dict:
    """Every request's final output, in the order they finish. The background thread adds
    the requests due after each batch (`Arrivals.after_batch`); when every request added
    so far has finished and some are still to come, the next ones are added here."""
    outputs, last = {}, -1
    while len(outputs) < arrivals.total:
        out = manager.get_result(timeout=0.05)
        if out is not None and out.is_finished():
            outputs[out.request_id] = out
        batch = getattr(manager, "current_batch", 0)  # set by the thread when its loop starts
        if batch != last:
            last = batch
            progress(last)
        status = manager.background_thread_status
        if status.fatal_error is not None:
            arrivals.fatal = status.fatal_error
            break
        if out is None and not manager.is_running():
            break  # the thread ended without a fatal error: the missing requests say so
        if out is None and len(outputs) == arrivals.added < arrivals.total:
            arrivals.add_next()
    # Outputs already queued when the thread ended (failed requests are delivered too).
    while (out := manager.get_result(timeout=0.0)) is not None:
        if out.is_finished():
            outputs[out.request_id] = out
    return outputs


def _configure(model, spec: dict) -> None:
    """The library's checks of a ContinuousBatchingConfig: one manager built with it (the
    config resolved, the attention implementation switched) and its batch processor (the KV
    cache and IO buffers), then dropped."""
    held = [_manager(model, spec)]
    held[0].warmup()
    _end(held, timeout_s=5.0)


def _serve(model, spec: dict, reply) -> int:
    errors = _LoggedErrors()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            return 0
        try:
            if cmd.get("cmd") == "configure":
                spec["cb"] = cmd["cb"]
                _configure(model, spec)
                out = {"event": "configured"}
            else:
                out = _run(model, spec, cmd, lambda step: reply({"event": "progress", "step": step}), errors)
        except BaseException as e:  # noqa: BLE001 - a crash is a finding; report it and stop
            out = _error(e, cmd.get("cmd", "run"))
        reply(out)
        # A config the library refused was never used: the model is as it was (the runner
        # ends the process if the error was no refusal); a run the library failed cleanly
        # says so ("alive"). Anything else leaves unknown state.
        if out["event"] == "error" and cmd.get("cmd") != "configure" and not out.get("alive"):
            return 3
    return 0


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the library's prints and logs go to the log, not the protocol
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    t0 = time.perf_counter()
    try:
        import torch
        import transformers

        # One compute thread, as the reference engine's harness: the machine's cores are shared,
        # and CPU GEMMs round the same way from run to run.
        torch.set_num_threads(1)
        import_s = time.perf_counter() - t0
        spec = json.loads(sys.stdin.readline())
        t0 = time.perf_counter()
        _plant(os.environ.get("LLMFUZZ_TCB_PLANT", ""))
        model = _load(spec)
        gc.collect()
        # What is alive now (torch, transformers, the model) lives as long as the process: out of
        # the collector's sight, the full collections the library runs at every stop (and the
        # leak check's) take milliseconds instead of a third of a second each.
        gc.freeze()
    except BaseException as e:  # noqa: BLE001 - every start-up failure is reported
        reply(_error(e, "startup"))
        return 3
    reply({"event": "ready", "startup_s": time.perf_counter() - t0, "import_s": import_s,
           "version": transformers.__version__})
    return _serve(model, spec, reply)


if __name__ == "__main__":
    sys.exit(main())
