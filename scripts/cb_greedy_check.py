#!/usr/bin/env python3
"""Greedy tokens of transformers' continuous batching, checked outside llmfuzz.

Stand-alone on purpose: it imports only torch, transformers, safetensors (through
transformers) and the standard library, so that a disagreement it shows is the library's
and not the harness's. It drives the library as llmfuzz's transformers-cb worker does
(fuzz/targets/transformers_cb/worker.py: `init_continuous_batching` with a
GenerationConfig(do_sample=False, eos_token_id=-1) and a ContinuousBatchingConfig,
`warmup`, `start`, `add_request` per request, `get_result`, `stop`, `destroy`; a fresh
manager per run), without the worker's logits tap unless `--lm-head-hook` asks for an
equivalent of it.

    cb_greedy_check.py MODEL_DIR CASE_JSON [--cuda-graph on|off] [--async-batching on|off]
                       [--device cuda] [--dtype bfloat16] [--repeat N] ...

MODEL_DIR: a Hugging Face Llama checkpoint (config.json + safetensors). CASE_JSON: either a
list of prompts (token-id lists; --max-new-tokens each), or an object
{"requests": [{"id", "prompt_token_ids", "max_tokens", "arrival_step"}], "attn", "dtype",
"device", "cb": {ContinuousBatchingConfig arguments}} as scripts/tcb_export.py writes it
from a reproducer. A flag given on the command line overrides the file.

Each repeat runs the whole batch once; each request also runs alone (once, same config and
path) and the model is run plainly (`model(input_ids)`, no cache, no paging, one request)
teacher-forced on the request's tokens, in the run's dtype and in float32. Per request and
repeat one JSON line: the tokens, and where they first differ from the request alone and
from the plain forward's argmax: the position, the token's rank in the plain forward's
distribution, its logprob gap to the plain top-1 and the plain top-1/top-2 margin (a small
margin is a near-tie, which a change of batch may flip in half precision). Last line: the
verdict. Exit status: 0 agree (near-ties within --tie-tol allowed), 1 a difference beyond
it, 2 a run failed.

Async batching and CUDA graphs need CUDA: on another device they are turned off (the
verdict line says so).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import threading
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

# What the harness's config sets for a Case (fuzz.targets.transformers_cb.configs.cb_config),
# used where neither the file nor a flag says otherwise.
DEFAULT_CB = dict(page_size=8, num_blocks=64, max_batch_tokens=32, max_requests_per_batch=4, scheduler_type="fifo",
                  allow_block_sharing=True, use_cuda_graph=None, use_async_batching=None, cpu_offload_space=0.0,
                  return_logprobs=True, auto_switch_to_flash=False, seed=0)
ON_OFF = {"on": True, "off": False, "auto": None}


def cb_kwargs(kw: dict) -> dict:
    """`kw` in the installed version's spelling (as the harness's worker does it): the page
    size was `block_size` before it was `page_size`; `auto_switch_to_flash` is absent where
    the library switches to flash only when a flash kernel imports."""
    fields = set(inspect.signature(ContinuousBatchingConfig).parameters)
    kw = dict(kw)
    if "page_size" not in fields and "block_size" in fields:
        kw["block_size"] = kw.pop("page_size")
    if "auto_switch_to_flash" not in fields:
        kw.pop("auto_switch_to_flash", None)
    return kw


# -- continuous batching --------------------------------------------------------------------

class _Arrivals:
    """Requests join while others run, as the harness adds them (fuzz/targets/transformers_cb/
    tap.py `Arrivals`): one with arrival_step a is added after the library's a-th batch update,
    from the library's thread; when every request added so far has finished and more are to
    come, the next step's requests are added at once."""

    def __init__(self, manager, requests: list[dict], upfront: bool) -> None:
        self.manager, self.lock = manager, threading.Lock()
        key = (lambda r: 0) if upfront else (lambda r: int(r.get("arrival_step", 0)))
        self.pending = sorted(requests, key=key)  # stable: file order within a step
        self.step_of = key
        self.total, self.added, self.batches = len(requests), 0, 0

    def _add(self, r: dict) -> None:
        rid = self.manager.add_request([int(t) for t in r["prompt_token_ids"]], request_id=str(r["id"]),
                                       max_new_tokens=int(r["max_tokens"]), eos_token_id=-1)
        if rid is None:
            raise RuntimeError(f"the manager refused request {r['id']}")
        self.added += 1

    def add_due(self, step: int) -> None:
        with self.lock:
            while self.pending and self.step_of(self.pending[0]) <= step:
                self._add(self.pending.pop(0))

    def add_next(self) -> None:
        with self.lock:
            if self.pending:
                step = self.step_of(self.pending[0])
                while self.pending and self.step_of(self.pending[0]) == step:
                    self._add(self.pending.pop(0))

    def wrap(self, io) -> None:
        """Count batch updates (and add the requests then due) around the IO object's
        `prepare_batch_update`, which the library calls once per batch update; the values it
        returns pass through untouched."""
        original = io.prepare_batch_update

        def prepare_batch_update():
            out = original()
            self.batches += 1
            self.add_due(self.batches)
            return out

        io.prepare_batch_update = prepare_batch_update


