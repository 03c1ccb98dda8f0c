"""The data that crosses the engine's boundaries (vLLM v1's `v1/core/sched/output.py` and
`v1/outputs.py`).

The driver's scheduler ships a `SchedulerOutput` to every rank; a rank's runner turns it
into a `PreparedBatch` on the host, executes that and answers with a `ModelRunnerOutput`;
an executor reports a rank that raised, hung or deadlocked as a `RankFailure`. Data only,
importing nothing of the engine: the scheduler, the runner and the executors all import
downward from here, never from one another's modules.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


# -- scheduler -> ranks -------------------------------------------------------------------
@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt (plus outputs so far, after a preemption)
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: object = None  # engine/sample SamplingParams; None: plain greedy


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One microbatch, as shipped to every rank."""

    microbatch: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


# -- a rank's host phase -> its device phase ------------------------------------------------
@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The padded shape a graph was captured for."""

    num_tokens: int
    num_reqs: int


@dataclass(slots=True)
class EagleInputs:
    """Host inputs of one microbatch's EAGLE proposal, taken at prepare time (with PP the host
    may prepare the next microbatch into the persistent InputBatch before this one runs)."""

    next_token_ids: torch.Tensor  # [T] the token after each scheduled token (sampled rows: filled later)
    batch_rows: list[int]  # batch row of each sampling request
    first_positions: list[int]  # position of its first logits row
    drafts: list[list[int]]  # the drafts it verifies this step
    sample_rows: list[int]  # its number of logits rows (1 + drafts)
    logits_indices: list[int]  # token index of every logits row


@dataclass(slots=True)
class PreparedBatch:
    """One microbatch after the host phase: its shapes, host scalars and sampling rows; its
    tensors are in the runner's staging buffers, their copies to the device issued."""

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
    sampling_metadata: object = None  # engine/sample SamplingMetadata; None: raw argmax
    # Async scheduling (engine/async_sched.py): (input index, request) of each placeholder
    # input, filled on the device; batch row of each sampling request; the request -> row
    # map a later step's fill reads this step's sampled tokens by.
    placeholder_fills: list[tuple[int, str]] = field(default_factory=list)
    sample_batch_rows: list[int] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    # Requests finished before this step: their kept sampled tokens are dropped when this step
    # executes, in step order (a step scheduled earlier may still fill a placeholder of one).
    finished_req_ids: frozenset[str] = frozenset()


# -- ranks -> driver ----------------------------------------------------------------------
@dataclass(slots=True)
class ModelRunnerOutput:
    """A rank's answer to one microbatch (the last PP stage's; others answer None)."""

    microbatch: int
    rank: int
    req_ids: list[str]  # requests that sampled this step, in batch order
    sampled_token_ids: list[list[int]]  # per request: the token sampled from each of its logits rows
    logits: torch.Tensor  # [sum(rows), vocab] fp32 on CPU, raw; 1 row per request, 1 + k with drafts
    num_tokens: dict[str, int]  # per sampled request: tokens this rank knew (engine invariant)
    draft_token_ids: dict[str, list[int]] | None = None  # EAGLE drafts (last PP stage only)
    # Sampling (engine/sample/sampler.py); None / empty when every row is plain greedy.
    processed_logprobs: torch.Tensor | None = None  # [sum(rows), vocab] fp32 CPU, -inf where masked
    sample_noise: dict[int, torch.Tensor] = field(default_factory=dict)  # logits row -> Exp(1) draw
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


class RankFailure(RuntimeError):
    """A rank raised, hung or deadlocked; `ranks` names them."""

    def __init__(self, kind: str, ranks: list[int], detail: str) -> None:
        self.kind, self.ranks, self.detail = kind, ranks, detail
        super().__init__(f"{kind} on rank(s) {ranks}: {detail}")
