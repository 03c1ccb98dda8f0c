"""CUDAGraphRunner: capture, baked scalars and replay of one rank's forward (FULL graph mode).

A captured graph freezes the Python scalars of its capture (max_seqlen_q/k, num_reqs, the
padded shape) and reads everything else from the static buffers at each replay
(engine/cuda_graph.py). What it bakes must hold for every batch later replayed at its size:
baking the scalars of the batch that triggered the capture is
docs/bug_classes.md#graph_stale_max_seqlen and docs/bug_classes.md#capture_metadata_baked.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch

from engine.attention.fa_contract import check_varlen_args
from engine.attention.metadata import AttentionMetadataBuilder, CommonAttentionMetadata, FACallRecord
from engine.config import EngineConfig
from engine.cpu_graph import CaptureSpec, tensor_slots
from engine.cuda_graph import BatchDescriptor, GraphStore
from engine.custom_ops import AttentionSink
from engine.faults import CAPTURE_FAULTS, CAPTURE_METADATA_BAKED, GRAPH_STALE_MAX_SEQLEN, FaultSet
from engine.input_prep import InputBuffers, PreparedBatch
from engine.model import LlamaForCausalLM

NOT_READ_BY_FORWARD = ("seed", "model_path", "weights_dtype", "num_gpu_blocks", "max_num_seqs",
                       "max_num_batched_tokens", "enable_chunked_prefill", "broadcast_pp_output",
                       "world", "capture_sizes", "cudagraph_mode", "step_timeout_s",
                       "speculative_method", "num_speculative_tokens")


def check_before_replay(rec: FACallRecord) -> None:
    """The FA varlen contract on one replay's host-side record; raises FAInvariantError.
    (The same contract the harness and the llmfuzz guard check, from its engine-side home.)"""
    check_varlen_args(**rec.varlen_args())


class CUDAGraphRunner:
    """One rank's captured graphs: which scalars each bakes, capture on first use, replay.
    `forward(md, input_ids, positions, hidden, residual)` is the function graphs capture."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, model: LlamaForCausalLM, kv_caches: dict,
                 bufs: InputBuffers, builder: AttentionMetadataBuilder, sink: AttentionSink,
                 forward: Callable, with_drafter: bool, sink_key: int,
                 forward_scalars: Callable[[], tuple]) -> None:
        self.cfg, self.faults, self.model, self.kv_caches = cfg, faults, model, kv_caches
        self.bufs, self.builder, self.sink, self.forward = bufs, builder, sink, forward
        self.with_drafter, self.sink_key = with_drafter, sink_key
        # Python values of the runner the forward reads (the attention scale): part of the
        # key a trace is shared under, since a trace bakes them.
        self.forward_scalars = forward_scalars
        self.graphs = GraphStore(cfg.device)
        self._baked: dict[BatchDescriptor, tuple[int, int, int]] = {}  # what each graph froze
        self._graph_key: tuple | None = None

    def reset(self, run_end: int) -> None:
        """Captured graphs survive resets (capture is expensive) unless what they froze may
        differ: a fault that changes what is baked (then the Case's own first batches must
        capture, so its verdict never depends on earlier Cases) or a changed layer loop."""
        capture_faults = self.faults.names & CAPTURE_FAULTS
        graph_key = (run_end, capture_faults)
        if capture_faults or self._graph_key not in (None, graph_key):
            self.graphs.clear()
            self._baked.clear()
        self._graph_key = graph_key

    def run(self, pb: PreparedBatch, hidden, residual):
        """Replay the graph of pb's padded size (captured on first use) on the static buffers."""
        desc, b = pb.graph, self.bufs
        T = desc.num_tokens
        if desc not in self._baked:
            max_q, max_k, num_reqs = self._capture_bounds(pb, desc)
            self._baked[desc] = (max_q, max_k, self._capture_num_reqs(pb, num_reqs))
        max_q, max_k, R = self._baked[desc]
        bufs = [b.query_start_loc.gpu[:R + 1], b.seq_lens.gpu[:R], b.block_table[:R],
                b.slot_mapping.gpu[:T], b.input_ids.gpu[:T], b.positions.gpu[:T], hidden, residual]

        def fn(qsl, sl, bt, sm, ids, pos, h, r):
            md = CommonAttentionMetadata(qsl, sl, bt, sm, R, T, max_q, max_k)
            return self.forward(md, ids, pos, h, r)

        graph = self._get_or_capture(desc, fn, bufs)
        if self.cfg.device.startswith("cuda") and self.sink.records is not None:
            # Host code inside the graph does not replay: record the host-side metadata, and
            # check it before the launch, since a replay with bad metadata can fault the
            # CUDA context (illegal address) before any check after the run could report it.
            records = self.sink.records
            n = len(records)
            self._record_host(pb, (max_q, max_k), T, R)
            if len(records) > n:
                check_before_replay(records[n])
        return graph(*bufs)

    def _capture_bounds(self, pb: PreparedBatch, desc: BatchDescriptor) -> tuple[int, int, int]:
        """max_seqlen_q, max_seqlen_k and num_reqs a graph of this size bakes: bounds valid
        for every batch it will replay (build_for_cudagraph_capture)."""
        if self.faults.on(GRAPH_STALE_MAX_SEQLEN):
            # docs/bug_classes.md#graph_stale_max_seqlen: the scalars of the batch that
            # happened to trigger the capture.
            return pb.max_query_len, pb.max_seq_len, desc.num_reqs
        b = self.bufs
        d = self.builder.build_for_cudagraph_capture(
            query_start_loc=b.query_start_loc.gpu, seq_lens=b.seq_lens.gpu,
            block_table=b.block_table, slot_mapping=b.slot_mapping.gpu,
            num_tokens=desc.num_tokens, num_reqs=desc.num_reqs, max_model_len=self.cfg.max_model_len)
        return d.max_query_len, d.max_seq_len, d.num_reqs

    def _capture_num_reqs(self, pb: PreparedBatch, num_reqs: int) -> int:
        """The padded request count: padded rows are inert, so a replay computes every real
        request however many the capturing batch had."""
        if self.faults.on(CAPTURE_METADATA_BAKED):
            return pb.num_reqs  # docs/bug_classes.md#capture_metadata_baked
        return num_reqs

    def _get_or_capture(self, desc: BatchDescriptor, fn: Callable, bufs: list) -> Callable:
        records, self.sink.records = self.sink.records, None  # capture runs are not calls
        try:
            spec = None
            if desc not in self.graphs.graphs and not self.cfg.device.startswith("cuda"):
                spec = self._capture_spec(desc)
            return self.graphs.get_or_capture(desc, fn, bufs, spec)
        finally:
            self.sink.records = records

    def _capture_spec(self, desc: BatchDescriptor) -> CaptureSpec:
        """The rank state a CPU capture reads, and the key of its code path: one trace
        serves every rank and pooled engine whose forward reads the same Python values."""
        m, g = self.model, self.model.g
        live = [layer for layer in m.layers[m.start:m.end]]
        slots = tuple(tensor_slots(m, *live, self.kv_caches))
        roles = {self.sink_key: "sink", g.tp.op_key: "tp", g.pp.op_key: "pp", g.world.op_key: "world"}
        # Config fields the forward never reads (its tensors are inputs, scheduling and
        # capture policy happen outside it): engines differing only in them share traces.
        forward_cfg = tuple((f.name, getattr(self.cfg, f.name)) for f in fields(self.cfg)
                            if f.name not in NOT_READ_BY_FORWARD)
        # And every Python scalar the model and its layers hold (layer range, head counts).
        # The rank's TP coordinates are tensors the forward reads (LlamaForCausalLM), so the
        # TP ranks of a stage share one trace.
        held = tuple((k, v) for o in (m, *live) for k, v in vars(o).items()
                     if isinstance(v, (int, float, str, torch.dtype)))
        key = (forward_cfg, held, self.with_drafter,
               desc, self._baked[desc], self.faults.names, self.forward_scalars())
        return CaptureSpec(slots, roles, key)

    def _record_host(self, pb: PreparedBatch, baked, T: int, R: int) -> None:
        from engine.custom_ops import _record

        b = self.bufs
        q = torch.empty(T, self.model.layers[self.model.start].num_heads, self.cfg.head_dim,
                        dtype=self.cfg.torch_dtype(), device="meta")
        # The device buffers, not the host staging: with PP the host may already have
        # prepared the next microbatch into the staging buffers.
        for layer, (k_cache, _) in self.kv_caches.items():
            self.sink.records.append(_record(
                self.sink, layer, q, k_cache, b.query_start_loc.gpu[:R + 1], b.seq_lens.gpu[:R],
                b.block_table[:R], b.slot_mapping.gpu[:T], baked[0], baked[1]))
