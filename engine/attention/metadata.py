"""CommonAttentionMetadata, its builder, and the per-forward attention context.

The metadata pairs device tensors (views of the runner's persistent buffers) with host
scalars computed from the same step. Keeping the two in step is exactly what the field bugs
break (docs/bug_classes.md#graph_stale_max_seqlen, #pp_shared_staging_buffer,
#capture_metadata_baked), so every attention call can leave an `FACallRecord` that
snapshots what the kernel was handed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Also registers torch.ops.llmfuzz.* (AttentionContext calls them). FACallRecord is
# defined there, beside the op that records it, so that module needs nothing of this one.
from engine.custom_ops import AttentionSink, FACallRecord, attend, tracing  # noqa: F401  (FACallRecord: re-exported)


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


class AttentionMetadataBuilder:
    """Builds the step's metadata from the runner's persistent device buffers."""

    def build_for_cudagraph_capture(self, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                    block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                    num_tokens: int, num_reqs: int, max_model_len: int) -> CommonAttentionMetadata:
        """Metadata a graph is captured with. Its scalars are baked into the graph, so they
        must hold for every batch later replayed at this size: max_query_len is the padded
        token count (no query can be longer) and max_seq_len is max_model_len. The tensors
        are the static buffers themselves, read afresh at every replay."""
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table_tensor=block_table,
            slot_mapping=slot_mapping, num_reqs=num_reqs, num_actual_tokens=num_tokens,
            max_query_len=num_tokens, max_seq_len=max_model_len)

    def build(self, *, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
              num_actual_tokens: int, max_query_len: int, max_seq_len: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table_tensor=block_table,
            slot_mapping=slot_mapping, num_reqs=num_reqs, num_actual_tokens=num_actual_tokens,
            max_query_len=max_query_len, max_seq_len=max_seq_len)


@dataclass(slots=True)
class AttentionContext:
    """Callable handed to the model for one forward: every layer's attention is
    `engine.custom_ops.attend` (KV write, record, the sink's backend), called directly in
    eager mode and through the `llmfuzz::unified_attention` op while a graph is traced."""

    md: CommonAttentionMetadata
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]
    scale: float
    sink: AttentionSink  # the runner's: its backend, records and live batch

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = int(self.md.num_actual_tokens)
        if n < q.shape[0]:
            # Padding rows (sequence parallelism rounds the tokens up to a multiple of tp) do
            # not go to the kernel, as in vLLM: FA2 assumes q has exactly `num_reqs` rows
            # when max_seqlen_q == 1 (its GQA ngroups swap) and fails on a padded decode.
            out = q.new_zeros(q.shape)
            out[:n] = self._attend(layer, q[:n], k[:n], v[:n], self.md.slot_mapping[:n])
            return out
        return self._attend(layer, q, k, v, self.md.slot_mapping)

    def _attend(self, layer: int, q, k, v, slot_mapping) -> torch.Tensor:
        md = self.md
        k_cache, v_cache = self.kv_caches[layer]
        args = (q, k, v, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_table_tensor,
                slot_mapping, int(md.max_query_len), int(md.max_seq_len), self.scale)
        if tracing():
            # The op, so the graph records the call; it takes the sink by its int key.
            return torch.ops.llmfuzz.unified_attention(*args, self.sink.key, layer)
        return attend(*args, self.sink, layer)
