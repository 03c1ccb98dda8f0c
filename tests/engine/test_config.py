"""EngineConfig rejects every impossible value with a one-line ConfigError naming the field,
before any rank starts; parse_layout rejects malformed layout strings the same way."""
from __future__ import annotations

import pytest

from engine import ConfigError, EngineConfig, LLMEngine, parse_layout


def assert_config_error(field: str, make) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        make()
    msg = str(info.value)
    assert "\n" not in msg, f"multi-line message: {msg!r}"
    assert msg.startswith(f"{field}:"), f"message does not name {field!r} first: {msg!r}"
    return info.value


def test_default_config_is_valid():
    cfg = EngineConfig()
    assert cfg.layout == "tp1pp1" and cfg.world_size == 1


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "block_size",
                                   "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                                   "max_model_len", "tensor_parallel_size", "pipeline_parallel_size"])
@pytest.mark.parametrize("value", [-4, 0, 2.5, True, "8"])
def test_non_positive_or_non_int_dims(field, value):
    assert_config_error(field, lambda: EngineConfig(**{field: value}))


@pytest.mark.parametrize("heads, kv", [(4, 3), (6, 4), (8, 16)])
def test_heads_not_divisible_by_kv_heads(heads, kv):
    err = assert_config_error("num_key_value_heads",
                              lambda: EngineConfig(num_attention_heads=heads, num_key_value_heads=kv))
    assert str(kv) in str(err) and str(heads) in str(err)


def test_odd_head_dim_cannot_take_rope():
    assert_config_error("head_dim", lambda: EngineConfig(head_dim=15))


@pytest.mark.parametrize("kw", [dict(max_model_len=256), dict(num_gpu_blocks=10, block_size=4),
                                dict(max_model_len=33, num_gpu_blocks=9, block_size=4)])
def test_max_model_len_must_fit_the_cache(kw):
    assert_config_error("max_model_len", lambda: EngineConfig(**kw))
    # ... and the boundary itself is fine: (num_gpu_blocks - 1) * block_size tokens.
    ok = EngineConfig(num_gpu_blocks=9, block_size=4, max_model_len=32)
    assert ok.max_blocks_per_req == 8


def test_too_few_blocks_for_the_null_block():
    assert_config_error("num_gpu_blocks", lambda: EngineConfig(num_gpu_blocks=1, max_model_len=1))


@pytest.mark.parametrize("dtype", ["fp32", "float8", "torch.float32", "", "int32"])
def test_bad_dtype(dtype):
    assert_config_error("dtype", lambda: EngineConfig(dtype=dtype))


@pytest.mark.parametrize("field, value", [("attention_backend", "flash"), ("cudagraph_mode", "full"),
                                          ("world", "mpi"), ("device", "tpu")])
def test_bad_choices(field, value):
    assert_config_error(field, lambda: EngineConfig(**{field: value}))


def test_graph_mode_needs_capture_sizes():
    assert_config_error("capture_sizes", lambda: EngineConfig(cudagraph_mode="FULL"))
    assert_config_error("capture_sizes", lambda: EngineConfig(cudagraph_mode="FULL", capture_sizes=(0, 4)))


def test_no_chunked_prefill_needs_a_budget_of_max_model_len():
    assert_config_error("max_num_batched_tokens",
                        lambda: EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64))


@pytest.mark.parametrize("layout", ["tp3", "tp8", "tp3pp2"])
def test_layout_tp_must_divide_heads(layout):
    assert_config_error("layout", lambda: EngineConfig().replace(layout=layout))


def test_layout_kv_heads_split_or_replicated():
    # tp=4 over 6 kv heads: neither divides the other.
    assert_config_error("layout", lambda: EngineConfig(num_attention_heads=12, num_key_value_heads=6)
                        .replace(layout="tp4"))
    # Replication is fine: tp=4 over 2 kv heads.
    assert EngineConfig().replace(layout="tp4").tp == 4


def test_layout_vocab_and_intermediate_divisible_by_tp():
    assert_config_error("layout", lambda: EngineConfig(vocab_size=130).replace(layout="tp4"))
    assert_config_error("layout", lambda: EngineConfig(intermediate_size=130).replace(layout="tp4"))


@pytest.mark.parametrize("layout", ["pp5", "tp2pp8"])
def test_more_stages_than_layers(layout):
    err = assert_config_error("layout", lambda: EngineConfig(num_hidden_layers=4).replace(layout=layout))
    assert "layers" in str(err)


def test_sequence_parallel_needs_tp():
    assert_config_error("sequence_parallel", lambda: EngineConfig(sequence_parallel=True))


@pytest.mark.parametrize("bad", ["", "   ", "tp", "pp", "tp2pp", "pp2tp2", "tpx", "tp-1", "tp0", "pp0",
                                 "tp1pp0", "tp2 pp2", "2x4", "tp2,pp4", "dp2", "tp2pp4tp1"])
def test_parse_layout_rejects_bad_strings(bad):
    assert_config_error("layout", lambda: parse_layout(bad))


@pytest.mark.parametrize("good, tp, pp", [("tp1pp1", 1, 1), ("pp8", 1, 8), ("tp8", 8, 1), ("tp2pp4", 2, 4),
                                          ("TP2PP4", 2, 4), (" tp4pp2 ", 4, 2)])
def test_parse_layout_accepts_good_strings(good, tp, pp):
    assert parse_layout(good) == (tp, pp)


def test_replace_layout_sets_both_degrees():
    cfg = EngineConfig(num_hidden_layers=8).replace(layout="tp2pp4")
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.layout) == (2, 4, "tp2pp4")


def test_from_dict_round_trips_and_rejects_unknown_fields():
    cfg = EngineConfig(capture_sizes=(8, 2, 2), cudagraph_mode="FULL")
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.capture_sizes == (2, 8)
    assert_config_error("config", lambda: EngineConfig.from_dict({**cfg.to_dict(), "tp": 2}))


@pytest.mark.parametrize("field, value", [("rope_theta", 0.0), ("rope_theta", -10000.0),
                                          ("rms_norm_eps", -1.0), ("step_timeout_s", 0.0)])
def test_non_positive_float_settings(field, value):
    """rope_theta <= 0 makes RoPE NaN, a negative eps can make RMSNorm NaN, a zero step
    timeout fails every step: impossible values, so they must not reach a rank."""
    assert_config_error(field, lambda: EngineConfig(**{field: value}))


@pytest.mark.parametrize("req, field_hint", [
    (("r", [], 4), "empty prompt"),
    (("r", [1] * 120, 9), "max_model_len"),
    (("r", [128], 1), "vocab_size"),
    (("r", [-1], 1), "vocab_size"),
])
def test_bad_requests_rejected_before_any_rank_runs(req, field_hint):
    e = LLMEngine(EngineConfig())
    try:
        with pytest.raises(ConfigError, match=field_hint):
            e.add_request(*req)
        assert not e.has_unfinished_requests()
        e.add_request("ok", [1, 2], 2)
        with pytest.raises(ConfigError, match="duplicate"):
            e.add_request("ok", [3], 1)
    finally:
        e.shutdown()
