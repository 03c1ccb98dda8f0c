"""What the engine's metadata promises beyond the FA contract, checked on every call of the
target model: the batch order (fuzz.verdict.properties.decodes_first: one-token rows before
longer ones), graph padding (padded_rows_null: padded block-table rows at the null block) and
the shape graph mode runs a batch at (graph_shape).
A reorder that leaves a row behind, or padded rows left pointing at live blocks, computes the
same tokens (attention is per row; a padded row has no keys), so only these checks see them."""
from __future__ import annotations

import pytest
import torch

from engine.input_batch import InputBatch
from engine.schedule import Schedule
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import FUZZ_MODEL
from engine.input_prep import InputPreparer
from engine.cuda_graph import CudagraphDispatcher
from fuzz.verdict.properties import FAViolation, decodes_first, graph_shape, padded_rows_null

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


GRAPH_CASE = Case(FUZZ_MODEL.replace(cudagraph_mode="FULL", capture_sizes=(4, 8, 16, 32)),
                  Workload((RequestSpec((1, 2, 3), 3), RequestSpec((4, 5, 6, 7, 8), 3), RequestSpec((9,), 3))),
                  Schedule())


def test_padded_rows_null() -> None:
    table = torch.tensor([[4, 5], [2, -9], [0, 0], [0, 0]])
    assert padded_rows_null(table, 2) is None and padded_rows_null(table[:2], 2) is None  # eager: no padding
    table[3, 1] = 5
    assert padded_rows_null(table, 2) == "padded row 3 points at blocks [5], not the null block 0"


def test_padded_rows_left_stale_are_seen_by_the_padding_check_only(harness, monkeypatch) -> None:
    """Graph-padded block-table rows left pointing at a live block (as a prepare that skips
    zeroing them after a larger batch): no kernel reads a row of no keys, so tokens and logits
    stay right; the padding check names the row."""
    copy = InputPreparer._copy_staging

    def stale_padding(self, microbatch, T_pad, R_pad):
        self.input_batch.block_table.table[self.input_batch.num_reqs:R_pad] = 1
        return copy(self, microbatch, T_pad, R_pad)

    harness.check(GRAPH_CASE)
    monkeypatch.setattr(InputPreparer, "_copy_staging", stale_padding)
    with pytest.raises(FAViolation, match=r"padded row \d+ points at blocks \[1\], not the null block 0"):
        harness.check(GRAPH_CASE)
    monkeypatch.setattr("fuzz.verdict.properties.padded_rows_null", lambda table, n: None)
    harness.check(GRAPH_CASE)  # without it, every other check passes


@pytest.mark.parametrize("mode, sizes, sp, tokens, graph, rows, bad", [
    ("FULL", (4, 8, 16, 32), False, 3, True, 4, False), ("FULL", (4, 8, 16, 32), False, 33, False, 33, False),
    ("FULL", (4, 8, 16, 32), False, 3, False, 3, True),  # a graph-mode batch run eager
    ("FULL", (4, 8, 16, 32), False, 3, True, 8, True),  # padded past the smallest graph that holds it
    ("FULL", (4, 6, 8), True, 5, True, 6, False), ("FULL", (4, 6, 8), True, 4, True, 4, False),
    ("FULL", (4, 6, 8), True, 4, True, 6, True),  # sequence parallel: rounded up to tp = 2, not past it
    ("FULL", (64, 128), False, 70, False, 70, False), ("FULL", (64, 128), False, 70, True, 128, False),  # past
    ("FULL", (64, 128), False, 5, False, 5, True),  # the budget of 64: eager, or a pooled engine's graph
    ("NONE", (), False, 5, False, 5, False), ("NONE", (), False, 5, False, 6, True),
])
def test_graph_shape(mode, sizes, sp, tokens, graph, rows, bad) -> None:
    cfg = FUZZ_MODEL.replace(tensor_parallel_size=2 if sp else 1, sequence_parallel=sp, cudagraph_mode=mode,
                             capture_sizes=sizes, max_num_batched_tokens=64)
    assert (graph_shape(cfg, graph, tokens, rows) is not None) == bad


def test_a_dispatcher_that_runs_graph_mode_eager_is_seen_by_the_graph_shape_only(harness, monkeypatch) -> None:
    """Graph mode that never replays a graph (as a flipped mode test in the dispatcher's setup)
    computes the same tokens eager; the shape check names the batch."""
    monkeypatch.setattr(CudagraphDispatcher, "dispatch", lambda self, num_tokens, num_reqs: None)
    with pytest.raises(FAViolation, match=r"graph shape: \d+ tokens ran eager at \d+ rows; cudagraph_mode=FULL"):
        harness.check(GRAPH_CASE)
    monkeypatch.setattr("fuzz.verdict.properties.graph_shape", lambda *a: None)
    harness.check(GRAPH_CASE)  # without it, every other check passes
