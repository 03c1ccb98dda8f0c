"""SamplingMetadata: one microbatch's sampling inputs, built from the persistent InputBatch on
each rank that samples (the last PP stage; every stage with broadcast_pp_output).

It is built when the microbatch is prepared, not when it executes: with PP the host may
prepare the next microbatch into the same InputBatch first. One entry per logits row: a
greedy request verifying k drafts has 1 + k rows, row j seeing the drafts before it as
outputs (its penalties count them, its min_tokens window is j tokens further on).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.faults import SAMPLING_GENERATOR_ADVANCED_UNSAMPLED, FaultSet
from engine.input_batch import InputBatch
from engine.outputs import PreparedBatch
from engine.sample.state import RequestSamplingState


@dataclass(slots=True)
class PromptLogprobsInputs:
    """Prompt positions of one scheduled request whose raw logprobs are wanted this step."""

    req_id: str
    first_token: int  # prompt index of the token the first position predicts
    token_indices: list[int]  # batch token index of each position
    target_ids: list[int]  # the prompt token each position predicts
    num_logprobs: int


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    temperature: torch.Tensor | None = None  # [rows] (0: greedy); None when all greedy
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None  # [rows, V]
    min_tokens_mask: torch.Tensor | None = None  # [rows, V]: suppressed stop tokens
    prompt_mask: torch.Tensor | None = None  # [rows, V]
    output_counts: torch.Tensor | None = None  # [rows, V]
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # random rows
    unsampled_generators: list[torch.Generator] = field(default_factory=list)
    record_rows: list[int] = field(default_factory=list)  # rows whose distribution is recorded
    prompt_logprobs: list[PromptLogprobsInputs] = field(default_factory=list)

    @property
    def all_plain(self) -> bool:
        """Nothing to do but a raw argmax (the engine without sampling parameters)."""
        return self.all_greedy and not self.record_rows and self.logit_bias is None \
            and self.min_tokens_mask is None and self.output_counts is None


def drawing_rows(ib: InputBatch, sampled_rows: list[int], faults: FaultSet) -> list[int]:
    """Batch rows whose generators draw this step: exactly those that sample. A chunked
    prefill short of its prompt's end samples nothing, so its generator must not move
    (docs/bug_classes.md#sampling_generator_advanced_unsampled)."""
    if faults.on(SAMPLING_GENERATOR_ADVANCED_UNSAMPLED):
        return list(range(ib.num_reqs))
    return sampled_rows


def build_sampling_metadata(ib: InputBatch, pb: PreparedBatch, faults: FaultSet,
                            device: str) -> SamplingMetadata | None:
    """None when every row is plain greedy (the runner then takes the raw argmax)."""
    index = {rid: i for i, rid in enumerate(ib.req_ids)}
    rows = [index[rid] for rid in pb.sample_req_ids]
    sr = ib.sampling
    unsampled = [sr.request[b].generator for b in drawing_rows(ib, rows, faults)
                 if b not in rows and sr.request[b] is not None and sr.request[b].generator is not None]
    prompt_lp = _prompt_logprobs_inputs(ib)
    states = [sr.request[b] for b in rows]
    if all(st is None or st.is_plain for st in states) and not unsampled and not prompt_lp:
        return None
    # Logits row -> (batch row, draft offset).
    expand = [(b, j) for b, r in zip(rows, pb.sample_rows) for j in range(r)]
    brow = [b for b, _ in expand]
    md = SamplingMetadata(len(expand), all(st is None or st.params.is_greedy for st in states),
                          unsampled_generators=unsampled, prompt_logprobs=prompt_lp)
    if not md.all_greedy:
        for name in ("temperature", "top_k", "top_p", "min_p"):
            setattr(md, name, sr.column(name, brow, device))
    md.generators = {i: sr.request[b].generator for i, (b, _) in enumerate(expand)
                     if sr.request[b] is not None and sr.request[b].generator is not None}
    md.record_rows = [i for i, (b, _) in enumerate(expand)
                      if sr.request[b] is not None and sr.request[b].params.records_distribution]
    _logits_processor_inputs(md, ib, expand, device)
    return md


def _logits_processor_inputs(md: SamplingMetadata, ib: InputBatch, expand: list[tuple[int, int]],
                             device: str) -> None:
    """Logit bias, min_tokens and penalties: dense [rows, V] inputs, only when a row uses them."""
    sr, V = ib.sampling, ib.sampling.vocab_size
    states: list[RequestSamplingState | None] = [sr.request[b] for b, _ in expand]
    if any(st is not None and st.logit_bias is not None for st in states):
        md.logit_bias = _stack([None if st is None else st.logit_bias for st in states], V, torch.float32, device)
    if any(st is not None and st.stop_mask is not None for st in states):
        # Output index of each row's token: the request's outputs so far plus the drafts before it.
        early = torch.tensor([sr.num_output_tokens[b] + j < sr.min_tokens[b] for b, j in expand])
        stop = _stack([None if st is None else st.stop_mask for st in states], V, torch.bool, device)
        md.min_tokens_mask = stop & early[:, None].to(device)
    if any(st is not None and st.output_counts is not None for st in states):
        md.prompt_mask = _stack([None if st is None else st.prompt_mask for st in states], V, torch.bool, device)
        counts = _stack([sr.output_counts[b] for b, _ in expand], V, torch.int64, "cpu")
        for i, (b, j) in enumerate(expand):  # drafts verified before row j count as outputs
            if j and sr.output_counts[b] is not None:
                n = ib.num_tokens[b]
                counts[i] += torch.bincount(ib.token_ids[b, n:n + j], minlength=V)
        md.output_counts = counts.to(device)
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            setattr(md, name, sr.column(name, [b for b, _ in expand], device))


def _stack(rows: list[torch.Tensor | None], V: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    out = torch.zeros(len(rows), V, dtype=dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = r
    return out.to(device)


def _prompt_logprobs_inputs(ib: InputBatch) -> list[PromptLogprobsInputs]:
    """Scheduled prompt positions of requests that want prompt logprobs: the logits at
    position p give the logprob of prompt token p + 1 (token 0 has none). Every scheduled
    row counts, a chunk that samples nothing included."""
    out, start = [], 0
    for b in range(ib.num_reqs):
        st, n = ib.sampling.request[b], ib.num_scheduled[b]
        if st is not None and st.params.prompt_logprobs is not None:
            c0 = ib.num_computed_tokens[b]
            end = min(c0 + n, st.num_prompt_tokens - 1)
            if end > c0:
                out.append(PromptLogprobsInputs(
                    ib.req_ids[b], c0 + 1, [start + p - c0 for p in range(c0, end)],
                    ib.token_ids[b, c0 + 1:end + 1].tolist(), st.params.prompt_logprobs))
        start += n
    return out
