"""The `torch_flash` attention backend: PyTorch's FlashAttention-2 varlen kernel (GPU only).

`torch.ops.aten._flash_attention_forward` behind the reference kernel's signature. It has no
paged KV, so keys are first gathered through the block table into a [batch * max_seqlen_k]
layout with `seqused_k` giving each sequence's real length: no host sync, so it captures
into a CUDA graph. It computes keys below max_seqlen_k only, and only the query rows below
max_seqlen_q (in 128-row tiles), so an understated scalar shows up as garbage rows, exactly
the field bug. (flash-attn-4, the `flash_attn` backend, takes max_seqlen_q as a hint and
computes every row: README, "What a kernel cannot show".)

The backend (engine/attention/selector.py) calls `torch_flash_varlen` by this module's name
at every call, so a wrapper put on it here sees every call.
"""
from __future__ import annotations

import torch


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  max_seqlen_k: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] -> [B * max_seqlen_k, H, D]; positions past a sequence's
    length read the null block (masked by seqused_k in the kernel)."""
    B = seq_lens.shape[0]
    bs, H, D = cache.shape[1], cache.shape[2], cache.shape[3]
    p = torch.arange(max_seqlen_k, device=cache.device)
    valid = p[None, :] < seq_lens[:B, None].long()
    col = (p // bs).clamp(max=block_table.shape[1] - 1)
    blocks = torch.where(valid, block_table[:B].long()[:, col], torch.zeros_like(valid, dtype=torch.long))
    slots = blocks * bs + (p % bs)[None, :]
    return cache.view(-1, H, D)[slots.reshape(-1)]


def torch_flash_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor,
                       max_seqlen_k: int, block_table: torch.Tensor, softmax_scale: float,
                       causal: bool = True) -> torch.Tensor:
    B = cu_seqlens_q.shape[0] - 1
    k = _gather_paged(k_cache, block_table, seqused_k, max_seqlen_k)
    v = _gather_paged(v_cache, block_table, seqused_k, max_seqlen_k)
    cu_k = torch.arange(B + 1, device=q.device, dtype=torch.int32) * max_seqlen_k
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q.int(), cu_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False,
        scale=softmax_scale, seqused_k=seqused_k[:B].int())[0]
    return out
