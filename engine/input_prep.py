"""Input preparation: the host phase of one microbatch (vLLM v1's `_prepare_inputs`).

From a SchedulerOutput and a rank's persistent state (request states, InputBatch, staging
buffers) to a PreparedBatch: update the request states, fill the InputBatch and reorder it,
compute the step's host scalars, write the staging buffers and issue their async copies.
With PP the host may prepare microbatch m+1 before m executes (it runs ahead of the device
in a real engine), so nothing here may overwrite what a copy still in flight reads:
docs/bug_classes.md#pp_shared_staging_buffer.
"""
from __future__ import annotations

import torch

from engine.async_copy import AsyncCopier, CopyHandle
from engine.async_sched import PLACEHOLDER_TOKEN_ID
from engine.attention.metadata import AttentionMetadataBuilder, CommonAttentionMetadata
from engine.config import EngineConfig
from engine.cuda_graph import CudagraphDispatcher
from engine.faults import (ASYNC_PLACEHOLDER_NOT_REPLACED, PP_SHARED_STAGING_BUFFER, PP_STALE_NEW_TOKEN_IDS, REORDER_PARTIAL_SWAP,
                           STALE_QUERY_START_LOC_TAIL, FaultSet)
from engine.input_batch import CachedRequestState, CpuGpuBuffer, InputBatch
from engine.outputs import BatchDescriptor, EagleInputs, PreparedBatch, SchedulerOutput
from engine.poison import fill_ints


