"""transformers continuous-batching configs: the model (`CB_MODEL`), the switches no
EngineConfig field holds (`CBOptions`, a Case's `target_options`), config names, and what a
config becomes for the library (`process_spec`, `cb_config`).

Case -> transformers CB (5.24)
------------------------------
EngineConfig fields, as the library's users set them:
- `block_size` -> `ContinuousBatchingConfig.page_size` (tokens per KV page; the library
  refuses < 4);
- `max_num_batched_tokens` -> `max_batch_tokens` (a longer prompt is prefilled in chunks);
- `max_num_seqs` -> `max_requests_per_batch`;
- `dtype`, `device` -> the model's dtype and device.
`CBOptions` (target_options of target "transformers-cb"):
- `attn`: the attention implementation the model is loaded with. The library runs
  continuous batching on "paged|eager", "sdpa" and the flash ones; it switches "eager" to
  "paged|eager" itself, and refuses anything else (ValueError at manager creation);
- `kv_blocks`: the KV cache's size in whole-model blocks of page_size tokens (0: the
  EngineConfig's `num_gpu_blocks`, enough for every workload); a small one forces the
  scheduler to hold prefills back and offload (re-prefill) requests;
- `scheduler`: "fifo" or "prefill_first" (SCHEDULER_MAPPING);
- `cuda_graph`, `async_batching`: None leaves the library's choice (graphs and async on
  CUDA with a flash kernel, off otherwise); True on the CPU is accepted for graphs (the
  library turns them off: no graph backend) and refused for async batching;
- `block_sharing`: prefix sharing of complete KV blocks (`allow_block_sharing`, the
  library's default True);
- `cpu_offload`: GiB of pinned CPU memory a request evicted from a full KV cache is copied
  to (`cpu_offload_space`; 0, the default: evicted requests are prefilled again). Pinned
  memory needs an accelerator: on the CPU the library's offloading manager fails to build
  (torch's RuntimeError, counted unsupported).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from fuzz.targets.options import TargetOptions, differing
from fuzz.targets.vllm.configs import VLLM_MODEL, _fit

TARGET = "transformers-cb"
# The vLLM target's tiny Llama (2 layers, GQA 2/1, head_dim 64), with 4-token pages: prompts
# up to 64 tokens cross many page edges. Its checkpoint is shared with the vLLM target's.
CB_MODEL = _fit(VLLM_MODEL.replace(block_size=4))

ATTN_IMPLS = ("sdpa", "paged|eager", "paged|sdpa", "eager")
FLASH_IMPLS = ("flash_attention_2", "paged|flash_attention_2")
SCHEDULERS = ("fifo", "prefill_first")


@dataclass(frozen=True, slots=True)
class CBOptions(TargetOptions):
    """The library's switches that have no EngineConfig field; defaults are its own."""

    target = TARGET
    label = "transformers-cb options"

    attn: str = "sdpa"
    kv_blocks: int = 0
    scheduler: str = "fifo"
    cuda_graph: bool | None = None
    async_batching: bool | None = None
    block_sharing: bool = True
    cpu_offload: float = 0.0


def process_spec(cfg: EngineConfig, opts: CBOptions, model_path: str) -> dict:
    """What a worker process loads: the checkpoint, with the attention implementation, dtype
    and device (a change of any is another process)."""
    return {"model": model_path, "attn": opts.attn, "dtype": cfg.dtype, "device": cfg.device}


def cb_config(cfg: EngineConfig, opts: CBOptions) -> dict:
    """The ContinuousBatchingConfig's arguments (a change is a new config for the same model:
    the worker checks it, no restart)."""
    return dict(page_size=cfg.block_size, num_blocks=opts.kv_blocks or cfg.num_gpu_blocks,
              max_batch_tokens=cfg.max_num_batched_tokens, max_requests_per_batch=cfg.max_num_seqs,
              scheduler_type=opts.scheduler, allow_block_sharing=opts.block_sharing,
              use_cuda_graph=opts.cuda_graph, use_async_batching=opts.async_batching,
              cpu_offload_space=opts.cpu_offload, return_logprobs=True, auto_switch_to_flash=False, seed=0)


def small_kv(cfg: EngineConfig) -> int:
    """A KV cache that holds one longest request and one block more: a mixed batch does not fit."""
    return -(-cfg.max_model_len // cfg.block_size) + 1


def cell_name(cfg: EngineConfig, opts: CBOptions = CBOptions()) -> str:
    """'sdpa-p4-b128-s8', 'paged|eager-p16-b32-s8-kv9-prefill_first-graph-len64-bf16-cuda'."""
    name = f"{opts.attn}-p{cfg.block_size}-b{cfg.max_num_batched_tokens}-s{cfg.max_num_seqs}"
    if opts.kv_blocks:
        name += f"-kv{opts.kv_blocks}"
    if opts.scheduler != "fifo":
        name += f"-{opts.scheduler}"
    if opts.cuda_graph is not None:
        name += "-graph" if opts.cuda_graph else "-nograph"
    if opts.async_batching is not None:
        name += "-async" if opts.async_batching else "-sync"
    if not opts.block_sharing:
        name += "-noshare"
    if opts.cpu_offload:
        name += f"-swap{opts.cpu_offload:g}"
    name += differing(cfg, CB_MODEL, {"max_model_len": "len{}", "dtype": "{}"})
    if cfg.device != "cpu":
        name += f"-{cfg.device.replace(':', '')}"
    return name
