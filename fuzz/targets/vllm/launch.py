"""What a vLLM engine process is started with: the Python that has vLLM (`vllm_python`), its
environment (`worker_env`), the `vllm.LLM` arguments for a Case's config (`llm_kwargs`) and
the checkpoint it loads (`checkpoint_dir`). `fuzz.targets.vllm.runner.VLLMRunner` starts
`WORKER` with them.

Case -> vLLM
------------
The Case's EngineConfig says what vLLM runs: model shape and seed (the checkpoint is our
seeded weights written by `engine.weights.save_hf_checkpoint`, so the reference engine,
`transformers` and vLLM load the very same tensors), tp, pp, eager (`cudagraph_mode`
"NONE" -> `enforce_eager=True`; "FULL" -> torch.compile, which is what "compiled" means
for vLLM on CPU), block size, token budget (`max_num_batched_tokens`), `max_num_seqs`,
`max_model_len`, n-gram speculative decoding. vLLM-only switches (prefix caching, async
scheduling) are `VLLMOptions`, kept in the Case's `target_options` (target "vllm").
Sampling (`request_payload`): a request's sampling params become vLLM's SamplingParams
fields of the same names (greedy, temperature 0, without them), always with `ignore_eos=True`
(no EOS stops a request, as in the reference engine) and top-`top_k` logprobs (raw logprobs:
log-softmax of the model's logits). Its cache salt becomes the prompt's `cache_salt`. Stop
*sequences* of token ids have no vLLM counterpart without a tokenizer (vLLM's stop strings
need one): such a request is refused; n > 1 reaches vLLM as its n children (the harness fans
it out, seeds k apart, as for the reference engine). Arrivals are EMULATED: a request with arrival_step a is added before the
(a+1)-th `LLMEngine.step()` call of the driver, so it joins while others are running.
Request ids are the reference engine's (r0, r1, ...).
"""
from __future__ import annotations

import os
import subprocess
import sys

from engine.config import EngineConfig
from fuzz.cases.case import RequestSpec
from fuzz.errors import BadInput
from fuzz.targets.checkpoint import checkpoint_dir  # noqa: F401  (what a vLLM process loads)
from fuzz.targets.runs import TargetUnavailable
from fuzz.targets.vllm.configs import VLLMOptions

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
# On PYTHONPATH of every vLLM process: stacks on SIGUSR1, draft recording, planted bugs.
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


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


# Our SamplingParams fields that vLLM's SamplingParams takes under the same name and meaning.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "min_tokens")


def request_payload(rid: str, r: RequestSpec) -> dict:
    """One request as worker.py takes it: prompt, max_tokens, arrival step, the cache salt, and
    the vLLM SamplingParams fields its sampling params set (`sampling`; none: greedy). BadInput
    for what vLLM cannot be asked without a tokenizer (stop sequences) or is fanned out first (n)."""
    out = {"id": rid, "prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
           "arrival_step": r.arrival_step}
    if r.cache_salt is not None:
        out["cache_salt"] = r.cache_salt
    if r.abort_step is not None:  # between driver steps: vLLM's step is one synchronous call here
        out["abort_step"] = r.abort_step
    p = r.sampling
    if p is None:
        return out
    if p.stop_sequences:
        raise BadInput(f"request {rid}: stop_sequences {list(p.stop_sequences)} have no vLLM counterpart without a "
                       "tokenizer (its stop strings need one); use stop_token_ids")
    if p.n != 1:
        raise BadInput(f"request {rid}: n={p.n}; pass the Case's engine requests (n > 1 fanned out to its children)")
    kw = {f: getattr(p, f) for f in SAMPLING_FIELDS}
    # JSON keys are strings: the worker turns them back into token ids.
    kw.update(logit_bias={str(t): b for t, b in p.logit_bias} or None, stop_token_ids=list(p.stop_token_ids))
    out["sampling"] = kw
    return out


