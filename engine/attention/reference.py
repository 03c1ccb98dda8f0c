"""Reference attention backend: paged varlen attention in pure torch, FA contract taken literally.

It computes what FlashAttention-2 launches, from the scalars it is given. FA2 launches
ceil(max_seqlen_q / tile) row tiles per sequence (`FA2_PAGED_TILE_Q` = 64 rows with paged
KV) and loops over each sequence's own key blocks (`seqused_k`), whatever `max_seqlen_k`
says; it writes only the rows it launched, so every other row of the output keeps what
that memory held before -- stale, finite values on a GPU. So does this backend, given the
output memory (`out`): an understated max_seqlen_q changes a result only where a GPU's would
change, in whole tiles, and those rows hold whatever the memory held (finite garbage, or NaN
only when the engine's reset left NaN there: engine/poison.py).
`tile_q=None` cuts rows at max_seqlen_q exactly (for unit tests); without `out` the rows
not computed are NaN. Keys are read within a work width of max(max_seqlen_k, key_len_pad):
the engine pads it to max_model_len, so there an understated max_seqlen_k changes nothing,
as on the GPU (only the invariant check sees it); without the pad, keys past max_seqlen_k
fall outside the work and are dropped. Keys are gathered through the block table only below each
sequence's `seqused_k`, so poisoned or out-of-range entries past the live batch are never
touched.
"""
from __future__ import annotations

import torch

FA2_PAGED_TILE_Q = 64  # query rows per FA2 thread block with a paged KV cache (kBlockM)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's k/v to its slot; slot -1 (padding) writes nothing.

    On CUDA the -1 slots are redirected into the null block 0 instead of being filtered:
    filtering needs a device-to-host sync, which a CUDA graph capture forbids, and block 0
    is never read for a live token (its poison must only stay finite, which k/v are)."""
    n = min(k.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    k, v = k[:n], v[:n]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k.is_cuda:
        valid = (slots >= 0)[:, None, None]
        slots = torch.where(slots >= 0, slots, torch.zeros_like(slots))
        # Padded rows may hold NaN (poisoned inputs); the null block must stay finite.
        k = torch.where(valid, k, torch.zeros_like(k))
        v = torch.where(valid, v, torch.zeros_like(v))
    else:
        keep = (slots >= 0).nonzero().squeeze(1)
        k, v, slots = k[keep], v[keep], slots[keep]
    flat_k[slots] = k
    flat_v[slots] = v


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor,
                     max_seqlen_k: int, block_table: torch.Tensor, softmax_scale: float,
                     causal: bool = True, tile_q: int | None = None,
                     key_len_pad: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].

    `out`: the output memory, [>= T, Hq, D]. The computed rows are written into it, as the
    kernel writes its output buffer, and rows not launched keep its earlier contents.

    Work shapes are padded (query rows to a multiple of 16, keys to `key_len_pad`) so a
    row's result does not depend on the batch's other sequences or on the scalars beyond
    what they include: eager and padded graph runs agree bitwise."""
    T, Hq, D = q.shape
    res = _varlen_rows(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                       block_table, softmax_scale, causal, tile_q, key_len_pad,
                       torch.full_like(q, float("nan")) if out is None else out[:T].to(q.dtype, copy=True))
    if out is not None:
        out[:T].copy_(res)
    return res


