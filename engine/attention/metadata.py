"""CommonAttentionMetadata, its builder, and the per-forward attention context.

The metadata pairs device tensors (views of the runner's persistent buffers) with host
scalars computed from the same step. Keeping the two in step is exactly what the field bugs
break (field notes 1, 2, 12), so every attention call can leave an `FACallRecord` that
snapshots what the kernel was handed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.reference import reshape_and_cache, varlen_attention


@dataclass(slots=True)
class CommonAttentionMetadata:
    """What every attention backend needs for one step (vLLM v1 names)."""

    query_start_loc: torch.Tensor  # [num_reqs_padded + 1] int32
    seq_lens: torch.Tensor  # [num_reqs_padded] int32 (key length per request)
    block_table_tensor: torch.Tensor  # [num_reqs_padded, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens_padded] int64, -1 = no write
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True


@dataclass(slots=True)
class FACallRecord:
    """One attention call as the kernel saw it (cheap: int tensors are small clones)."""

    rank: int
    layer: int
    microbatch: int
    graph: bool  # replayed from a captured graph
    q_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    kv_shape: tuple[int, ...]
    kv_stride: tuple[int, ...]
    dtype: str
    device: str
    max_seqlen_q: int
    max_seqlen_k: int
    num_reqs: int
    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


class AttentionMetadataBuilder:
    """Builds the step's metadata from the runner's persistent device buffers."""

    def build(self, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
              num_actual_tokens: int, max_query_len: int, max_seq_len: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table_tensor=block_table,
            slot_mapping=slot_mapping, num_reqs=num_reqs, num_actual_tokens=num_actual_tokens,
            max_query_len=max_query_len, max_seq_len=max_seq_len)


@dataclass
class AttentionContext:
    """Callable handed to the model for one forward: writes KV, runs the backend, records."""

    md: CommonAttentionMetadata
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    rank: int = 0
    microbatch: int = 0
    graph: bool = False
    tile_q: int | None = None
    records: list | None = None  # append FACallRecords here when not None
    _snapshot: tuple | None = field(default=None, repr=False)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.md
        k_cache, v_cache = self.kv_caches[layer]
        reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
        if self.records is not None:
            self.records.append(self._record(layer, q, k_cache))
        return varlen_attention(q, k_cache, v_cache, md.query_start_loc, md.max_query_len,
                                md.seq_lens, md.max_seq_len, md.block_table_tensor, self.scale,
                                causal=md.causal, tile_q=self.tile_q)

    def _record(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor) -> FACallRecord:
        md = self.md
        if self._snapshot is None:  # one copy per forward, shared by its layers' records
            self._snapshot = tuple(t.detach().to("cpu", copy=True) for t in (
                md.query_start_loc, md.seq_lens, md.block_table_tensor, md.slot_mapping))
        cu, sl, bt, sm = self._snapshot
        return FACallRecord(
            rank=self.rank, layer=layer, microbatch=self.microbatch, graph=self.graph,
            q_shape=tuple(q.shape), q_stride=tuple(q.stride()), kv_shape=tuple(k_cache.shape),
            kv_stride=tuple(k_cache.stride()), dtype=str(q.dtype).removeprefix("torch."),
            device=str(q.device), max_seqlen_q=int(md.max_query_len), max_seqlen_k=int(md.max_seq_len),
            num_reqs=md.num_reqs, num_actual_tokens=md.num_actual_tokens, cu_seqlens_q=cu,
            seqused_k=sl, block_table=bt, slot_mapping=sm, causal=md.causal)
