"""The attention backends, and the one place that chooses among them (vLLM's backend selector).

A backend class has a `name` (the config's `attention_backend`), a requirement beyond the
config's device and dtype rules (`unavailable`: a package this process cannot import) and a
kernel entry (`forward`, with the signature of the reference kernel). `get_attn_backend`
resolves the config's choice; each rank's runner resolves it once and hands the class to its
attention sinks, and the attention op (`engine.custom_ops.attend`) calls
`sink.attn_backend.forward`. `LLMEngine` resolves it before starting any rank, so a backend
that cannot run here is a one-line ConfigError in the driver.

Each `forward` looks its kernel up on the kernel's module at every call --
`engine.custom_ops.varlen_attention`, `engine.attention.torch_flash.torch_flash_varlen`,
and through `engine.attention.flash_attn_backend` the flash-attn package's
`flash_attn_varlen_func` -- so a wrapper put on that module attribute (the FA guard's) sees
every call the engine makes.
"""
from __future__ import annotations

import abc
from typing import ClassVar

import torch

from engine import custom_ops
from engine.attention import flash_attn_backend, torch_flash
from engine.config import ConfigError, EngineConfig


class AttentionBackend(abc.ABC):
    """One kernel family behind the attention op. Used as the class itself: no state."""

    name: ClassVar[str]

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this process cannot run the kernel (the one-line ConfigError message), or None."""
        return None

    @staticmethod
    @abc.abstractmethod
    def forward(sink: custom_ops.AttentionSink, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int,
                block_table: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        """Causal varlen attention of q over the paged cache; `sink` is the calling runner's."""


class ReferenceBackend(AttentionBackend):
    """The CPU/GPU reference kernel (engine/attention/reference.py): any device and float
    dtype, FA2's row tiling and the runner's output memory, so its bugs show as FA's do."""

    name = "reference"

    @staticmethod
    def forward(sink, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                softmax_scale):
        return custom_ops.varlen_attention(
            q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
            softmax_scale, causal=True, tile_q=sink.tile_q, key_len_pad=sink.key_len_pad,
            out=sink.output_memory(q), plans=sink.plans)


class TorchFlashBackend(AttentionBackend):
    """PyTorch's FlashAttention-2 varlen kernel (engine/attention/torch_flash.py); CUDA only."""

    name = "torch_flash"

    @staticmethod
    def forward(sink, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                softmax_scale):
        return torch_flash.torch_flash_varlen(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k,
                                              max_seqlen_k, block_table, softmax_scale)


class FlashAttnBackend(AttentionBackend):
    """The flash-attn package (engine/attention/flash_attn_backend.py): flash-attn-4, else
    FlashAttention-2; CUDA only, and only where the package is importable."""

    name = "flash_attn"

    @classmethod
    def unavailable(cls) -> str | None:
        return flash_attn_backend.missing_message() if flash_attn_backend.probe() is None else None

    @staticmethod
    def forward(sink, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                softmax_scale):
        return flash_attn_backend.flash_attn_varlen(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k,
                                                    max_seqlen_k, block_table, softmax_scale)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (ReferenceBackend, TorchFlashBackend, FlashAttnBackend)}


def get_attn_backend_cls(name: str) -> type[AttentionBackend]:
    """The backend registered as `name`; ConfigError (one line) when there is none or this
    process cannot run it."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise ConfigError(f"attention_backend: {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    why = backend.unavailable()
    if why is not None:
        raise ConfigError(why)
    return backend


def get_attn_backend(config: EngineConfig) -> type[AttentionBackend]:
    """The backend of `config` (whose own checks passed: the name, CUDA, fp16/bf16)."""
    return get_attn_backend_cls(config.attention_backend)
