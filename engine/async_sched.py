"""Asynchronous scheduling (vLLM v1's `async_scheduling`): step N+1 is scheduled before step
N's sampled tokens are back.

Driver side (engine/scheduler.py): a decode whose step in flight samples one token runs
ahead, scheduled again with `PLACEHOLDER_TOKEN_ID` for that token (vLLM's -1 placeholders,
`num_output_placeholders`). Rank side (this module): every rank whose first stage reads
input ids keeps the device-side tokens of each request's last sampling step (vLLM's
`input_batch.prev_sampled_token_ids` and `prev_req_id_to_index`) and fills each placeholder
from them before the forward reads it (`_prepare_input_ids`). Placeholders never reach the
driver's token lists, so prefix-cache hashes, stop checks and penalties see real tokens.
"""
from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1


class PrevSampledTokens:
    """Per request: the device tensor of the last microbatch it sampled in (one token per
    batch row) and its row there. Per request, not per microbatch: with PP, other microbatches
    may execute between a request's step and the step that ran ahead of it."""

    def __init__(self) -> None:
        self.by_req: dict[str, tuple[torch.Tensor, int]] = {}

    def reset(self) -> None:
        self.by_req.clear()

    def drop(self, req_ids) -> None:
        for rid in req_ids:
            self.by_req.pop(rid, None)

    def record(self, sampled: torch.Tensor, num_reqs: int, sample_batch_rows: list[int],
               sample_rows: list[int], req_id_to_index: dict[str, int]) -> None:
        """`sampled`: this microbatch's sampled ids, one per logits row (1 + drafts per
        sampling request, in batch order); a request's next input is its first row's token
        (a request with drafts never runs ahead). Rows that sampled nothing keep 0."""
        if not sample_batch_rows:
            return
        first = torch.tensor([sum(sample_rows[:i]) for i in range(len(sample_rows))], dtype=torch.int64,
                             device=sampled.device)
        per_row = torch.zeros(num_reqs, dtype=torch.int64, device=sampled.device)
        per_row[torch.tensor(sample_batch_rows, dtype=torch.int64, device=sampled.device)] = sampled[first]
        for rid, row in req_id_to_index.items():
            self.by_req[rid] = (per_row, row)

    def fill(self, input_ids: torch.Tensor, fills: list[tuple[int, str]]) -> None:
        """Write each placeholder's token (index into this batch's input ids, request) from
        the request's last sampled step, on the device, before the forward reads it."""
        if not fills:
            return
        vals = []
        for _, rid in fills:
            if rid not in self.by_req:
                raise RuntimeError(f"request {rid}: a placeholder input but no sampled token on this rank")
            t, row = self.by_req[rid]
            vals.append(t[row])
        idx = torch.tensor([i for i, _ in fills], dtype=torch.int64, device=input_ids.device)
        input_ids[idx] = torch.stack(vals)