class _LmHeadHook:
    """What the harness's logits tap adds to the model (tap.py `LogitsTap._hook`): a forward
    hook on the LM head copying its output rows into a buffer allocated up front, one slot per
    async IO pair. With CUDA graphs the copy is captured into the graphs. Only for telling
    whether the tap changes what the library computes; nothing reads the buffer."""

    def __init__(self, model, manager, rows: int) -> None:
        head = model.get_output_embeddings()
        self.manager = manager
        self.buf = torch.zeros(2, rows + 1, head.weight.shape[0], dtype=torch.float32, device=head.weight.device)
        self.handle = head.register_forward_hook(self._hook)

    def _hook(self, module, args, out) -> None:
        bp = self.manager.batch_processor
        pair = int(getattr(bp.inputs_and_outputs, "current_pair", 0)) if bp is not None else 0
        flat = out.reshape(-1, out.shape[-1])
        n = min(flat.shape[0], self.buf.shape[1])
        self.buf[pair, :n].copy_(flat[:n])

    def remove(self) -> None:
        self.handle.remove()
        self.buf = None


def run_cb(model, cb: dict, requests: list[dict], *, upfront: bool = False, lm_head_hook: bool = False,
           timeout_s: float = 120.0) -> tuple[dict, dict]:
    """One run of `requests` on a fresh manager: ({id: {"tokens", "error"}}, run info)."""
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1)
    cbc = ContinuousBatchingConfig(**cb_kwargs(cb))  # the library resolves it in place: one per run
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    hook = _LmHeadHook(model, manager, int(cb["max_batch_tokens"])) if lm_head_hook else None
    arrivals = _Arrivals(manager, requests, upfront)
    offloads, outputs, fatal, attn_used = [0], {}, None, None
    t0 = time.perf_counter()
    try:
        manager.warmup()  # builds the batch processor (and captures the CUDA graphs, if on)
        attn_used = getattr(model.config, "_attn_implementation", None)  # what the manager switched to, if it did
        bp = manager.batch_processor
        arrivals.wrap(bp.inputs_and_outputs)
        om = getattr(bp, "offloading_manager", None)
        if om is not None:  # how often the cache was full and the library evicted: the small cache's reach
            original = om.offload_requests

            def offload_requests():
                done = original()
                offloads[0] += bool(done)
                return done

            om.offload_requests = offload_requests
        arrivals.add_due(0)
        manager.start()
        deadline = time.monotonic() + timeout_s
        while len(outputs) < arrivals.total and time.monotonic() < deadline:
            out = manager.get_result(timeout=0.05)
            if out is not None and out.is_finished():
                outputs[out.request_id] = out
            status = manager.background_thread_status
            if getattr(status, "fatal_error", None) is not None:
                fatal = status.fatal_error
                break
            if out is None and not manager.is_running():
                break
            if out is None and len(outputs) == arrivals.added < arrivals.total:
                arrivals.add_next()
        while (out := manager.get_result(timeout=0.0)) is not None:
            if out.is_finished():
                outputs[out.request_id] = out
    finally:
        if hook is not None:
            hook.remove()
        manager.stop(block=True, timeout=30.0)
        manager.destroy()
    results = {}
    for r in requests:
        o = outputs.get(str(r["id"]))
        err = None if o is None else (str(o.error) if o.error is not None else None)
        if o is None:
            err = f"no output ({'fatal: ' + repr(fatal) if fatal is not None else 'lost or timed out'})"
        results[str(r["id"])] = {"tokens": [] if o is None else [int(t) for t in o.generated_tokens], "error": err}
    info = {"seconds": round(time.perf_counter() - t0, 3), "batches": arrivals.batches, "offloads": offloads[0],
            "attn_used": attn_used}
    return results, info