def worker_env(cfg: EngineConfig) -> dict[str, str]:
    """Environment of the vLLM child: 1 GiB KV cache, nothing fetched from a hub, one OpenMP
    thread, a short message-queue spin, and with several workers one core each
    (VLLM_CPU_OMP_THREADS_BIND="0|1"); a user's setting of any of these wins."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # One OpenMP thread per vLLM process: the model is tiny, and a second thread only spins
    # at every barrier (measured on tp1 eager: as many examples, a third less CPU). tp/pp
    # ranks get one core each from vLLM's own binding below.
    env.setdefault("OMP_NUM_THREADS", "1")
    # vLLM's shm message-queue readers spin for 1 s after each read (SpinCondition); between
    # runs, while llmfuzz computes its oracles, tp/pp ranks spinning take the cores those
    # need. The site patch shortens the spin to this many seconds (measured on tp2 eager,
    # 2 cores: 25 examples in 100 s at vLLM's 1 s, 64 at 0.02, 20 at 0); "" keeps vLLM's.
    env.setdefault("LLMFUZZ_VLLM_SPIN_S", "0.02")
    # By default the engine core in the worker's own process: no second process to spawn and
    # import vLLM into (measured: tp1 eager start-up 41 s -> 27 s); a crash in the core is then
    # an exception out of LLMEngine.step() with the core's own traceback. An engine's own
    # setting (VLLMOptions.engine_core_process) is `engine_env`'s.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["PYTHONPATH"] = os.pathsep.join([SITE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if cfg.world_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and cfg.device == "cpu":
        n = os.cpu_count() or 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % n) for r in range(cfg.world_size))
    return env


def engine_env(cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> dict[str, str]:
    """The vLLM settings (VLLM_*) an engine of this config starts with: the worker's
    environment's, and the engine core in its own process or not as the options say."""
    env = {k: v for k, v in worker_env(cfg).items() if k.startswith("VLLM_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.engine_core_process else "0"
    return env


SETUP_HINT = ("install it with scripts/setup_vllm_cpu.sh (vllm-cpu 0.32.0 in a venv; its default place, "
              "${XDG_CACHE_HOME:-~/.cache}/llmfuzz/vllm-venv, is looked in; see docs/vllm.md), or "
              "run llmfuzz with that venv's python or set LLMFUZZ_VLLM_PYTHON=/path/to/venv/bin/python")


def default_venv() -> str:
    """Where scripts/setup_vllm_cpu.sh puts vLLM's venv by default: under the user's cache
    directory, `${XDG_CACHE_HOME:-$HOME/.cache}/llmfuzz/vllm-venv` (the script computes the same)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "llmfuzz", "vllm-venv")


def vllm_python() -> str:
    """The interpreter that has vLLM: $LLMFUZZ_VLLM_PYTHON, else this one if it has vLLM, else
    the default venv's (`default_venv`, where the setup script installs it) if it has vLLM.
    TargetUnavailable (one line: the missing package and the setup script) otherwise."""
    import importlib.util

    p = os.environ.get("LLMFUZZ_VLLM_PYTHON")
    if p:
        if not os.path.exists(p):
            raise TargetUnavailable(f"LLMFUZZ_VLLM_PYTHON={p}: no such file; {SETUP_HINT}")
        if os.path.realpath(p) != os.path.realpath(sys.executable) or importlib.util.find_spec("vllm") is None:
            if not _has_vllm(p):
                raise TargetUnavailable(f"package vllm is not installed for LLMFUZZ_VLLM_PYTHON={p}; {SETUP_HINT}")
        return p
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = os.path.join(default_venv(), "bin", "python")
    if os.path.exists(venv) and _has_vllm(venv):
        return venv
    raise TargetUnavailable(f"package vllm (vllm-cpu on CPU) is not installed for {sys.executable} nor in "
                            f"{default_venv()}; {SETUP_HINT}")


def _has_vllm(python: str) -> bool:
    """Whether `python` finds the vllm package (without importing it: seconds)."""
    try:
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
