"""GPUModelRunner: one rank's persistent state, input preparation and forward (vLLM v1 shape).

A microbatch goes through two phases. `prepare` runs on the host: update request states
from the SchedulerOutput, fill the persistent InputBatch, reorder it, compute the step's
host scalars, write the staging buffers and issue their async copies. `execute` is the
device work: PP receive into persistent buffers, forward, PP send or logits and sampling.
With PP the host may prepare microbatch m+1 before m executes (it runs ahead of the device
in a real engine), which is where the staging-buffer races of
docs/bug_classes.md#pp_shared_staging_buffer live.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.async_copy import AsyncCopier, CopyHandle
from engine.attention.fa_contract import check_varlen_args
from engine.attention.metadata import (AttentionContext, AttentionMetadataBuilder,
                                       CommonAttentionMetadata, FACallRecord)
from engine.config import EngineConfig
from engine.cuda_graph import BatchDescriptor, CudagraphDispatcher, GraphStore
from engine.eagle import EagleInputs, EagleProposer
from engine.custom_ops import AttentionSink, register_sink
from engine.faults import FaultSet
from engine.input_batch import POISON_INT, CachedRequestState, CpuGpuBuffer, InputBatch
from engine.model import IntermediateTensors, LlamaForCausalLM
from engine.parallel_state import RankGroups
from engine.scheduler import SchedulerOutput

# Faults that change what a graph bakes at capture.
CAPTURE_FAULTS = frozenset({"graph_stale_max_seqlen", "capture_metadata_baked"})
KV_POISON = 1.0e4  # finite: paged kernels load whole pages and 0 x NaN would be NaN


@dataclass(slots=True)
class ModelRunnerOutput:
    microbatch: int
    rank: int
    req_ids: list[str]  # requests that sampled this step, in batch order
    sampled_token_ids: list[list[int]]  # per request: argmax of each of its logits rows
    logits: torch.Tensor  # [sum(rows), vocab] fp32 on CPU; 1 row per request, 1 + k with drafts
    num_tokens: dict[str, int]  # per sampled request: tokens this rank knew (engine invariant)
    draft_token_ids: dict[str, list[int]] | None = None  # EAGLE drafts (last PP stage only)


@dataclass(slots=True)
class PreparedBatch:
    microbatch: int
    num_reqs: int
    num_actual_tokens: int
    num_padded_tokens: int
    num_reqs_padded: int
    graph: BatchDescriptor | None  # replay this captured size; None = eager
    max_query_len: int
    max_seq_len: int
    logits_indices: torch.Tensor
    sample_req_ids: list[str]
    sample_rows: list[int]  # logits rows per sampled request (1 + number of drafts)
    num_tokens: dict[str, int]
    eagle: EagleInputs | None = None


def check_before_replay(rec: FACallRecord) -> None:
    """The FA varlen contract on one replay's host-side record; raises FAInvariantError.
    (The same contract the harness and the llmfuzz guard check, from its engine-side home.)"""
    check_varlen_args(**rec.varlen_args())


class GPUModelRunner:
    def __init__(self, cfg: EngineConfig, groups: RankGroups, state_dict: dict,
                 faults: FaultSet, copier: AsyncCopier, record_fa: bool = False) -> None:
        self.cfg, self.g, self.faults, self.copier = cfg, groups, faults, copier
        dev, dtype = cfg.device, cfg.torch_dtype()
        self.model = LlamaForCausalLM(cfg, state_dict, groups).to(dev)
        layer0 = self.model.layers[self.model.start]
        kv_shape = (cfg.num_gpu_blocks, cfg.block_size, layer0.num_kv_heads, cfg.head_dim)
        self.kv_caches = {i: (torch.zeros(kv_shape, dtype=dtype, device=dev),
                              torch.zeros(kv_shape, dtype=dtype, device=dev))
                          for i in range(self.model.start, self.model.end)}
        self.requests: dict[str, CachedRequestState] = {}
        R, T = cfg.max_num_seqs, cfg.max_num_batched_tokens + cfg.tp  # room for SP padding
        self.max_num_tokens = T
        self.input_batch = InputBatch(R, cfg.max_model_len, cfg.max_blocks_per_req,
                                      pin=cfg.device.startswith("cuda"))
        self.input_ids = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.positions = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.query_start_loc = CpuGpuBuffer(R + 1, dtype=torch.int32, device=dev)
        self.seq_lens = CpuGpuBuffer(R, dtype=torch.int32, device=dev)
        self.slot_mapping = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(R, cfg.max_blocks_per_req, dtype=torch.int32, device=dev)
        # Persistent PP receive buffers (sync_and_slice_intermediate_tensors copies into them).
        self.intermediate_tensors = {k: torch.zeros(T, cfg.hidden_size, dtype=dtype, device=dev)
                                     for k in ("hidden_states", "residual")}
        self.builder = AttentionMetadataBuilder()
        self.fa_records: list | None = [] if record_fa else None
        self.sink = AttentionSink(groups.rank, self.fa_records, key_len_pad=cfg.max_model_len,
                                  backend=cfg.attention_backend)
        self.sink_key = register_sink(self.sink)
        self.dispatcher = CudagraphDispatcher(
            cfg.capture_sizes if cfg.cudagraph_mode == "FULL" else (), R,
            multiple_of=cfg.tp if cfg.sequence_parallel else 1)
        self.graphs = GraphStore(dev)
        self._baked: dict[BatchDescriptor, tuple[int, int, int]] = {}  # what each graph froze
        self._stale_logits: torch.Tensor | None = None
        self._staging_copies: list[CopyHandle] = []
        self.scale = cfg.head_dim ** -0.5
        # EAGLE drafts from the target's hidden states, which exist on the last stage only.
        self.drafter = EagleProposer(cfg, state_dict, groups.rank, self.fa_records) \
            if cfg.speculative_method == "eagle" and self.model.is_last else None

    # -- reset between Cases ---------------------------------------------------------------
    def reset(self) -> None:
        """Forget all requests and poison every persistent buffer, so a stale read fails
        inside the Case that makes it."""
        self.copier.synchronize()
        self.requests.clear()
        self.input_batch.clear()
        self.input_batch.token_ids.fill_(POISON_INT)
        self.input_batch.block_table.table.fill_(POISON_INT)
        for buf in (self.input_ids, self.positions, self.query_start_loc, self.seq_lens, self.slot_mapping):
            buf.poison()
        self.block_table.fill_(POISON_INT)
        for t in self.intermediate_tensors.values():
            t.fill_(float("nan"))
        for k, v in self.kv_caches.values():
            k.fill_(KV_POISON)
            v.fill_(KV_POISON)
        if self.drafter is not None:
            self.drafter.reset(KV_POISON)
        if self.fa_records is not None:
            self.fa_records.clear()
        self._stale_logits = None
        # A fault is a property of the Case, so the layer split is re-derived per reset.
        m = self.model
        uneven = self.cfg.num_hidden_layers % self.cfg.pp != 0
        m.run_end = m.end - 1 if (self.faults.on("pp_uneven_partition") and uneven and m.is_last) else m.end
        # Captured graphs survive resets (capture is expensive) unless what they froze may
        # differ: a fault that changes what is baked (then the Case's own first batches must
        # capture, so its verdict never depends on earlier Cases) or a changed layer loop.
        capture_faults = self.faults.names & CAPTURE_FAULTS
        graph_key = (m.run_end, capture_faults)
        if capture_faults or graph_key != getattr(self, "_graph_key", graph_key):
            self.graphs.clear()
            self._baked.clear()
        self._graph_key = graph_key

    # -- host phase --------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = CachedRequestState(nr.req_id, list(nr.token_ids),
                                                          list(nr.block_ids), nr.num_computed_tokens)
        c = so.scheduled_cached_reqs
        stale = self.faults.on("pp_stale_new_token_ids") and not self.model.is_last
        for rid, toks, blocks, ncomp in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            st.token_ids.extend(toks[:-1] if stale and toks else toks)
            st.block_ids.extend(blocks)
            st.num_computed_tokens = ncomp

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        # The previous microbatch's copies read the staging buffers (the InputBatch block
        # table among them) when they land: wait for them before overwriting any of it.
        # Skipping this wait is docs/bug_classes.md#pp_shared_staging_buffer.
        if not self.faults.on("pp_shared_staging_buffer"):
            for h in self._staging_copies:
                self.copier.wait(h)
        self._update_states(so)
        ib = self.input_batch
        ib.clear()
        for rid, n in so.num_scheduled_tokens.items():
            row = ib.add_request(self.requests[rid], n)
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # drafts are inputs of this step only, after the known tokens
                N = ib.num_tokens[row]
                ib.token_ids[row, N:N + len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
        ib.reorder_batch(swap_block_table=not self.faults.on("reorder_partial_swap"))
        R = ib.num_reqs
        ns = torch.tensor(ib.num_scheduled[:R], dtype=torch.int64)
        nc = torch.tensor(ib.num_computed_tokens[:R], dtype=torch.int64)
        T = int(ns.sum())
        T_pad = -(-T // self.cfg.tp) * self.cfg.tp if self.cfg.sequence_parallel else T
        desc = self.dispatcher.dispatch(T_pad, R)
        R_pad = R
        if desc is not None:  # pad to the captured shape
            T_pad, R_pad = desc.num_tokens, desc.num_reqs
        cu = torch.zeros(R + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(ns, 0)
        req_idx = torch.repeat_interleave(torch.arange(R), ns)
        pos = nc[req_idx] + torch.arange(T) - cu[:-1][req_idx]
        seq_lens = nc + ns
        bs = self.cfg.block_size
        bt = ib.block_table.table[:R]
        slots = bt[req_idx, pos // bs].to(torch.int64) * bs + pos % bs
        # Which rows sample: those whose scheduled tokens reach the end of what is known.
        ntok = torch.tensor(ib.num_tokens[:R], dtype=torch.int64)
        samples = (seq_lens >= ntok).nonzero().squeeze(1).tolist()
        sample_req_ids = [ib.req_ids[i] for i in samples]
        # One logits row per verified position: the last known token and each draft.
        sample_rows = [1 + len(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in sample_req_ids]
        logits_indices = [int(cu[i + 1]) - r + j for i, r in zip(samples, sample_rows) for j in range(r)]

        self.input_ids.cpu[:T] = ib.token_ids[req_idx, pos]
        self.positions.cpu[:T] = pos
        self.slot_mapping.cpu[:T] = slots
        self.input_ids.cpu[T:T_pad] = 0
        self.positions.cpu[T:T_pad] = 0
        self.slot_mapping.cpu[T:T_pad] = -1
        self.query_start_loc.cpu[:R + 1] = cu.to(torch.int32)
        self.seq_lens.cpu[:R] = seq_lens.to(torch.int32)
        # Graph padding (vLLM's rules): query_start_loc's tail repeats the last offset,
        # padded seq_lens are 0, padded block-table rows point at the null block 0.
        if not self.faults.on("stale_query_start_loc_tail"):
            self.query_start_loc.cpu[R + 1:R_pad + 1] = T
        self.seq_lens.cpu[R:R_pad] = 0
        ib.block_table.table[R:R_pad] = 0
        cp = self.copier
        self._staging_copies = [
            self.input_ids.copy_to_gpu(cp, T_pad), self.positions.copy_to_gpu(cp, T_pad),
            self.slot_mapping.copy_to_gpu(cp, T_pad), self.query_start_loc.copy_to_gpu(cp, R_pad + 1),
            self.seq_lens.copy_to_gpu(cp, R_pad), cp.copy(self.block_table[:R_pad], ib.block_table.table[:R_pad])]
        cp.launch(so.microbatch)
        eagle = None if self.drafter is None else EagleInputs.build(  # host inputs: taken now
            ib.token_ids, req_idx, pos, seq_lens, samples, sample_rows,
            [list(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in sample_req_ids],
            logits_indices, self.cfg.max_model_len)
        return PreparedBatch(
            microbatch=so.microbatch, num_reqs=R, num_actual_tokens=T, num_padded_tokens=T_pad,
            num_reqs_padded=R_pad, graph=desc,
            max_query_len=int(ns.max()), max_seq_len=int(seq_lens.max()),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.cfg.device),
            sample_req_ids=sample_req_ids, sample_rows=sample_rows,
            num_tokens={ib.req_ids[i]: ib.num_tokens[i] for i in samples}, eagle=eagle)

    # -- device phase ---------------------------------------------------------------------------
    def sync_and_slice_intermediate_tensors(self, recv: dict, num_tokens: int) -> IntermediateTensors:
        """Copy the received tensors into the persistent PP buffers and return their slices."""
        sp = self.cfg.sequence_parallel
        out = {}
        for k, v in recv.items():
            is_scattered = ("residual" if self.faults.on("sp_residual_copy_len") else k == "residual") and sp
            copy_len = num_tokens // self.cfg.tp if is_scattered else num_tokens
            rows = num_tokens // self.cfg.tp if (k == "residual" and sp) else num_tokens
            h = self.copier.copy(self.intermediate_tensors[k][:copy_len], v[:copy_len])
            if not self.faults.on("intermediate_copy_unsynced"):
                self.copier.wait(h)
            out[k] = self.intermediate_tensors[k][:rows]
        return IntermediateTensors(out["hidden_states"], out["residual"])

    def _forward(self, md: CommonAttentionMetadata, input_ids, positions, hidden, residual):
        """The model on the static buffers: the function eager mode calls and graphs capture."""
        m = self.model
        attn = AttentionContext(md, self.kv_caches, self.scale, self.sink_key)
        inter = None if m.is_first else IntermediateTensors(hidden, residual)
        out = m.forward(input_ids, positions, inter, attn, return_hidden_states=self.drafter is not None)
        return (out.hidden_states, out.residual) if not m.is_last else out

    def _run_graph(self, pb: PreparedBatch, hidden, residual):
        desc, cfg = pb.graph, self.cfg
        T = desc.num_tokens
        if desc not in self._baked:
            if self.faults.on("graph_stale_max_seqlen"):
                # docs/bug_classes.md#graph_stale_max_seqlen: the scalars of the batch that
                # happened to trigger the capture.
                baked = (pb.max_query_len, pb.max_seq_len, desc.num_reqs)
            else:
                d = self.builder.build_for_cudagraph_capture(
                    query_start_loc=self.query_start_loc.gpu, seq_lens=self.seq_lens.gpu,
                    block_table=self.block_table, slot_mapping=self.slot_mapping.gpu,
                    num_tokens=T, num_reqs=desc.num_reqs, max_model_len=cfg.max_model_len)
                baked = (d.max_query_len, d.max_seq_len, d.num_reqs)
            if self.faults.on("capture_metadata_baked"):
                baked = baked[:2] + (pb.num_reqs,)  # docs/bug_classes.md#capture_metadata_baked
            self._baked[desc] = baked
        max_q, max_k, R = self._baked[desc]
        bufs = [self.query_start_loc.gpu[:R + 1], self.seq_lens.gpu[:R], self.block_table[:R],
                self.slot_mapping.gpu[:T], self.input_ids.gpu[:T], self.positions.gpu[:T],
                hidden, residual]

        def fn(qsl, sl, bt, sm, ids, pos, h, r):
            md = CommonAttentionMetadata(qsl, sl, bt, sm, R, T, max_q, max_k)
            return self._forward(md, ids, pos, h, r)

        records, self.sink.records = self.sink.records, None  # capture runs are not calls
        try:
            key = None
            if desc not in self.graphs.graphs:  # one code path per partition and options
                m = self.model
                key = (cfg.num_hidden_layers, m.start, m.end, m.run_end, cfg.tp, cfg.sequence_parallel,
                       m.is_first, m.is_last, self.drafter is not None)
            graph = self.graphs.get_or_capture(desc, fn, bufs, trace_key=key)
        finally:
            self.sink.records = records
        if cfg.device.startswith("cuda") and records is not None:
            # Host code inside the graph does not replay: record the host-side metadata, and
            # check it before the launch, since a replay with bad metadata can fault the
            # CUDA context (illegal address) before any check after the run could report it.
            n = len(records)
            self._record_host(pb, (max_q, max_k), T, R)
            if len(records) > n:
                check_before_replay(records[n])
        return graph(*bufs)

    def _record_host(self, pb: PreparedBatch, baked, T: int, R: int) -> None:
        from engine.custom_ops import _record

        q = torch.empty(T, self.model.layers[self.model.start].num_heads, self.cfg.head_dim,
                        dtype=self.cfg.torch_dtype(), device="meta")
        # The device buffers, not the host staging: with PP the host may already have
        # prepared the next microbatch into the staging buffers.
        for layer, (k_cache, _) in self.kv_caches.items():
            self.sink.records.append(_record(
                self.sink, layer, q, k_cache, self.query_start_loc.gpu[:R + 1], self.seq_lens.gpu[:R],
                self.block_table[:R], self.slot_mapping.gpu[:T], baked[0], baked[1]))

    def execute(self, pb: PreparedBatch) -> ModelRunnerOutput | None:
        g, cfg, m = self.g, self.cfg, self.model
        self.copier.start_compute(pb.microbatch)
        sink = self.sink
        sink.microbatch, sink.graph = pb.microbatch, pb.graph is not None
        sink.num_reqs, sink.num_actual_tokens = pb.num_reqs, pb.num_actual_tokens
        sink.reset_snapshot()  # microbatch ids restart after reset: never reuse a snapshot
        try:
            R, T = pb.num_reqs_padded, pb.num_padded_tokens
            hidden = residual = None
            if not m.is_first:
                recv = g.pp.recv_tensor_dict(all_gather_group=g.tp)
                inter = self.sync_and_slice_intermediate_tensors(recv, T)
                hidden, residual = inter.hidden_states, inter.residual
            if pb.graph is not None:
                out = self._run_graph(pb, hidden, residual)
            else:
                md = self.builder.build(
                    query_start_loc=self.query_start_loc.gpu[:R + 1], seq_lens=self.seq_lens.gpu[:R],
                    block_table=self.block_table[:R], slot_mapping=self.slot_mapping.gpu[:T],
                    num_reqs=pb.num_reqs, num_actual_tokens=pb.num_actual_tokens,
                    max_query_len=pb.max_query_len, max_seq_len=pb.max_seq_len)
                out = self._forward(md, self.input_ids.gpu[:T], self.positions.gpu[:T], hidden, residual)
            if not m.is_last:
                # The sequence-parallel residual differs per TP rank: it must go whole
                # (applying the all_gather split to it is
                # docs/bug_classes.md#pp_allgather_non_replicated).
                scattered = ("residual",) if cfg.sequence_parallel and not self.faults.on(
                    "pp_allgather_non_replicated") else ()
                g.pp.send_tensor_dict({"hidden_states": out[0], "residual": out[1]},
                                      all_gather_group=g.tp, scattered=scattered)
                logits = None
            else:
                if self.drafter is not None:
                    out, hidden = out
                logits = m.compute_logits(out[pb.logits_indices]).float()
                if self.drafter is not None:  # inside the compute window: it reads device buffers
                    draft_ids = self.propose_draft_token_ids(pb, logits, hidden)
        finally:
            self.copier.end_compute(pb.microbatch)
        if cfg.broadcast_pp_output and cfg.pp > 1:
            # Every rank receives the last stage's logits and samples itself
            # (docs/bug_classes.md#pp_logits_not_broadcast).
            logits = g.pp.broadcast_tensor_dict({"logits": logits} if m.is_last else None,
                                                src=cfg.pp - 1)["logits"]
            if self.faults.on("pp_logits_not_broadcast") and not m.is_last:
                # The fault: sample from the previous step's logits, not the broadcast.
                fresh = logits
                logits = self._stale_logits if self._stale_logits is not None and \
                    self._stale_logits.shape == fresh.shape else torch.zeros_like(fresh)
                self._stale_logits = fresh
        if logits is None:
            return None
        flat = logits.argmax(-1).tolist()
        sampled, i = [], 0
        for r in pb.sample_rows:
            sampled.append(flat[i:i + r])
            i += r
        return ModelRunnerOutput(pb.microbatch, g.rank, pb.sample_req_ids, sampled, logits.cpu(), pb.num_tokens,
                                 draft_ids if self.drafter is not None else None)

    def propose_draft_token_ids(self, pb: PreparedBatch, logits: torch.Tensor,
                                hidden: torch.Tensor) -> dict[str, list[int]]:
        """EAGLE drafts for the requests that sampled. They are proposed here, not in the
        driver like n-gram drafts, because the target's hidden states live on this rank;
        the driver schedules them, so they reach every rank in the next SchedulerOutput."""
        e, cfg, R, T = pb.eagle, self.cfg, pb.num_reqs, pb.num_actual_tokens
        argmax = logits.argmax(-1)
        ids = e.next_token_ids.to(cfg.device)
        ids[pb.logits_indices] = argmax  # a sampled row's next token is the one sampled from it
        # Pass 1 uses the target's own (unpadded) metadata: the draft KV covers every position.
        md = self.builder.build(
            query_start_loc=self.query_start_loc.gpu[:R + 1], seq_lens=self.seq_lens.gpu[:R],
            block_table=self.block_table[:R], slot_mapping=self.slot_mapping.gpu[:T], num_reqs=R,
            num_actual_tokens=T, max_query_len=pb.max_query_len, max_seq_len=pb.max_seq_len)
        rows, num = e.draft_from(argmax.tolist(), self.drafter.k, cfg.max_model_len)
        out = self.drafter.propose(ids, self.positions.gpu[:T], hidden[:T], md,
                                   torch.tensor(rows, dtype=torch.int64, device=cfg.device),
                                   self.block_table[e.batch_rows], num, pb.microbatch)
        return dict(zip(pb.sample_req_ids, out))