# -- the plain forward ----------------------------------------------------------------------

@torch.no_grad()
def plain_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """fp64 log-softmax of `model(prompt + tokens[:-1])` at the generated positions: row i is
    the distribution position i of `tokens` was drawn from (teacher-forced on `tokens`)."""
    ids = torch.tensor([list(prompt) + list(tokens[:-1])], dtype=torch.long, device=model.device)
    logits = model(input_ids=ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1:], dim=-1).cpu()


def position(lp: torch.Tensor, tok: int) -> dict:
    """Where `tok` stands in one distribution: its rank (1: the top-1), its logprob gap to
    the top-1, the top-1 and top-2 tokens and their margin."""
    top = torch.topk(lp, 2)
    t1, t2 = int(top.indices[0]), int(top.indices[1])
    return {"token": tok, "rank": 1 + int((lp > lp[tok]).sum()), "gap": round(float(lp[t1] - lp[tok]), 6),
            "top1": t1, "top2": t2, "margin": round(float(lp[t1] - lp[t2]), 6)}


def vs_plain(tokens: list[int], lp: torch.Tensor, lp32: torch.Tensor, tie_tol: float) -> dict | None:
    """The positions where `tokens` are not the plain forward's argmax (teacher-forced on
    `tokens`); None where they all are. `status`: near_tie if every such token is within
    `tie_tol` nats of the plain top-1, else differs."""
    bad = []
    for i, tok in enumerate(tokens):
        p = position(lp[i], tok)
        if p["rank"] != 1:
            p32 = position(lp32[i], tok)
            bad.append({"position": i, **p, "fp32": {k: p32[k] for k in ("rank", "gap", "top1", "margin")}})
    if not bad:
        return None
    worst = max(b["gap"] for b in bad)
    return {"status": "differs" if worst > tie_tol else "near_tie", "max_gap": worst, "first": bad[0],
            "positions": [b["position"] for b in bad]}


def vs_solo(tokens: list[int], solo: list[int], lp: torch.Tensor, tie_tol: float) -> dict | None:
    """The first position where `tokens` (in the batch) differ from `solo` (alone); both
    share the prefix before it, so the plain forward's row there (teacher-forced on
    `tokens`) ranks both. near_tie: their plain logprobs are within `tie_tol` nats."""
    i = next((k for k, (a, b) in enumerate(zip(tokens, solo)) if a != b), None)
    if i is None:
        if len(tokens) == len(solo):
            return None
        return {"status": "differs", "position": min(len(tokens), len(solo)),
                "why": f"{len(tokens)} tokens in the batch, {len(solo)} alone"}
    b, s = position(lp[i], tokens[i]), position(lp[i], solo[i])
    apart = abs(b["gap"] - s["gap"])
    return {"status": "differs" if apart > tie_tol else "near_tie", "position": i, "batch_token": tokens[i],
            "solo_token": solo[i], "batch_rank": b["rank"], "solo_rank": s["rank"], "batch_gap": b["gap"],
            "solo_gap": s["gap"], "plain_top1": b["top1"], "plain_margin": b["margin"]}