class InputBuffers:
    """The persistent staging buffers of a rank's inputs (a host tensor and its device twin
    each). Graphs capture the device addresses, so these are allocated once and never swapped."""

    def __init__(self, cfg: EngineConfig, max_num_reqs: int, max_num_tokens: int) -> None:
        dev, R, T = cfg.device, max_num_reqs, max_num_tokens
        self.input_ids = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.positions = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.query_start_loc = CpuGpuBuffer(R + 1, dtype=torch.int32, device=dev)
        self.seq_lens = CpuGpuBuffer(R, dtype=torch.int32, device=dev)
        self.slot_mapping = CpuGpuBuffer(T, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(R, cfg.max_blocks_per_req, dtype=torch.int32, device=dev)
        self.cfg, self.max_num_reqs, self.max_num_tokens = cfg, R, T

    def poison(self, mode: str) -> None:
        """As a reset leaves them (engine/poison.py). Stale: an earlier batch's in-range ids,
        positions, lengths, slots and blocks, and monotone query offsets."""
        c, R, T = self.cfg, self.max_num_reqs, self.max_num_tokens
        slots = c.num_gpu_blocks * c.block_size
        self.input_ids.poison(mode, "input_ids", high=c.vocab_size, step=7)
        self.positions.poison(mode, "positions", high=c.max_model_len)
        self.query_start_loc.poison(mode, "query_start_loc", high=2 ** 30, step=max(1, T // R))
        self.seq_lens.poison(mode, "seq_lens", low=1, high=c.max_model_len, step=5)
        self.slot_mapping.poison(mode, "slot_mapping", low=c.block_size, high=slots, step=3)
        fill_ints(self.block_table, mode, "block_table", low=1, high=c.num_gpu_blocks, step=1)

    def attn_metadata(self, builder: AttentionMetadataBuilder, pb: PreparedBatch, *,
                      padded: bool) -> CommonAttentionMetadata:
        """Eager metadata on the device buffers, sliced to the padded shape (the forward) or
        to the real one (the EAGLE pass, whose draft KV covers every real position)."""
        R, T = (pb.num_reqs_padded, pb.num_padded_tokens) if padded else (pb.num_reqs, pb.num_actual_tokens)
        return builder.build(
            query_start_loc=self.query_start_loc.gpu[:R + 1], seq_lens=self.seq_lens.gpu[:R],
            block_table=self.block_table[:R], slot_mapping=self.slot_mapping.gpu[:T],
            num_reqs=pb.num_reqs, num_actual_tokens=pb.num_actual_tokens,
            max_query_len=pb.max_query_len, max_seq_len=pb.max_seq_len)


class InputPreparer:
    """The host phase of one rank: SchedulerOutput -> PreparedBatch, through the persistent
    request states, InputBatch and staging buffers."""

    def __init__(self, cfg: EngineConfig, faults: FaultSet, copier: AsyncCopier, bufs: InputBuffers,
                 is_last: bool, with_eagle: bool) -> None:
        self.cfg, self.faults, self.copier, self.bufs = cfg, faults, copier, bufs
        self.is_last, self.with_eagle = is_last, with_eagle
        R = cfg.max_num_seqs
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(R, cfg.max_model_len, cfg.max_blocks_per_req,
                                      pin=cfg.device.startswith("cuda"), vocab_size=cfg.vocab_size,
                                      seed=cfg.seed, device=cfg.device)
        # Sizes past the token budget are never captured (vLLM caps them the same way): the
        # static buffers hold max_num_batched_tokens (+ SP padding) rows.
        sizes = [s for s in cfg.capture_sizes if s <= cfg.max_num_batched_tokens]
        self.dispatcher = CudagraphDispatcher(
            sizes if cfg.cudagraph_mode == "FULL" else (), R,
            multiple_of=cfg.tp if cfg.sequence_parallel else 1)
        self._staging_copies: list[CopyHandle] = []
        self._added_order: list[str] = []  # the batch's requests before the reorder

    def reset(self, poison: str) -> None:
        """Forget all requests and poison the persistent rows and buffers (after the copier
        synchronized, so no copy still reads them)."""
        ib, c = self.input_batch, self.cfg
        self.requests.clear()
        ib.clear()
        fill_ints(ib.token_ids, poison, "token_ids", high=c.vocab_size, step=7)
        fill_ints(ib.block_table.table, poison, "batch_block_table", low=1, high=c.num_gpu_blocks)
        self.bufs.poison(poison)

    def prepare(self, so: SchedulerOutput) -> PreparedBatch:
        self._wait_for_staging_copies()
        self._update_states(so)
        ib = self._fill_input_batch(so)
        req_id_to_index = self._req_id_to_index(ib)
        R = ib.num_reqs
        ns = torch.tensor(ib.num_scheduled[:R], dtype=torch.int64)
        nc = torch.tensor(ib.num_computed_tokens[:R], dtype=torch.int64)
        T = int(ns.sum())
        desc, T_pad, R_pad = self._padded_shape(T, R)
        cu = torch.zeros(R + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(ns, 0)
        req_idx = torch.repeat_interleave(torch.arange(R), ns)
        pos = nc[req_idx] + torch.arange(T) - cu[:-1][req_idx]
        seq_lens = nc + ns
        samples, sample_rows, logits_indices = self._sampling(so, ib, cu, seq_lens)
        sample_req_ids = [ib.req_ids[i] for i in samples]
        self._write_staging(ib, req_idx, pos, cu, seq_lens, T_pad, R_pad)
        self._copy_staging(so.microbatch, T_pad, R_pad)
        eagle = None if not self.with_eagle else _eagle_inputs(  # host inputs: taken now
            ib.token_ids, req_idx, pos, seq_lens, samples, sample_rows,
            [list(so.scheduled_spec_decode_tokens.get(rid, ())) for rid in sample_req_ids],
            logits_indices, self.cfg.max_model_len)
        return PreparedBatch(
            microbatch=so.microbatch, num_reqs=R, num_actual_tokens=T, num_padded_tokens=T_pad,
            num_reqs_padded=R_pad, graph=desc,
            max_query_len=int(ns.max()), max_seq_len=int(seq_lens.max()),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.cfg.device),
            sample_req_ids=sample_req_ids, sample_rows=sample_rows,
            num_tokens={ib.req_ids[i]: ib.num_tokens[i] for i in samples}, eagle=eagle,
            placeholder_fills=self._placeholder_fills(ib, req_idx, T), sample_batch_rows=samples,
            req_id_to_index={rid: req_id_to_index[rid] for rid in sample_req_ids})

    def _wait_for_staging_copies(self) -> None:
        """The previous microbatch's copies read the staging buffers (the InputBatch block
        table among them) when they land: wait for them before overwriting any of it.
        Skipping this wait is docs/bug_classes.md#pp_shared_staging_buffer."""
        if self.faults.on(PP_SHARED_STAGING_BUFFER):
            return
        for h in self._staging_copies:
            self.copier.wait(h)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        sampling = self.input_batch.sampling
        sampling.drop(so.finished_req_ids)  # a preempted request resumes with its generator
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = CachedRequestState(
                nr.req_id, list(nr.token_ids), list(nr.block_ids), nr.num_computed_tokens,
                sampling.request_state(nr.req_id, nr.sampling_params, nr.token_ids))
        c = so.scheduled_cached_reqs
        for rid, toks, blocks, ncomp in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.requests[rid]
            st.token_ids.extend(self._new_token_ids(toks))
            st.block_ids.extend(blocks)
            st.num_computed_tokens = ncomp

    def _new_token_ids(self, toks: list[int]) -> list[int]:
        """A cached request's tokens since its last step: all of them, on every rank (a rank
        that drops one lags the others: docs/bug_classes.md#pp_stale_new_token_ids)."""
        if self.faults.on(PP_STALE_NEW_TOKEN_IDS) and not self.is_last:
            return toks[:-1]
        return toks

    def _fill_input_batch(self, so: SchedulerOutput) -> InputBatch:
        ib = self.input_batch
        ib.clear()
        for rid, n in so.num_scheduled_tokens.items():
            row = ib.add_request(self.requests[rid], n)
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # drafts are inputs of this step only, after the known tokens
                N = ib.num_tokens[row]
                ib.token_ids[row, N:N + len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
        self._added_order = list(ib.req_ids)
        self._reorder_batch(ib)
        return ib

    def _req_id_to_index(self, ib: InputBatch) -> dict[str, int]:
        """Each request's batch row as the step's sampled tokens will be laid out: after the
        reorder. The map taken before it (rows as requests were added) makes a later step's
        placeholder read the token of whichever request sat in that row
        (docs/bug_classes.md#async_placeholder_not_replaced)."""
        if self.faults.on(ASYNC_PLACEHOLDER_NOT_REPLACED):
            return {rid: i for i, rid in enumerate(self._added_order)}
        return {rid: i for i, rid in enumerate(ib.req_ids)}

    def _placeholder_fills(self, ib: InputBatch, req_idx: torch.Tensor, T: int) -> list[tuple[int, str]]:
        """Input index and request of each placeholder this step reads (async scheduling; an
        engine built without it never schedules one, and skips the scan on every step)."""
        if not self.cfg.async_scheduling:
            return []
        at = (self.bufs.input_ids.cpu[:T] == PLACEHOLDER_TOKEN_ID).nonzero().squeeze(1).tolist()
        return [(i, ib.req_ids[int(req_idx[i])]) for i in at]

    def _reorder_batch(self, ib: InputBatch) -> None:
        """Decodes first. A request's rows move together, its block-table row included (token
        rows alone make it attend through another request's KV blocks:
        docs/bug_classes.md#reorder_partial_swap)."""
        if self.faults.on(REORDER_PARTIAL_SWAP):
            ib.reorder_batch(swap_block_table=False)
            return
        ib.reorder_batch()

    def _padded_shape(self, T: int, R: int) -> tuple[BatchDescriptor | None, int, int]:
        """The graph to replay (None: eager) and the padded token and request counts."""
        T_pad = -(-T // self.cfg.tp) * self.cfg.tp if self.cfg.sequence_parallel else T
        desc = self.dispatcher.dispatch(T_pad, R)
        if desc is None:
            return None, T_pad, R
        return desc, desc.num_tokens, desc.num_reqs  # pad to the captured shape

    @staticmethod
    def _sampling(so: SchedulerOutput, ib: InputBatch, cu: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """The rows that sample, their number of logits rows and the token index of each."""
        # Which rows sample: those whose scheduled tokens reach the end of what is known.
        ntok = torch.tensor(ib.num_tokens[:ib.num_reqs], dtype=torch.int64)
        samples = (seq_lens >= ntok).nonzero().squeeze(1).tolist()
        # One logits row per verified position: the last known token and each draft.
        sample_rows = [1 + len(so.scheduled_spec_decode_tokens.get(ib.req_ids[i], ())) for i in samples]
        logits_indices = [int(cu[i + 1]) - r + j for i, r in zip(samples, sample_rows) for j in range(r)]
        return samples, sample_rows, logits_indices

    def _write_staging(self, ib: InputBatch, req_idx: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor,
                       seq_lens: torch.Tensor, T_pad: int, R_pad: int) -> None:
        b, bs = self.bufs, self.cfg.block_size
        T, R = len(pos), len(seq_lens)
        slots = ib.block_table.table[:R][req_idx, pos // bs].to(torch.int64) * bs + pos % bs
        b.input_ids.cpu[:T] = ib.token_ids[req_idx, pos]
        b.positions.cpu[:T] = pos
        b.slot_mapping.cpu[:T] = slots
        b.input_ids.cpu[T:T_pad] = 0
        b.positions.cpu[T:T_pad] = 0
        b.slot_mapping.cpu[T:T_pad] = -1
        b.query_start_loc.cpu[:R + 1] = cu.to(torch.int32)
        b.seq_lens.cpu[:R] = seq_lens.to(torch.int32)
        # Graph padding (vLLM's rules): query_start_loc's tail repeats the last offset,
        # padded seq_lens are 0, padded block-table rows point at the null block 0.
        self._pad_query_start_loc_tail(R, R_pad, T)
        b.seq_lens.cpu[R:R_pad] = 0
        ib.block_table.table[R:R_pad] = 0

    def _pad_query_start_loc_tail(self, R: int, R_pad: int, T: int) -> None:
        """Refresh every padded entry: a padded graph reads them, and stale offsets of an
        earlier batch (or the reset poison) are docs/bug_classes.md#stale_query_start_loc_tail."""
        if self.faults.on(STALE_QUERY_START_LOC_TAIL):
            return
        self.bufs.query_start_loc.cpu[R + 1:R_pad + 1] = T

    def _copy_staging(self, microbatch: int, T_pad: int, R_pad: int) -> None:
        b, cp, table = self.bufs, self.copier, self.input_batch.block_table.table
        self._staging_copies = [
            b.input_ids.copy_to_gpu(cp, T_pad), b.positions.copy_to_gpu(cp, T_pad),
            b.slot_mapping.copy_to_gpu(cp, T_pad), b.query_start_loc.copy_to_gpu(cp, R_pad + 1),
            b.seq_lens.copy_to_gpu(cp, R_pad), cp.copy(b.block_table[:R_pad], table[:R_pad])]
        cp.launch(microbatch)


def _eagle_inputs(token_ids: torch.Tensor, req_idx: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor,
                  samples: list[int], sample_rows: list[int], drafts: list[list[int]], logits_indices: list[int],
                  max_model_len: int) -> EagleInputs:
    """The EAGLE proposal's host inputs (engine/eagle.py), from this batch's host tensors."""
    nxt = token_ids[req_idx, (pos + 1).clamp(max=max_model_len - 1)]  # a copy, not a view
    return EagleInputs(nxt, list(samples), [int(seq_lens[i]) - r for i, r in zip(samples, sample_rows)],
                       drafts, list(sample_rows), list(logits_indices))