def _varlen_rows(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
                 softmax_scale, causal, tile_q, key_len_pad, out: torch.Tensor) -> torch.Tensor:
    """varlen_attention's computation: `out` (a fresh tensor) with the launched rows replaced."""
    T, Hq, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    if B <= 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return out
    dev = q.device
    cu = cu_seqlens_q.to(dev, torch.long)
    q_lens = cu[1:] - cu[:-1]
    k_lens = seqused_k[:B].to(dev, torch.long)
    rows = max_seqlen_q if tile_q is None else -(-max_seqlen_q // tile_q) * tile_q
    Lq_valid, Lk_valid = min(int(rows), T), int(max_seqlen_k)  # no sequence has more than T rows
    Lq = -(-Lq_valid // 16) * 16
    Lk = max(Lk_valid, key_len_pad or 0)
    j, q_valid, q_idx, qb = _gather_queries(q, cu, q_lens, Lq, Lq_valid)
    p, k_valid, kb, vb = _gather_keys(k_cache, v_cache, block_table, k_lens, B, Lk, Hq, D)

    # Accumulate wider than the inputs (fp64 for fp32, fp32 for half): a head's result then
    # does not depend on how many heads or sequences share the call.
    acc = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    scores = torch.einsum("bqhd,bkhd->bhqk", qb.to(acc), kb.to(acc)) * softmax_scale
    allowed = _allowed_keys(k_valid, q_lens, k_lens, j, p, causal)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    res = torch.einsum("bhqk,bkhd->bqhd", probs, vb.to(acc)).to(q.dtype)
    return _scatter_rows(out, res, q_valid, q_idx, T)


def _gather_queries(q: torch.Tensor, cu: torch.Tensor, q_lens: torch.Tensor, Lq: int,
                    Lq_valid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query rows the kernel computes: j < min(q_len, rows) of each sequence.
    Returns (j [Lq], q_valid [B, Lq], q_idx [B, Lq], qb [B, Lq, Hq, D])."""
    T = q.shape[0]
    j = torch.arange(Lq, device=q.device)
    q_valid = j[None, :] < torch.clamp(q_lens, max=Lq_valid)[:, None]  # [B, Lq]
    q_idx = torch.where(q_valid, cu[:-1, None] + j[None, :], torch.zeros_like(j)[None, :])
    q_idx = q_idx.clamp(0, max(T - 1, 0))
    qb = q[q_idx]  # [B, Lq, Hq, D]
    return j, q_valid, q_idx, qb


def _gather_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 k_lens: torch.Tensor, B: int, Lk: int, Hq: int,
                 D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys the kernel reads: p < seqused_k within the work width Lk, page by page.
    Returns (p [Lk], k_valid [B, Lk], kb and vb [B, Lk, Hq, D])."""
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    dev = k_lens.device
    p = torch.arange(Lk, device=dev)
    k_valid = p[None, :] < torch.clamp(k_lens, max=Lk)[:, None]  # [B, Lk]
    col = (p // bs).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[:B].to(dev, torch.long)[:, col]  # [B, Lk]
    blocks = torch.where(k_valid, blocks, torch.zeros_like(blocks))
    slots = blocks * bs + (p % bs)[None, :]
    kb = k_cache.view(-1, Hkv, D)[slots]  # [B, Lk, Hkv, D]
    vb = v_cache.view(-1, Hkv, D)[slots]
    if Hq != Hkv:
        kb = kb.repeat_interleave(Hq // Hkv, dim=2)
        vb = vb.repeat_interleave(Hq // Hkv, dim=2)
    return p, k_valid, kb, vb


def _allowed_keys(k_valid: torch.Tensor, q_lens: torch.Tensor, k_lens: torch.Tensor, j: torch.Tensor,
                  p: torch.Tensor, causal: bool) -> torch.Tensor:
    """Which keys each query row attends to: [B, 1, Lk], or [B, Lq, Lk] when causal."""
    allowed = k_valid[:, None, :]  # [B, 1, Lk]
    if causal:
        # Query row j sits at absolute position k_len - q_len + j (bottom-right aligned).
        qpos = (k_lens - q_lens)[:, None] + j[None, :]  # [B, Lq]
        allowed = allowed & (p[None, None, :] <= qpos[:, :, None])  # [B, Lq, Lk]
    return allowed


def _scatter_rows(out: torch.Tensor, res: torch.Tensor, q_valid: torch.Tensor, q_idx: torch.Tensor,
                  T: int) -> torch.Tensor:
    """Scatter computed rows back; rows not computed go to a trash row past the end (no
    boolean indexing: that would sync the device and break CUDA graph capture)."""
    Hq, D = out.shape[1], out.shape[2]
    out = torch.cat([out, out[:1]])
    dst = torch.where(q_valid, q_idx, torch.full_like(q_idx, T))
    out.index_put_((dst.reshape(-1),), res.reshape(-1, Hq, D))
    return out[:T]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, contiguous k/v [Lk, Hkv, D], bottom-right causal: the test oracle."""
    Lq, Hq, _ = q.shape
    Lk, Hkv, _ = k.shape
    k = k.repeat_interleave(Hq // Hkv, dim=1).float()
    v = v.repeat_interleave(Hq // Hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    mask = torch.arange(Lk)[None, :] <= (Lk - Lq + torch.arange(Lq))[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(q.dtype)
