"""GPUModelRunner: one rank's persistent state and the phases of a microbatch (vLLM v1 shape).

A microbatch goes through two phases. `prepare` runs on the host (engine/input_prep.py):
update request states from the SchedulerOutput, fill the persistent InputBatch, reorder it,
compute the step's host scalars, write the staging buffers and issue their async copies.
`execute` is the device work: PP receive into persistent buffers (engine/pp_stage.py),
forward, eager or a graph replay (engine/graph_runner.py), PP send or logits and sampling.
With PP the host may prepare microbatch m+1 before m executes (it runs ahead of the device
in a real engine), which is where the staging-buffer races of
docs/bug_classes.md#pp_shared_staging_buffer live.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.async_copy import AsyncCopier
from engine.attention.metadata import AttentionContext, AttentionMetadataBuilder, CommonAttentionMetadata
from engine.config import EngineConfig
from engine.custom_ops import AttentionSink, register_sink
from engine.eagle import EagleProposer
from engine.faults import CAPTURE_FAULTS, FaultSet
from engine.graph_runner import CUDAGraphRunner, check_before_replay
from engine.input_prep import InputBuffers, InputPreparer, PreparedBatch
from engine.model import IntermediateTensors, LlamaForCausalLM
from engine.parallel_state import RankGroups
from engine.poison import KV_POISON, fill_floats
from engine.pp_stage import PPStage
from engine.scheduler import SchedulerOutput

__all__ = ["CAPTURE_FAULTS", "GPUModelRunner", "ModelRunnerOutput", "PreparedBatch",
           "check_before_replay"]



@dataclass(slots=True)
class ModelRunnerOutput:
    microbatch: int
    rank: int
    req_ids: list[str]  # requests that sampled this step, in batch order
    sampled_token_ids: list[list[int]]  # per request: argmax of each of its logits rows
    logits: torch.Tensor  # [sum(rows), vocab] fp32 on CPU; 1 row per request, 1 + k with drafts
    num_tokens: dict[str, int]  # per sampled request: tokens this rank knew (engine invariant)
    draft_token_ids: dict[str, list[int]] | None = None  # EAGLE drafts (last PP stage only)


class GPUModelRunner:
    def __init__(self, cfg: EngineConfig, groups: RankGroups, state_dict: dict,
                 faults: FaultSet, copier: AsyncCopier, record_fa: bool = False) -> None:
        self.cfg, self.g, self.copier = cfg, groups, copier
        dev, dtype = cfg.device, cfg.torch_dtype()
        self.model = m = LlamaForCausalLM(cfg, state_dict, groups).to(dev)
        kv_shape = (cfg.num_gpu_blocks, cfg.block_size, m.layers[m.start].num_kv_heads, cfg.head_dim)
        self.kv_caches = {i: (torch.zeros(kv_shape, dtype=dtype, device=dev),
                              torch.zeros(kv_shape, dtype=dtype, device=dev)) for i in range(m.start, m.end)}
        self.max_num_tokens = T = cfg.max_num_batched_tokens + cfg.tp  # room for SP padding
        self.bufs = InputBuffers(cfg, cfg.max_num_seqs, T)
        self.builder, self.scale = AttentionMetadataBuilder(), cfg.head_dim ** -0.5
        self.fa_records: list | None = [] if record_fa else None
        self.sink = AttentionSink(groups.rank, self.fa_records, key_len_pad=cfg.max_model_len,
                                  backend=cfg.attention_backend)
        # One output memory for the rank's attention calls, as the allocator hands a layer
        # back what an earlier one freed: finite, stale, never cleared between calls.
        self.sink.attn_out = torch.zeros(T, m.layers[m.start].num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.sink_key = register_sink(self.sink)
        # EAGLE drafts from the target's hidden states, which exist on the last stage only.
        self.drafter = EagleProposer(cfg, state_dict, groups.rank, self.fa_records) \
            if cfg.speculative_method == "eagle" and m.is_last else None
        self.inputs = InputPreparer(cfg, faults, copier, self.bufs, m.is_last, self.drafter is not None)
        self.pp = PPStage(cfg, groups, faults, copier, T, m.is_last)
        self.graph_runner = CUDAGraphRunner(cfg, faults, m, self.kv_caches, self.bufs, self.builder,
                                            self.sink, self, self.drafter is not None,
                                            self.sink_key, lambda: (self.scale,))
        self.graphs = self.graph_runner.graphs
        self.faults = faults

    @property
    def faults(self) -> FaultSet:
        return self._faults

    @faults.setter
    def faults(self, faults: FaultSet) -> None:
        # The Worker sets each Case's faults on the runner: every phase must see the same set.
        self._faults = self.inputs.faults = self.pp.faults = self.graph_runner.faults = faults

    def reset(self, poison: str = "nan") -> None:
        """Forget all requests and poison every persistent buffer (engine/poison.py: NaN, or
        stale finite values), so a stale read shows inside the Case that makes it, and never
        depends on the Cases before."""
        self.copier.synchronize()
        self.inputs.reset(poison)
        self.pp.reset(poison)
        for i, (k, v) in self.kv_caches.items():
            fill_floats(k, poison, f"k{i}", nan_value=KV_POISON)
            fill_floats(v, poison, f"v{i}", nan_value=KV_POISON)
        fill_floats(self.sink.attn_out, poison, "attn_out")
        if self.drafter is not None:
            self.drafter.reset(poison)
        if self.fa_records is not None:
            self.fa_records.clear()
        # A fault is a property of the Case, so the layer split is re-derived per reset.
        self.model.run_end = self.pp.layer_end(self.model)
        self.graph_runner.reset(self.model.run_end)

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        return self.inputs.prepare(so)

    def _forward(self, md: CommonAttentionMetadata, input_ids, positions, hidden, residual):
        """The model on the static buffers: the function eager mode calls and a GPU graph
        captures. A CPU capture traces its parts one by one (engine/graph_runner.py), so the
        layers of every stage share one trace: `forward_in`, each live layer, `forward_out`."""
        out = self.model.forward(input_ids, positions, self._intermediate(hidden, residual), self.attention(md),
                                 return_hidden_states=self.drafter is not None)
        return self._stage_output(out)

    def forward_in(self, input_ids, positions, hidden, residual):
        return self.model.forward_in(input_ids, positions, self._intermediate(hidden, residual))

    def attention(self, md: CommonAttentionMetadata) -> AttentionContext:
        return AttentionContext(md, self.kv_caches, self.scale, self.sink_key)

    def forward_out(self, hidden, residual):
        return self._stage_output(self.model.forward_out(hidden, residual,
                                                         return_hidden_states=self.drafter is not None))

    def _intermediate(self, hidden, residual) -> IntermediateTensors | None:
        return None if self.model.is_first else IntermediateTensors(hidden, residual)

    def _stage_output(self, out):
        return (out.hidden_states, out.residual) if not self.model.is_last else out

    def execute(self, pb: PreparedBatch) -> ModelRunnerOutput | None:
        m, sink, T = self.model, self.sink, pb.num_padded_tokens
        self.copier.start_compute(pb.microbatch)
        sink.microbatch, sink.graph = pb.microbatch, pb.graph is not None
        sink.num_reqs, sink.num_actual_tokens = pb.num_reqs, pb.num_actual_tokens
        sink.reset_snapshot()  # microbatch ids restart after reset: never reuse a snapshot
        logits = draft_ids = hidden = residual = None
        try:
            if not m.is_first:
                inter = self.pp.recv(T)
                hidden, residual = inter.hidden_states, inter.residual
            # The forward runs in inference mode, as vLLM's execute_model does: no autograd
            # bookkeeping (view tracking, version counters of the tensors it makes), ~17 % of
            # a tiny layer's per-op cost on the CPU. Its outputs are inference tensors, only
            # read after it (what is made from them outside, such as the logits, is not).
            with torch.inference_mode():
                if pb.graph is not None:
                    out = self.graph_runner.run(pb, hidden, residual)
                else:
                    md = self.bufs.attn_metadata(self.builder, pb, padded=True)
                    out = self._forward(md, self.bufs.input_ids.gpu[:T], self.bufs.positions.gpu[:T],
                                        hidden, residual)
            if not m.is_last:
                self.pp.send(out[0], out[1])
            else:
                if self.drafter is not None:
                    out, hidden = out
                logits = m.compute_logits(out[pb.logits_indices]).float()
                if self.drafter is not None:  # inside the compute window: it reads device buffers
                    draft_ids = self.propose_draft_token_ids(pb, logits, hidden)
        finally:
            self.copier.end_compute(pb.microbatch)
        if self.cfg.broadcast_pp_output and self.cfg.pp > 1:
            logits = self.pp.broadcast_logits(logits)
        if logits is None:
            return None
        flat, sampled, i = logits.argmax(-1).tolist(), [], 0
        for r in pb.sample_rows:
            sampled.append(flat[i:i + r])
            i += r
        return ModelRunnerOutput(pb.microbatch, self.g.rank, pb.sample_req_ids, sampled, logits.cpu(),
                                 pb.num_tokens, draft_ids)

    def propose_draft_token_ids(self, pb: PreparedBatch, logits: torch.Tensor,
                                hidden: torch.Tensor) -> dict[str, list[int]]:
        """EAGLE drafts for the requests that sampled. They are proposed here, not in the
        driver like n-gram drafts, because the target's hidden states live on this rank;
        the driver schedules them, so they reach every rank in the next SchedulerOutput."""
        e, cfg, T = pb.eagle, self.cfg, pb.num_actual_tokens
        argmax = logits.argmax(-1)
        ids = e.next_token_ids.to(cfg.device)
        ids[pb.logits_indices] = argmax  # a sampled row's next token is the one sampled from it
        # Pass 1 uses the target's own (unpadded) metadata: the draft KV covers every position.
        md = self.bufs.attn_metadata(self.builder, pb, padded=False)
        rows, num = e.draft_from(argmax.tolist(), self.drafter.k, cfg.max_model_len)
        out = self.drafter.propose(ids, self.bufs.positions.gpu[:T], hidden[:T], md,
                                   torch.tensor(rows, dtype=torch.int64, device=cfg.device),
                                   self.bufs.block_table[e.batch_rows], num, pb.microbatch)
        return dict(zip(pb.sample_req_ids, out))
