"""The configs a transformers-cb campaign visits, one cell each, in order: every knob of
`fuzz.targets.transformers_cb.configs` away from its default in at least one config, and
the pairs that stress the cache together (small pages x chunked prefill, a small KV cache
x each scheduler, block sharing off). A config the library refuses is planned like any
other and counted as unsupported with the library's message (async batching and CPU offloading on
the CPU);
on CUDA the graph, async and flash knobs are planned too (flash where a flash kernel
imports). Every plan has bf16 configs: the CUDA plan is bf16 throughout, the CPU plan ends
with one."""
from __future__ import annotations

from engine.config import EngineConfig
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions, small_kv
from fuzz.targets.vllm.configs import _fit


def _cfg(base: EngineConfig, page: int, budget: int, seqs: int = 8) -> EngineConfig:
    return _fit(base.replace(block_size=page, max_num_batched_tokens=budget, max_num_seqs=seqs))


def cpu_plan(base: EngineConfig = CB_MODEL) -> list[tuple[EngineConfig, CBOptions]]:
    small, short = small_kv, base.replace(max_model_len=64)  # short: a small cache is full more often
    return [
        (_cfg(base, 4, 128), CBOptions()),
        # Refused off CUDA, counted unsupported; early, since a refusal costs the live worker nothing.
        (_cfg(base, 4, 128), CBOptions(async_batching=True)),
        (_cfg(short, 8, 32), CBOptions(kv_blocks=small(_cfg(short, 8, 32)), cpu_offload=0.01)),
        (_cfg(base, 4, 16), CBOptions(attn="paged|eager")),
        (_cfg(short, 8, 32, 4), CBOptions(kv_blocks=small(_cfg(short, 8, 32)), scheduler="prefill_first")),
        (_cfg(base, 16, 64, 2), CBOptions(attn="paged|eager", block_sharing=False)),
        (_cfg(short, 4, 16), CBOptions(kv_blocks=small(_cfg(short, 4, 16)))),
        (_cfg(base, 32, 128), CBOptions(attn="eager", scheduler="prefill_first")),
        (_cfg(base, 8, 24, 3), CBOptions(attn="paged|sdpa", cuda_graph=True)),
        # A cache smaller than the longest request (half of max_model_len): the library has no
        # admission check for it (what it does then is a finding, docs/transformers_cb.md).
        (_cfg(base, 8, 32), CBOptions(kv_blocks=base.max_model_len // 16)),
        # bf16, checked by the measured-noise rule (fuzz.verdict.tolerance.BLACKBOX_HALF_RULES).
        (_cfg(base.replace(dtype="bfloat16"), 8, 16), CBOptions()),
    ]


def cuda_plan(base: EngineConfig, flash: bool) -> list[tuple[EngineConfig, CBOptions]]:
    """On a GPU: bf16, graphs on and off, async batching, and the flash kernel if it imports."""
    b = base.replace(device="cuda", dtype="bfloat16")
    attn = "flash_attention_2" if flash else "sdpa"
    return [
        (_cfg(b, 4, 128), CBOptions(attn=attn)),
        (_cfg(b, 4, 16), CBOptions(attn=attn, cuda_graph=True)),
        (_cfg(b, 8, 32, 4), CBOptions(attn=attn, cuda_graph=True, async_batching=True,
                                      kv_blocks=small_kv(_cfg(b, 8, 32)))),
        (_cfg(b, 16, 64), CBOptions(attn="paged|eager", cuda_graph=False)),
        (_cfg(b, 4, 16), CBOptions(attn="sdpa", cuda_graph=True, scheduler="prefill_first")),
        (_cfg(b, 8, 128), CBOptions(attn=attn, async_batching=False, block_sharing=False)),
        (_cfg(b, 8, 32), CBOptions(attn=attn, kv_blocks=small_kv(_cfg(b, 8, 32)), cpu_offload=0.01)),
    ]


def flash_available() -> bool:
    from transformers.utils.import_utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def campaign_configs(device: str = "cpu", count: int | None = None, base: EngineConfig = CB_MODEL) -> list:
    from fuzz.errors import BadInput

    plan = cpu_plan(base) if device == "cpu" else cuda_plan(base, flash_available())
    if count is not None and count < 1:
        raise BadInput(f"--configs: {count} is not a positive number of configs")
    return plan[:count] if count is not None else plan
