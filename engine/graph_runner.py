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

from engine import cpu_graph
from engine.attention.fa_contract import check_varlen_args
from engine.attention.metadata import AttentionMetadataBuilder, CommonAttentionMetadata, FACallRecord
from engine.config import EngineConfig
from engine.cuda_graph import GraphStore
from engine.custom_ops import AttentionSink
from engine.faults import CAPTURE_FAULTS, CAPTURE_METADATA_BAKED, GRAPH_STALE_MAX_SEQLEN, FaultSet
from engine.input_prep import InputBuffers
from engine.model import LlamaForCausalLM
from engine.outputs import BatchDescriptor, PreparedBatch

# Config fields a captured forward does not bake. max_model_len and block_size reach it only
# through the attention op: the baked max_seqlen_k (a lifted input of the layer trace), the
# sink's key-work pad and the KV cache's shape, all read by the op at replay.
NOT_READ_BY_FORWARD = ("seed", "model_path", "weights_dtype", "num_gpu_blocks", "max_num_seqs",
                       "max_num_batched_tokens", "enable_chunked_prefill", "broadcast_pp_output",
                       "world", "capture_sizes", "cudagraph_mode", "step_timeout_s",
                       "speculative_method", "num_speculative_tokens", "max_model_len", "block_size")


def check_before_replay(rec: FACallRecord) -> None:
    """The FA varlen contract on one replay's host-side record; raises FAInvariantError.
    (The same contract the harness and the llmfuzz guard check, from its engine-side home.)"""
    check_varlen_args(**rec.varlen_args())


