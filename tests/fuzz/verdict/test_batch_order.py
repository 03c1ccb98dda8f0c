"""The batch order the engine's metadata promises (fuzz.verdict.properties.decodes_first):
one-token rows before longer ones in every call of the target model. A reorder that leaves a
row behind computes the same tokens (attention is per row), so only this check sees it."""
from __future__ import annotations

import pytest
import torch

from engine.input_batch import InputBatch
from engine.schedule import Schedule
from fuzz.case import Case, RequestSpec, Workload
from fuzz.strategies import FUZZ_MODEL
from fuzz.verdict.properties import FAViolation, decodes_first

# A 7-token prompt prefilled in chunks of 5 beside a 1-token one: from the second step, the
# long prompt's chunk (admitted first, row 0) runs beside the short one's decode.
CASE = Case(FUZZ_MODEL.replace(max_num_batched_tokens=5),
            Workload((RequestSpec(tuple(range(1, 8)), 3), RequestSpec((9,), 3))), Schedule())


@pytest.mark.parametrize("q_lens, num_reqs, bad", [
    ([1, 1, 3, 5], 4, False), ([4, 2], 2, False), ([1, 1], 2, False), ([1, 3, 0, 0], 4, False),  # graph padding
    ([3, 1], 2, True), ([1, 2, 1], 3, True), ([2, 1, 0], 3, True), ([2, 1], 1, False),  # rows past num_reqs
])
def test_decodes_first(q_lens, num_reqs, bad) -> None:
    cu = torch.tensor([0] + q_lens).cumsum(0)
    assert (decodes_first(cu, num_reqs) is not None) == bad


def test_the_engines_calls_keep_the_order(harness) -> None:
    harness.check(CASE)


def test_a_reorder_that_does_nothing_is_seen_by_the_batch_order_only(harness, monkeypatch) -> None:
    """Tokens and logits equal the reference's (attention is per row, whatever the order);
    the check names the row that runs one token after a longer one."""
    monkeypatch.setattr(InputBatch, "reorder_batch", lambda self, swap_block_table=True: None)
    with pytest.raises(FAViolation) as e:
        harness.check(CASE)
    assert "batch order: row 1 runs 1 token after row 0 runs 2" in e.value.message
    monkeypatch.setattr("fuzz.verdict.properties.decodes_first", lambda cu, n: None)
    harness.check(CASE)  # without it, every other check passes
