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

import torch

from engine.async_copy import AsyncCopier
from engine.async_sched import PrevSampledTokens
from engine.attention.metadata import AttentionContext, AttentionMetadataBuilder, CommonAttentionMetadata
from engine.attention.selector import get_attn_backend
from engine.config import EngineConfig
from engine.custom_ops import AttentionSink, register_sink
from engine.eagle import EagleProposer
from engine.faults import CAPTURE_FAULTS, FaultSet
from engine.graph_runner import CUDAGraphRunner, check_before_replay
from engine.input_prep import InputBuffers, InputPreparer
from engine.model import IntermediateTensors, LlamaForCausalLM
from engine.outputs import ModelRunnerOutput, PreparedBatch, SchedulerOutput
from engine.parallel_state import RankGroups
from engine.poison import KV_POISON, fill_floats
from engine.pp_stage import PPStage
from engine.sample.metadata import build_sampling_metadata
from engine.sample.sampler import Sampler, SamplerOutput, prompt_logprobs

__all__ = ["CAPTURE_FAULTS", "GPUModelRunner", "ModelRunnerOutput", "PreparedBatch",
           "check_before_replay"]


class GPUModelRunner:
    def __init__(self, cfg: EngineConfig, groups: RankGroups, state_dict: dict,
                 faults: FaultSet, copier: AsyncCopier, record_fa: bool = False) -> None:
        self.cfg, self.g, self.copier = cfg, groups, copier
        dev, dtype = cfg.device, cfg.torch_dtype()
        groups.tp.out_dtype = dtype  # what an all-reduce's result is rounded to (the activations')
        self.model = m = LlamaForCausalLM(cfg, state_dict, groups).to(dev)
        kv_shape = (cfg.num_gpu_blocks, cfg.block_size, m.layers[m.start].num_kv_heads, cfg.head_dim)
        self.kv_caches = {i: (torch.zeros(kv_shape, dtype=dtype, device=dev),
                              torch.zeros(kv_shape, dtype=dtype, device=dev)) for i in range(m.start, m.end)}
        self.max_num_tokens = T = cfg.max_num_batched_tokens + cfg.tp  # room for SP padding
        self.bufs = InputBuffers(cfg, cfg.max_num_seqs, T)
        self.builder, self.scale = AttentionMetadataBuilder(), cfg.head_dim ** -0.5
        self.fa_records: list | None = [] if record_fa else None
        # Resolved once (engine/attention/selector.py) and handed to this rank's sinks: the
        # attention op runs whatever backend its sink holds.
        attn_backend = get_attn_backend(cfg)
        self.sink = AttentionSink(groups.rank, attn_backend, self.fa_records, key_len_pad=cfg.max_model_len)
        # One output memory for the rank's attention calls, as the allocator hands a layer
        # back what an earlier one freed: finite, stale, never cleared between calls.
        self.sink.attn_out = torch.zeros(T, m.layers[m.start].num_heads, cfg.head_dim, dtype=dtype, device=dev)
        register_sink(self.sink)
        # EAGLE drafts from the target's hidden states, which exist on the last stage only.
        self.drafter = EagleProposer(cfg, state_dict, groups.rank, self.fa_records, attn_backend) \
            if cfg.speculative_method == "eagle" and m.is_last else None
        self.inputs = InputPreparer(cfg, faults, copier, self.bufs, m.is_last, self.drafter is not None)
        self.pp = PPStage(cfg, groups, faults, copier, T, m.is_last)
        self.graph_runner = CUDAGraphRunner(cfg, faults, m, self.kv_caches, self.bufs, self.builder,
                                            self.sink, self, self.drafter is not None, lambda: (self.scale,))
        self.graphs = self.graph_runner.graphs
        # Who samples: the last stage, and with broadcast_pp_output every stage (from the
        # broadcast logits, each with its own copy of every request's generator).
        self.samples = m.is_last or (cfg.broadcast_pp_output and cfg.pp > 1)
        self.sampler = Sampler()
        self.faults = faults
        # Async scheduling: each request's last sampled tokens, on the device (every rank
        # keeps them; the first stage's fill placeholders from them).
        self.prev_sampled = PrevSampledTokens()

    @property
    def faults(self) -> FaultSet:
        return self._faults

    @faults.setter
    def faults(self, faults: FaultSet) -> None:
        # The Worker sets each Case's faults on the runner: every phase must see the same set.
        self._faults = self.inputs.faults = self.pp.faults = self.graph_runner.faults = faults
        self.inputs.input_batch.sampling.faults = faults
        self.g.tp.faults = self.g.pp.faults = self.g.world.faults = faults
        for layer in self.model.layers[self.model.start:self.model.end]:
            layer.faults = faults

    def reset(self, poison: str = "nan") -> None:
        """Forget all requests and poison every persistent buffer (engine/poison.py: NaN, or
        stale finite values), so a stale read shows inside the Case that makes it, and never
        depends on the Cases before."""
        self.copier.synchronize()
        self.inputs.reset(poison)
        self.inputs.input_batch.sampling.reset(poison)
        self.pp.reset(poison)
        for i, (k, v) in self.kv_caches.items():
            fill_floats(k, poison, f"k{i}", nan_value=KV_POISON)
            fill_floats(v, poison, f"v{i}", nan_value=KV_POISON)
        fill_floats(self.sink.attn_out, poison, "attn_out")
        if self.drafter is not None:
            self.drafter.reset(poison)
        self.prev_sampled.reset()
        if self.fa_records is not None:
            self.fa_records.clear()
        # A fault is a property of the Case, so the layer split is re-derived per reset.
        self.model.run_end = self.pp.layer_end(self.model)
        self.graph_runner.reset(self.model.run_end)

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        pb = self.inputs.prepare(so)
        pb.finished_req_ids = frozenset(so.finished_req_ids)
        if self.samples:  # from the InputBatch as this microbatch left it
            pb.sampling_metadata = build_sampling_metadata(self.inputs.input_batch, pb, self.faults, self.cfg.device)
        return pb

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
        return AttentionContext(md, self.kv_caches, self.scale, self.sink)

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
        logits = draft_ids = hidden = residual = sampled = None
        prompt_lp = {}
        # Dropped here, in execution order, not at prepare: the host may prepare this step
        # before the step ahead of it executes, and that one may still fill a placeholder of a
        # request aborted since (its device-side tokens outlive the abort until then, as in vLLM).
        self.prev_sampled.drop(pb.finished_req_ids)
        try:
            if not m.is_first:
                inter = self.pp.recv(T)
                hidden, residual = inter.hidden_states, inter.residual
            else:  # after this microbatch's input copies landed (start_compute), before the forward
                self.prev_sampled.fill(self.bufs.input_ids.gpu, pb.placeholder_fills)
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
                sampled = self.sampler(logits, pb.sampling_metadata)
                prompt_lp = self._prompt_logprobs(out, pb)
                if self.drafter is not None:  # inside the compute window: it reads device buffers
                    draft_ids = self.propose_draft_token_ids(pb, sampled.sampled_token_ids, hidden)
        finally:
            self.copier.end_compute(pb.microbatch)
        if self.cfg.broadcast_pp_output and self.cfg.pp > 1:
            logits = self.pp.broadcast_logits(logits)
            if not m.is_last:
                sampled = self.sampler(logits, pb.sampling_metadata)
        self._keep_sampled(pb, sampled)
        if logits is None:
            return None
        return self._runner_output(pb, logits, sampled, draft_ids, prompt_lp)

    def _keep_sampled(self, pb: PreparedBatch, sampled: SamplerOutput | None) -> None:
        """Async scheduling: keep this step's sampled ids on the device for the placeholders
        of the steps run ahead of it. With PP the last stage sends them to every stage (vLLM
        broadcasts them from the last PP rank), unless every stage sampled itself."""
        if not self.cfg.async_scheduling:
            return
        ids = None if sampled is None else sampled.sampled_token_ids
        if self.cfg.pp > 1 and not self.cfg.broadcast_pp_output:
            ids = self.pp.broadcast_sampled(ids)
        self.prev_sampled.record(ids.reshape(-1), pb.num_reqs, pb.sample_batch_rows, pb.sample_rows,
                                 pb.req_id_to_index)

    def _prompt_logprobs(self, hidden_out: torch.Tensor, pb: PreparedBatch) -> dict:
        """Raw logprobs at the prompt positions of requests that ask for them (every scheduled
        position, not only the sampled ones: hence their own logits rows)."""
        md = pb.sampling_metadata
        if md is None or not md.prompt_logprobs:
            return {}
        idx = torch.tensor([i for p in md.prompt_logprobs for i in p.token_indices], device=self.cfg.device)
        return prompt_logprobs(self.model.compute_logits(hidden_out[idx]), md)

    def _runner_output(self, pb: PreparedBatch, logits: torch.Tensor, s: SamplerOutput,
                       draft_ids: dict | None, prompt_lp: dict) -> ModelRunnerOutput:
        flat, sampled, i = s.sampled_token_ids.tolist(), [], 0
        for r in pb.sample_rows:
            sampled.append(flat[i:i + r])
            i += r
        lp = None if s.processed_logprobs is None else s.processed_logprobs.cpu()
        return ModelRunnerOutput(pb.microbatch, self.g.rank, pb.sample_req_ids, sampled, logits.cpu(),
                                 pb.num_tokens, draft_ids, lp, {r: q.cpu() for r, q in s.noise.items()},
                                 prompt_lp)

    def propose_draft_token_ids(self, pb: PreparedBatch, sampled: torch.Tensor,
                                hidden: torch.Tensor) -> dict[str, list[int]]:
        """EAGLE drafts for the requests that sampled. They are proposed here, not in the
        driver like n-gram drafts, because the target's hidden states live on this rank;
        the driver schedules them, so they reach every rank in the next SchedulerOutput.
        `sampled`: the token of each logits row (drafting serves greedy requests only)."""
        e, cfg, T = pb.eagle, self.cfg, pb.num_actual_tokens
        ids = e.next_token_ids.to(cfg.device)
        ids[pb.logits_indices] = sampled  # a sampled row's next token is the one sampled from it
        # Pass 1 uses the target's own (unpadded) metadata: the draft KV covers every position.
        md = self.bufs.attn_metadata(self.builder, pb, padded=False)
        rows, num = self.drafter.draft_from(e, sampled.tolist())
        out = self.drafter.propose(ids, self.bufs.positions.gpu[:T], hidden[:T], md,
                                   torch.tensor(rows, dtype=torch.int64, device=cfg.device),
                                   self.bufs.block_table[e.batch_rows], num, pb.microbatch)
        return dict(zip(pb.sample_req_ids, out))
