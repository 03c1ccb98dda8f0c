"""Real FlashAttention kernels behind the reference backend's signature (GPU only).

`torch_flash`: PyTorch's built-in FlashAttention-2 varlen kernel
(`torch.ops.aten._flash_attention_forward`). It has no paged KV, so keys are first gathered
through the block table into a [batch * max_seqlen_k] layout with `seqused_k` giving each
sequence's real length: no host sync, so it captures into a CUDA graph.

`flash_attn`: the flash-attn package (engine/attention/flash_attn_backend.py):
`flash_attn.cute.flash_attn_varlen_func` (flash-attn-4) on the paged cache through
`page_table`, else FlashAttention-2's `flash_attn.flash_attn_varlen_func`.

Both compute keys below max_seqlen_k only. PyTorch's FA2 kernel also computes only the
query rows below max_seqlen_q (in 128-row tiles), so an understated scalar shows up as
garbage rows, exactly the field bug; flash-attn-4 takes max_seqlen_q as a hint and computes
every row (README, "What a kernel cannot show").
"""
from __future__ import annotations

import torch

from engine.attention.flash_attn_backend import flash_attn_varlen


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


BACKENDS = {"torch_flash": torch_flash_varlen, "flash_attn": flash_attn_varlen}
