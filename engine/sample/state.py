"""A rank's sampling state: per request (RequestSamplingState, kept across steps and across a
preemption) and per InputBatch row (SamplingRows, moved with the row by swap_states).

vLLM v1 keeps the same split: CachedRequestState holds a request's generator and output
token ids, and the persistent InputBatch holds per-row tensors (temperature, top_k, ...,
penalties) plus references to each row's request state (`req_output_token_ids`,
`generators`), which every swap and condense must move together with the row.
"""
from __future__ import annotations

import torch

from engine.faults import SAMPLING_PENALTY_STALE_ROW, FaultSet
from engine.poison import POISON_INT
from engine.sample.sampling_params import DEFAULT, SamplingParams, request_seed

# Per-row scalars: (name, value of a plain greedy row); all but the last are SamplingParams fields.
_FLOAT_ROWS = (("temperature", 0.0), ("top_p", 1.0), ("min_p", 0.0), ("presence_penalty", 0.0),
               ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
_INT_ROWS = (("top_k", 0), ("min_tokens", 0), ("num_output_tokens", 0))
_PARAM_ROWS = _FLOAT_ROWS + _INT_ROWS[:2]


class RequestSamplingState:
    """What a rank keeps of one request's sampling until it finishes: params, generator,
    dense per-token vectors (CPU) and the counts of its output tokens so far."""

    def __init__(self, req_id: str, params: SamplingParams, num_prompt_tokens: int,
                 prompt_token_ids: list[int], vocab_size: int, engine_seed: int, device: str) -> None:
        self.req_id, self.params, self.num_prompt_tokens = req_id, params, num_prompt_tokens
        V = vocab_size
        self.generator: torch.Generator | None = None
        if not params.is_greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(request_seed(params, engine_seed, req_id))
        self.logit_bias: torch.Tensor | None = None
        if params.logit_bias:
            self.logit_bias = torch.zeros(V, dtype=torch.float32)
            ids, bias = zip(*params.logit_bias)
            self.logit_bias[list(ids)] = torch.tensor(bias, dtype=torch.float32)
        self.stop_mask: torch.Tensor | None = None  # what min_tokens suppresses
        if params.min_tokens > 0 and params.stop_token_ids:
            self.stop_mask = torch.zeros(V, dtype=torch.bool)
            self.stop_mask[list(params.stop_token_ids)] = True
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        self._num_counted = 0
        if params.has_penalties:
            self.prompt_mask = torch.zeros(V, dtype=torch.bool)
            self.prompt_mask[prompt_token_ids[:num_prompt_tokens]] = True
            self.output_counts = torch.zeros(V, dtype=torch.int64)

    @property
    def is_plain(self) -> bool:
        """Argmax of the raw logits, nothing recorded: what an engine without sampling does."""
        return not self.params.records_distribution and self.params.prompt_logprobs is None

    def sync_output_counts(self, token_ids: list[int]) -> None:
        """Count the output tokens appended since the last sync (outputs only ever grow)."""
        if self.output_counts is None:
            return
        new = token_ids[self.num_prompt_tokens + self._num_counted:]
        if new:
            self.output_counts += torch.bincount(torch.tensor(new), minlength=self.output_counts.numel())
            self._num_counted += len(new)


class SamplingRows:
    """The sampling columns of the InputBatch: scalars per row (plain lists: written for every
    row of every microbatch, read for the sampled rows only) and, per row, references to its
    request's state and output counts. Also the rank's store of request states."""

    def __init__(self, max_rows: int, vocab_size: int | None, engine_seed: int, device: str) -> None:
        self.vocab_size, self.engine_seed, self.device = vocab_size, engine_seed, device
        self.faults = FaultSet()
        self.states: dict[str, RequestSamplingState] = {}
        self.max_rows = max_rows
        self.reset("stale")

    # -- the store ------------------------------------------------------------------------------
    def request_state(self, req_id: str, params: SamplingParams | None,
                      token_ids: list[int]) -> RequestSamplingState | None:
        """A request's state when a rank (re)admits it: the one it had before a preemption, so
        its generator goes on where it stopped, else a new one. A request's first admission
        carries its prompt alone (outputs exist only once it ran), which fixes its length."""
        if req_id in self.states:
            return self.states[req_id]
        if params is None or params == DEFAULT:
            return None
        st = RequestSamplingState(req_id, params, len(token_ids), token_ids, self.vocab_size,
                                  self.engine_seed, self.device)
        self.states[req_id] = st
        return st

    def drop(self, req_ids) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)

    def reset(self, poison: str) -> None:
        """Forget every request; the row scalars hold NaN / an out-of-range int (poison "nan")
        or a plain row's values ("stale"), so a read of a row no request was added to shows."""
        self.states.clear()
        for name, neutral in _FLOAT_ROWS:
            setattr(self, name, [float("nan") if poison == "nan" else neutral] * self.max_rows)
        for name, neutral in _INT_ROWS:
            setattr(self, name, [POISON_INT if poison == "nan" else neutral] * self.max_rows)
        self.request: list[RequestSamplingState | None] = [None] * self.max_rows
        self.output_counts: list[torch.Tensor | None] = [None] * self.max_rows

    # -- rows -----------------------------------------------------------------------------------
    def add_row(self, row: int, st: RequestSamplingState | None, token_ids: list[int]) -> None:
        params = DEFAULT if st is None else st.params
        for name, _ in _PARAM_ROWS:
            getattr(self, name)[row] = getattr(params, name)
        self.num_output_tokens[row] = 0 if st is None else len(token_ids) - st.num_prompt_tokens
        if st is not None:
            st.sync_output_counts(token_ids)
        self.request[row] = st
        self.output_counts[row] = None if st is None else st.output_counts

    def swap(self, i: int, j: int) -> None:
        """Every column moves with its row; penalties that read another row's output counts
        are docs/bug_classes.md#sampling_penalty_stale_row."""
        for name, _ in _FLOAT_ROWS + _INT_ROWS:
            col = getattr(self, name)
            col[i], col[j] = col[j], col[i]
        self.request[i], self.request[j] = self.request[j], self.request[i]
        if self.faults.on(SAMPLING_PENALTY_STALE_ROW):
            return
        self.output_counts[i], self.output_counts[j] = self.output_counts[j], self.output_counts[i]

    def column(self, name: str, rows: list[int], device: str) -> torch.Tensor:
        """A scalar column for the given rows, as a tensor on `device`."""
        dtype = torch.float32 if any(name == n for n, _ in _FLOAT_ROWS) else torch.int64
        col = getattr(self, name)
        return torch.tensor([col[b] for b in rows], dtype=dtype, device=device)
