"""Reset poison: NaN (loud) or stale finite values (what GPU memory holds), deterministic."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.poison import POISON_INT, check_mode, fill_floats, fill_ints
from engine.schedule import Schedule


def test_nan_mode_fills_nan_and_out_of_range_indices():
    f, i = torch.zeros(4, 3), torch.zeros(5, dtype=torch.int32)
    fill_floats(f, "nan", "x")
    fill_ints(i, "nan", "y", high=10)
    assert f.isnan().all() and (i == POISON_INT).all()


def test_stale_mode_fills_finite_in_range_values_the_same_every_time():
    a, b = torch.zeros(64, 8), torch.zeros(64, 8)
    fill_floats(a, "stale", "hidden_states")
    fill_floats(b, "stale", "hidden_states")
    assert torch.isfinite(a).all() and torch.equal(a, b) and a.std() > 0.5
    qsl = torch.zeros(9, dtype=torch.int32)
    fill_ints(qsl, "stale", "query_start_loc", high=2 ** 30, step=8)
    assert qsl.tolist() == [8 * k for k in range(9)]  # monotone offsets of an earlier batch
    blocks = torch.zeros(4, 6, dtype=torch.int32)
    fill_ints(blocks, "stale", "block_table", low=1, high=17)
    assert blocks.min() >= 1 and blocks.max() < 17


def test_an_unknown_mode_is_refused_in_one_line():
    with pytest.raises(ValueError, match="poison: 'zeros' is not one of nan, stale"):
        check_mode("zeros")


def test_a_stale_read_gives_the_same_result_whatever_the_engine_ran_before():
    """Stale values come from the reset, not from earlier Cases: a pooled engine's verdict on a
    Case that reads unwritten memory does not depend on what it ran before."""
    cfg = EngineConfig(num_hidden_layers=2, pipeline_parallel_size=2, max_model_len=32, num_gpu_blocks=16)
    racy = (Schedule(copy_delay=1.0), ("intermediate_copy_unsynced",))

    def logits(eng, schedule, faults, prompt):
        eng.reset(schedule, faults, poison="stale")
        eng.add_request("a", prompt, 2)
        while eng.has_unfinished_requests():
            eng.step()
        return torch.stack([t.logits for t in eng.trace.tokens["a"]])

    fresh, used = LLMEngine(cfg), LLMEngine(cfg)
    try:
        logits(used, Schedule(), (), [9, 8, 7, 6, 5, 4, 3])  # leaves its activations behind
        logits(used, *racy, [1, 1, 2])
        late = logits(fresh, *racy, [3, 1, 4])
        assert not torch.equal(late, logits(fresh, Schedule(), (), [3, 1, 4]))  # it does read stale memory
        assert torch.equal(late, logits(used, *racy, [3, 1, 4]))
    finally:
        fresh.shutdown()
        used.shutdown()
