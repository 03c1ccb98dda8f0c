"""FA guard overhead per call on the CPU, with and without the device-value checks (JSON).

    python bench/guard_overhead.py            # indented JSON
    python bench/guard_overhead.py --json     # compact
    python bench/guard_overhead.py --quick    # fewer repeats (CI smoke)

What is timed: a do-nothing function with flash-attn 2's signature, called plain and through
`fuzz.guard.wrap` with the guard installed (mode raise, valid calls), on vLLM-shaped paged
batches (decode-heavy mixes with one chunked prefill; block_size 16, 8 query heads, 2 KV
heads, head_dim 128, fp16 tensors on the CPU). The difference is the guard's own cost per
attention call: "full" runs check_varlen_args (copies cu_seqlens / seqused_k / block_table
to the host and checks them with vectorised torch ops), "host_only" runs
check_varlen_shapes (check_device_values=False, and what runs inside CUDA graph capture).
Also: the reference engine's eager step rate with and without the guard (4 layers, so 4
guarded calls per step), and the cost of the llmfuzz_guard.pth line at start-up.

GPU: not measured here. On a GPU the full check adds a device-to-host copy and a stream
synchronisation per index tensor (4 per call); the host-only check adds none.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import timeit

import torch

from fuzz.guard import autoinstall as hook
from fuzz import guard


def fa2_stub(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             deterministic=False, return_attn_probs=False, block_table=None):
    return q


def batch(num_seqs: int, block_size: int = 16, prefill: int = 256, context: int = 512):
    """num_seqs - 1 decodes (1 query, `context` keys) and one chunked prefill of `prefill`."""
    q_lens = [1] * (num_seqs - 1) + [prefill]
    k_lens = [context] * (num_seqs - 1) + [context + prefill]
    cu_q = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu_q[1:] = torch.tensor(q_lens).cumsum(0)
    cu_k = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu_k[1:] = torch.tensor(k_lens).cumsum(0)
    pages = [-(-k // block_size) for k in k_lens]
    width = max(pages)
    bt = torch.zeros(num_seqs, width, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(pages):
        bt[i, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    q = torch.empty(int(cu_q[-1]), 8, 128, dtype=torch.float16)
    cache = torch.empty(nxt, block_size, 2, 128, dtype=torch.float16)
    args = (q, cache, cache, cu_q, cu_k, max(q_lens), max(k_lens))
    return args, {"causal": True, "block_table": bt}


def per_call_us(fn, args, kwargs, repeats: int, number: int) -> float:
    t = timeit.Timer(lambda: fn(*args, **kwargs))
    return min(t.repeat(repeat=repeats, number=number)) / number * 1e6


def engine_steps_per_s(repeats: int) -> dict:
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(EngineConfig())
    prompts = [[(7 * i + j) % 120 + 1 for j in range(1 + 5 * i % 40)] for i in range(8)]

    def run() -> tuple[float, int]:
        eng.reset()
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, 8)
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t0, eng.trace.num_steps

    configs = (("plain", None), ("guard_full", True), ("guard_host_only", False))
    times: dict[str, list[float]] = {label: [] for label, _ in configs}
    steps = 0
    try:
        run()  # warm-up
        for _ in range(repeats):  # interleaved, so load drift hits every configuration alike
            for label, mode in configs:
                if mode is not None:
                    guard.install("raise", check_device_values=mode)
                t, steps = run()
                guard.uninstall()
                times[label].append(t)
    finally:
        guard.uninstall()
        eng.shutdown()
    out = {label: round(steps / statistics.median(ts), 1) for label, ts in times.items()}
    out["guarded_calls_per_step"] = EngineConfig().num_hidden_layers
    return out


def pth_cost_us() -> dict:
    code = compile(hook.PTH_LINE, "llmfuzz_guard.pth", "exec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFUZZ_FA_GUARD")}
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        unset = min(timeit.repeat(lambda: exec(code, {}), number=2000, repeat=5)) / 2000 * 1e6
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # With the variable set: bootstrap() reads it and registers the import watcher (torch is
    # already imported here, so measure config parsing + watch/unwatch, not the install).
    on = {"LLMFUZZ_FA_GUARD": "raise"}
    t = timeit.Timer(lambda: (hook.config_from_env(on), hook.watch(lambda name: None), hook.unwatch()))
    set_us = min(t.repeat(repeat=5, number=2000)) / 2000 * 1e6
    return {"pth_line_unset_us": round(unset, 2), "bootstrap_set_us": round(set_us, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="compact JSON")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--sizes", default="1,8,64,256", help="sequences per call (comma list)")
    args = ap.parse_args()
    repeats, number = (3, 50) if args.quick else (7, 300)
    torch.set_num_threads(1)
    guarded = guard.wrap(fa2_stub, "flash_attn", name="bench.fa2_stub")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        a, kw = batch(n)
        row = {"num_seqs": n, "num_tokens": a[0].shape[0], "block_table_shape": list(kw["block_table"].shape)}
        row["plain_us"] = round(per_call_us(fa2_stub, a, kw, repeats, number), 2)
        for label, device_values in (("full", True), ("host_only", False)):
            guard.install("raise", check_device_values=device_values, watch=False, targets=())
            us = per_call_us(guarded, a, kw, repeats, number)
            assert guard.stats()["violations"] == 0
            guard.uninstall()
            row[f"guard_{label}_us"] = round(us, 2)
            row[f"overhead_{label}_us"] = round(us - row["plain_us"], 2)
        rows.append(row)
    passthrough = per_call_us(guarded, *batch(8), repeats, number)  # wrapper left, guard uninstalled
    result = {
        "bench": "guard_overhead", "device": "cpu", "torch": torch.__version__, "threads": 1,
        "python": platform.python_version(), "machine": platform.machine(),
        "per_call": rows,
        "uninstalled_wrapper_us": round(passthrough, 2),
        "engine_eager_steps_per_s": engine_steps_per_s(2 if args.quick else 5),
        "startup": pth_cost_us(),
        "gpu": "not measured",
    }
    print(json.dumps(result, separators=(",", ":")) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
