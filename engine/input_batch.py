"""InputBatch: the persistent per-request rows a rank keeps across steps, and CpuGpuBuffer.

Rows hold exactly the requests of the microbatch being prepared. `swap_states` moves every
per-request row together (token ids, counts, block-table row, id, sampling columns), because
a request attended or sampled with another request's state is
docs/bug_classes.md#reorder_partial_swap (and #sampling_penalty_stale_row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.async_copy import AsyncCopier, CopyHandle
from engine.poison import fill_ints
from engine.sample.state import RequestSamplingState, SamplingRows


class CpuGpuBuffer:
    """A host staging tensor (pinned on CUDA) and its device twin at a fixed address."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: str) -> None:
        pin = device.startswith("cuda")
        self.cpu = torch.zeros(*shape, dtype=dtype, pin_memory=pin)
        self.gpu = torch.zeros(*shape, dtype=dtype, device=device)

    def copy_to_gpu(self, copier: AsyncCopier, n: int | None = None) -> CopyHandle:
        if n is None:
            return copier.copy(self.gpu, self.cpu)
        return copier.copy(self.gpu[:n], self.cpu[:n])

    def poison(self, mode: str, role: str, **stale) -> None:
        """Both twins as a reset leaves them (engine/poison.py; `stale`: fill_ints' range)."""
        for t in (self.cpu, self.gpu):
            fill_ints(t, mode, role, **stale)


@dataclass(slots=True)
class CachedRequestState:
    """What a rank knows of one request (vLLM's name)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState | None = None  # None: plain greedy


class BlockTable:
    """Per-row block ids; row i belongs to the request in InputBatch row i."""

    def __init__(self, max_rows: int, max_blocks: int, pin: bool = False) -> None:
        # Pinned on CUDA, as in vLLM: its non_blocking copy then reads it when the DMA runs.
        self.table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.num_blocks = [0] * max_rows

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.table[row, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[row] = len(block_ids)

    def swap_row(self, i: int, j: int) -> None:
        self.table[[i, j]] = self.table[[j, i]]
        self.num_blocks[i], self.num_blocks[j] = self.num_blocks[j], self.num_blocks[i]


class InputBatch:
    """Persistent rows: req_ids[i], token_ids[i], num_tokens[i], num_computed_tokens[i],
    block table row i, sampling columns row i. `num_scheduled[i]` is this microbatch's token
    count for row i. `sampling` also keeps each request's sampling state until it finishes."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks: int, pin: bool = False,
                 vocab_size: int | None = None, seed: int = 0, device: str = "cpu") -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int64)
        self.num_tokens = [0] * max_num_reqs
        self.num_computed_tokens = [0] * max_num_reqs
        self.num_scheduled = [0] * max_num_reqs
        self.block_table = BlockTable(max_num_reqs, max_blocks, pin)
        self.sampling = SamplingRows(max_num_reqs, vocab_size, seed, device)
        self.req_ids: list[str] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def clear(self) -> None:
        self.req_ids = []

    def add_request(self, st: CachedRequestState, num_scheduled: int) -> int:
        row = len(self.req_ids)
        self.req_ids.append(st.req_id)
        n = len(st.token_ids)
        self.token_ids[row, :n] = torch.tensor(st.token_ids, dtype=torch.int64)
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = st.num_computed_tokens
        self.num_scheduled[row] = num_scheduled
        self.block_table.set_row(row, st.block_ids)
        self.sampling.add_row(row, st.sampling, st.token_ids)
        return row

    def swap_states(self, i: int, j: int, *, swap_block_table: bool = True) -> None:
        if i == j:
            return
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.token_ids[[i, j]] = self.token_ids[[j, i]]
        for arr in (self.num_tokens, self.num_computed_tokens, self.num_scheduled):
            arr[i], arr[j] = arr[j], arr[i]
        if swap_block_table:
            self.block_table.swap_row(i, j)
        self.sampling.swap(i, j)

    def reorder_batch(self, *, swap_block_table: bool = True) -> None:
        """Decodes (one scheduled token) first, then prefills, by swapping rows in place."""
        decode = [self.num_scheduled[i] == 1 for i in range(self.num_reqs)]
        front, back = 0, self.num_reqs - 1
        while front < back:
            if decode[front]:
                front += 1
            elif not decode[back]:
                back -= 1
            else:
                self.swap_states(front, back, swap_block_table=swap_block_table)
                decode[front], decode[back] = True, False