class CUDAGraphRunner:
    """One rank's captured graphs: which scalars each bakes, capture on first use, replay.
    `parts` is the model runner: a GPU graph captures its `_forward(md, input_ids, positions,
    hidden, residual)` whole, a CPU capture its `forward_in`, layers and `forward_out`."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, model: LlamaForCausalLM, kv_caches: dict,
                 bufs: InputBuffers, builder: AttentionMetadataBuilder, sink: AttentionSink,
                 parts, with_drafter: bool, forward_scalars: Callable[[], tuple]) -> None:
        self.cfg, self.faults, self.model, self.kv_caches = cfg, faults, model, kv_caches
        self.bufs, self.builder, self.sink, self.parts = bufs, builder, sink, parts
        self.with_drafter = with_drafter
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
            # Each run makes its own launch plan (engine/attention/reference.py): a GPU capture
            # runs fn to warm up and then to capture, on the same buffers, and a plan reused
            # from the warm-up is made outside the graph: every replay would read the warm-up
            # batch's plan (on a GPU, graph != eager at tp1pp2).
            self.sink.plans.clear()
            md = CommonAttentionMetadata(qsl, sl, bt, sm, R, T, max_q, max_k)
            return self.parts._forward(md, ids, pos, h, r)

        graph = self._get_or_capture(desc, fn, bufs, (R, T, max_q, max_k))
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

    def _get_or_capture(self, desc: BatchDescriptor, fn: Callable, bufs: list, md_args: tuple) -> Callable:
        records, self.sink.records = self.sink.records, None  # capture runs are not calls
        try:
            return self.graphs.get_or_capture(desc, fn, bufs, lambda: self._capture_cpu(desc, bufs, md_args))
        finally:
            self.sink.records = records

    def _capture_cpu(self, desc: BatchDescriptor, bufs: list, md_args: tuple) -> Callable:
        """A CPU capture, part by part (engine/cpu_graph.py): what comes before the stage's
        layers, each live layer, what comes after; the replay runs them in the forward's
        order. Each part is a trace with the scalars of this capture baked in, and the layer
        list is fixed here, as a CUDA graph fixes its kernels. A layer's trace is keyed by its
        code path, not by its index or stage, so every layer of every stage, TP rank and
        pooled engine with the same shapes, options and baked scalars replays one trace: a
        pp8 capture traces one layer, not eight (tracing each would be 84 % of a cold pp8
        capture's time, measured)."""
        p, m, g = self.parts, self.model, self.model.g
        qsl, sl, bt, sm, ids, pos, h, r = bufs
        roles = {"sink": self.sink.key, "tp": g.tp.op_key, "pp": g.pp.op_key, "world": g.world.op_key}
        # The scalars this capture bakes reach the forward only as attention-op arguments:
        # lifted to inputs of the layer trace (replayed with this capture's values), they
        # leave it shareable by every capture of the same padded token count.
        _, _, max_q, max_k = md_args
        scalar_roles = {"max_seqlen_q": max_q, "max_seqlen_k": max_k}
        key = self._share_key(desc)
        # Python scalars each part reads. The model's layer range is read by none of them
        # (the layer loop is here), so the stages' `forward_in`/`forward_out` share traces too.
        held_m = tuple(kv for kv in _scalars(m) if kv[0] not in ("start", "end", "run_end"))
        model_slots = tuple(cpu_graph.tensor_slots(m))
        first = cpu_graph.capture(p.forward_in, [ids, pos, h, r],
                                  cpu_graph.CaptureSpec(model_slots, roles, key + ("in", held_m)))
        hidden, residual, cos, sin = cpu_graph.output_examples(first)
        md_bufs = [qsl, sl, bt, sm]
        layers = []
        for layer in m.live_layers():
            # Positions are an input only to keep the layer's signature; a layer reads them
            # through cos/sin.
            def run_layer(qsl, sl, bt, sm, pos, h, r, cos, sin, layer=layer):
                md = CommonAttentionMetadata(qsl, sl, bt, sm, *md_args)
                return layer.forward(pos, h, r, cos, sin, p.attention(md))
            held = tuple(kv for kv in _scalars(layer) if kv[0] != "idx")
            spec = cpu_graph.CaptureSpec(tuple(cpu_graph.tensor_slots(layer)) + (cpu_graph.Slot(self.kv_caches, layer.idx),),
                                         {**roles, **scalar_roles, "layer": layer.idx},
                                         key + ("layer", held, residual is None))
            layers.append(cpu_graph.capture(run_layer, md_bufs + [pos, hidden, residual, cos, sin], spec))
            hidden, residual = cpu_graph.output_examples(layers[-1])
        last = cpu_graph.capture(p.forward_out, [hidden, residual],
                                 cpu_graph.CaptureSpec(model_slots, roles, key + ("out", held_m, self.with_drafter)))

        def replay(qsl, sl, bt, sm, ids, pos, h, r):
            hidden, residual, cos, sin = first(ids, pos, h, r)
            for layer in layers:
                hidden, residual = layer(qsl, sl, bt, sm, pos, hidden, residual, cos, sin)
            return last(hidden, residual)
        return replay

    def _share_key(self, desc: BatchDescriptor) -> tuple:
        """What every part of a capture bakes into its trace: config fields the forward reads
        (its tensors are inputs; scheduling and capture policy happen outside it, so engines
        differing only in those share traces), the padded token count, the faults and the
        runner's own Python values (the attention scale). Not the padded request count nor
        the baked max_seqlen_q/k: those reach only the attention op (the request count as the
        length of the metadata buffers it reads, the scalars as lifted inputs); a trace is
        reused only where the inputs its aten ops read have its shapes (cpu_graph)."""
        forward_cfg = tuple((f.name, getattr(self.cfg, f.name)) for f in fields(self.cfg)
                            if f.name not in NOT_READ_BY_FORWARD)
        return (forward_cfg, desc.num_tokens, self.faults.names, self.forward_scalars())

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


def _scalars(obj) -> tuple:
    """The Python scalars an object holds (a trace bakes those it reads)."""
    return tuple((k, v) for k, v in vars(obj).items() if isinstance(v, (int, float, str, torch.dtype)))