def worst(*statuses: str | None) -> str:
    order = ["agree", "near_tie", "differs", "error"]
    return max((s or "agree" for s in statuses), key=order.index)


# -- the command ----------------------------------------------------------------------------

def load_case(path: str, max_new_tokens: int) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):
        doc = {"requests": doc}
    reqs = []
    for i, r in enumerate(doc["requests"]):
        if isinstance(r, list):
            r = {"prompt_token_ids": r}
        reqs.append({"id": str(r.get("id", f"r{i}")), "prompt_token_ids": [int(t) for t in r["prompt_token_ids"]],
                     "max_tokens": int(r.get("max_tokens", max_new_tokens)), "arrival_step": int(r.get("arrival_step", 0))})
    doc["requests"] = reqs
    return doc


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("case_json")
    p.add_argument("--max-new-tokens", type=int, default=4, help="for requests that do not say (default 4)")
    p.add_argument("--attn", help="attention implementation the model is loaded with (default: the file's, or sdpa)")
    p.add_argument("--page-size", type=int, help="KV page (block) size in tokens")
    p.add_argument("--num-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--max-requests", type=int, help="max_requests_per_batch")
    p.add_argument("--scheduler", help="fifo or prefill_first")
    p.add_argument("--cuda-graph", choices=ON_OFF)
    p.add_argument("--async-batching", choices=ON_OFF)
    p.add_argument("--block-sharing", choices=("on", "off"))
    p.add_argument("--cb", action="append", default=[], metavar="KEY=JSON",
                   help="any other ContinuousBatchingConfig argument, e.g. --cb return_logprobs=false")
    p.add_argument("--dtype", help="float32, bfloat16, float16 (default: the file's, or float32)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: the file's, or cpu)")
    p.add_argument("--repeat", type=int, default=1, help="run the batch N times (a replay rate)")
    p.add_argument("--arrivals", choices=("steps", "upfront"), default="steps",
                   help="steps: add each request after its arrival_step-th batch, as the harness does; "
                        "upfront: all before the first batch")
    p.add_argument("--no-solo", action="store_true", help="skip each request's run alone")
    p.add_argument("--solo-repeat", type=int, default=1, help="run each request alone M times (default 1)")
    p.add_argument("--lm-head-hook", action="store_true",
                   help="install a forward hook on the LM head like the harness's logits tap")
    p.add_argument("--tie-tol", type=float, help="nats under which a flipped token is a near-tie "
                   "(default 0.1 in half precision, 1e-3 in float32)")
    p.add_argument("--threads", type=int, default=1, help="CPU compute threads (default 1, as the harness)")
    p.add_argument("--label", default="", help="copied into every line (which variant this run is)")
    p.add_argument("--test-perturb-batched", metavar="PARAM=SCALE",
                   help="for tests of this script only: add SCALE * N(0,1) noise to PARAM for the batched runs "
                        "(not the solo or plain ones), so that they disagree")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    case = load_case(a.case_json, a.max_new_tokens)
    cb = {**DEFAULT_CB, **case.get("cb", {})}
    for k, v in (("page_size", a.page_size), ("num_blocks", a.num_blocks), ("max_batch_tokens", a.max_batch_tokens),
                 ("max_requests_per_batch", a.max_requests), ("scheduler_type", a.scheduler)):
        if v is not None:
            cb[k] = v
    if a.cuda_graph is not None:
        cb["use_cuda_graph"] = ON_OFF[a.cuda_graph]
    if a.async_batching is not None:
        cb["use_async_batching"] = ON_OFF[a.async_batching]
    if a.block_sharing is not None:
        cb["allow_block_sharing"] = a.block_sharing == "on"
    for item in a.cb:
        k, _, v = item.partition("=")
        cb[k] = json.loads(v)
    attn = a.attn or case.get("attn") or "sdpa"
    dtype_name = a.dtype or case.get("dtype") or "float32"
    device = a.device or case.get("device") or "cpu"
    forced_off = []
    if not device.startswith("cuda"):
        for k in ("use_cuda_graph", "use_async_batching"):
            if cb.get(k):
                forced_off.append(k)
                cb[k] = False
    dtype = getattr(torch, dtype_name)
    tie_tol = a.tie_tol if a.tie_tol is not None else (1e-3 if dtype == torch.float32 else 0.1)
    torch.set_num_threads(a.threads)
    label = {"label": a.label} if a.label else {}

    def emit(obj: dict) -> None:
        print(json.dumps({**label, **obj}), flush=True)

    model = AutoModelForCausalLM.from_pretrained(a.model_dir, attn_implementation=attn, dtype=dtype).to(device).eval()
    if model.device.type == "cuda":  # as the harness's worker: a first forward before any manager
        with torch.no_grad():
            model(torch.ones((1, 1), dtype=torch.long, device=model.device))
    # The plain models: the same weights, no paging (the attention kernel without "paged|"), in the
    # run's dtype and in float32; separate objects, so that nothing the manager sets reaches them.
    base_attn = attn.split("|")[-1] if attn.split("|")[-1] in ("eager", "sdpa") else "sdpa"
    plain = AutoModelForCausalLM.from_pretrained(a.model_dir, attn_implementation=base_attn, dtype=dtype).to(device).eval()
    plain32 = AutoModelForCausalLM.from_pretrained(a.model_dir, attn_implementation="eager",
                                                   dtype=torch.float32).to(device).eval()

    perturb = None
    if a.test_perturb_batched:
        name, _, scale = a.test_perturb_batched.partition("=")
        param = dict(model.named_parameters())[name]
        g = torch.Generator().manual_seed(0)
        perturb = (param, (float(scale) * torch.randn(param.shape, generator=g)).to(param.device, param.dtype))

    reqs = case["requests"]
    by_id = {r["id"]: r for r in reqs}
    t0 = time.perf_counter()
    errors, differing, near_ties, infos = [], [], [], []
    upfront = a.arrivals == "upfront"

    def forced(rid: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = by_id[rid]["prompt_token_ids"]
        return plain_logprobs(plain, prompt, tokens), plain_logprobs(plain32, prompt, tokens)

    # Each request alone (arrival 0), --solo-repeat times: the first run is what the batch is
    # compared with; a later one that differs from it says the path is not even deterministic.
    solo: dict[str, list[int]] = {}
    for m in range(0 if a.no_solo else a.solo_repeat):
        for r in reqs:
            try:
                res, info = run_cb(model, cb, [{**r, "arrival_step": 0}], upfront=True, lm_head_hook=a.lm_head_hook)
            except Exception as e:  # noqa: BLE001 - a run the library failed is a result: reported, not raised
                res, info = {r["id"]: {"tokens": [], "error": f"{type(e).__name__}: {e}"}}, {"seconds": None, "offloads": None}
            out, rid = res[r["id"]], r["id"]
            line = {"solo": rid, "solo_repeat": m, "tokens": out["tokens"], "seconds": info["seconds"],
                    "offloads": info["offloads"]}
            if out["error"] is not None or len(out["tokens"]) != r["max_tokens"]:
                why = out["error"] or f"{len(out['tokens'])} tokens, {r['max_tokens']} asked"
                errors.append({"run": f"solo{m}", "id": rid, "error": why})
                line.update(status="error", error=why)
                emit(line)
                continue
            lp, lp32 = forced(rid, out["tokens"])
            line["vs_plain"] = vs_plain(out["tokens"], lp, lp32, tie_tol)
            line["vs_first_solo"] = vs_solo(out["tokens"], solo[rid], lp, tie_tol) if rid in solo else None
            solo.setdefault(rid, out["tokens"])
            line["status"] = worst(*(c and c["status"] for c in (line["vs_plain"], line["vs_first_solo"])))
            for against, c in (("plain", line["vs_plain"]), ("first solo run", line["vs_first_solo"])):
                if c is not None:
                    entry = {"run": f"solo{m}", "id": rid, "against": against,
                             **(c["first"] if against == "plain" else {x: y for x, y in c.items() if x != "status"})}
                    (differing if c["status"] == "differs" else near_ties).append(entry)
            emit(line)

    repeats_differing = repeats_near_tie = 0
    for k in range(a.repeat):
        if perturb is not None:
            perturb[0].data.add_(perturb[1])
        try:
            res, info = run_cb(model, cb, reqs, upfront=upfront, lm_head_hook=a.lm_head_hook)
            infos.append(info)
        except Exception as e:  # noqa: BLE001 - as above: every request of the run gets the error
            res = {r["id"]: {"tokens": [], "error": f"{type(e).__name__}: {e}"} for r in reqs}
        finally:
            if perturb is not None:
                perturb[0].data.sub_(perturb[1])
        this_repeat = "agree"
        for r in reqs:
            rid, out = r["id"], res[r["id"]]
            line = {"repeat": k, "id": rid, "prompt_len": len(r["prompt_token_ids"]), "max_tokens": r["max_tokens"],
                    "arrival_step": r["arrival_step"], "tokens": out["tokens"], "solo": solo.get(rid)}
            if out["error"] is not None or len(out["tokens"]) != r["max_tokens"]:
                why = out["error"] or f"{len(out['tokens'])} tokens, {r['max_tokens']} asked"
                errors.append({"run": k, "id": rid, "error": why})
                line.update(status="error", error=why)
                this_repeat = worst(this_repeat, "error")
                emit(line)
                continue
            lp, lp32 = forced(rid, out["tokens"])
            line["vs_plain"] = vs_plain(out["tokens"], lp, lp32, tie_tol)
            line["vs_solo"] = vs_solo(out["tokens"], solo[rid], lp, tie_tol) if rid in solo else None
            line["status"] = worst(*(c and c["status"] for c in (line["vs_plain"], line["vs_solo"])))
            for against, c in (("solo", line["vs_solo"]), ("plain", line["vs_plain"])):
                if c is not None:
                    entry = {"run": k, "id": rid, "against": against,
                             **(c["first"] if against == "plain" else {x: y for x, y in c.items() if x != "status"})}
                    (differing if c["status"] == "differs" else near_ties).append(entry)
            this_repeat = worst(this_repeat, line["status"])
            emit(line)
        repeats_differing += this_repeat in ("differs", "error")
        repeats_near_tie += this_repeat == "near_tie"

    verdict = "error" if errors else "differs" if differing else "near_tie" if near_ties else "agree"
    emit({"verdict": verdict, "repeats": a.repeat, "repeats_differing": repeats_differing,
          "replay_rate": f"{repeats_differing}/{a.repeat}",
          "repeats_near_tie": repeats_near_tie, "differing": differing[:20], "near_ties": near_ties[:20],
          "errors": errors[:20], "tie_tol": tie_tol, "forced_off": forced_off, "arrivals": a.arrivals,
          "lm_head_hook": a.lm_head_hook, "perturbed": a.test_perturb_batched,
          "config": {"attn": attn, "attn_used": infos[-1]["attn_used"] if infos else None, "dtype": dtype_name,
                     "device": str(model.device), **cb_kwargs(cb)},
          "runs": [{k: i[k] for k in ("seconds", "batches", "offloads")} for i in infos],
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                       "cuda": torch.version.cuda,
                       "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None},
          "seconds": round(time.perf_counter() - t0, 2)})
    return {"agree": 0, "near_tie": 0, "differs": 1}.get(verdict, 2)


if __name__ == "__main__":
    sys.exit(main())
