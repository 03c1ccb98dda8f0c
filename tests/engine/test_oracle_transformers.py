"""transformers' LlamaForCausalLM as an independent oracle for the engine's tp1pp1 eager logits.

The engine's seeded weights are written as a Hugging Face directory and loaded by
`LlamaForCausalLM.from_pretrained` (fp32, CPU, eval, eager attention). The oracle recomputes
each sequence from scratch at every generated position (prompt + tokens generated so far,
last position's logits), so paging, chunked prefill and preemption-recompute in the engine
are checked against plain causal attention over contiguous tokens.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from engine import ConfigError, EngineConfig, LLMEngine  # noqa: E402
from engine.weights import save_hf_checkpoint  # noqa: E402
from engine_testutil import mixed_arrivals, run_arrivals  # noqa: E402

ATOL = 1e-4
# Same weights, same math: equal up to BLAS kernels picking paths by the weights' memory
# alignment (safetensors tensors are views into one buffer); bitwise in practice.
LOAD_ATOL = 1e-6

# Model shapes: GQA (kv heads < heads), MHA (kv == heads, hidden != heads*head_dim), MQA.
SHAPES = {
    "gqa": dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, block_size=4, seed=0,
                max_model_len=64),
    "mha": dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, head_dim=8, intermediate_size=80, block_size=8, seed=1,
                rope_theta=500.0, max_model_len=64),
    "mqa": dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=1, head_dim=8, intermediate_size=96, block_size=2, seed=2,
                rms_norm_eps=1e-5, max_model_len=64),
}


def _lengths(bs: int) -> list[int]:
    """Prompt lengths around and across block boundaries, plus ones longer than the budget."""
    return [1, bs - 1, bs, bs + 1, 2 * bs + 3, 17, 33, 40, 5, 3 * bs - 1]


def chunked_config(shape: str) -> EngineConfig:
    # Budget 16 < the longest prompt (40): long prompts are prefilled in several chunks, and
    # chunks of several requests share a step.
    return EngineConfig(**SHAPES[shape], num_gpu_blocks=160, max_num_seqs=8, max_num_batched_tokens=16)


def preempt_config(shape: str) -> EngineConfig:
    """A cache of exactly max_model_len tokens for 8 requests of up to 40 tokens each: the
    scheduler must preempt (and recompute) to finish the batch."""
    bs = SHAPES[shape]["block_size"]
    return EngineConfig(**SHAPES[shape], num_gpu_blocks=64 // bs + 1, max_num_seqs=8,
                        max_num_batched_tokens=16)


def preempt_arrivals(shape: str):
    # 8 requests wanting ~230 tokens of KV at once against a 64-token cache.
    return mixed_arrivals(14, [30, 25, 28, 20, 12, 18, 27, 9], SHAPES[shape]["vocab_size"], (6, 10))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """shape -> (checkpoint dir, HF model); written and loaded once per module."""
    cache: dict[str, tuple[str, object]] = {}

    def get(shape: str):
        if shape not in cache:
            d = str(tmp_path_factory.mktemp(f"ckpt_{shape}"))
            save_hf_checkpoint(EngineConfig(**SHAPES[shape]), d)
            model = transformers.LlamaForCausalLM.from_pretrained(
                d, dtype=torch.float32, attn_implementation="eager").eval()
            cache[shape] = (d, model)
        return cache[shape]

    return get


def oracle_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Full recomputation: the last position's fp32 logits for this token sequence."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0, -1].float()


def check_against_oracle(model, trace, arrivals) -> tuple[float, int]:
    """Every generated position of every request: |engine - oracle| <= ATOL and the greedy
    token equals the oracle's argmax. Returns (worst error, positions checked)."""
    worst, checked = 0.0, 0
    for a in arrivals:
        recs = trace.tokens[a.req_id]
        assert len(recs) == a.max_tokens, f"{a.req_id}: {len(recs)} of {a.max_tokens} tokens"
        toks = [r.token for r in recs]
        for i, r in enumerate(recs):
            ref = oracle_logits(model, list(a.prompt) + toks[:i])
            err = (r.logits - ref).abs().max().item()
            assert err <= ATOL, f"{a.req_id} position {i} (step {r.step}): max |diff| {err:.3g} > {ATOL}"
            assert r.sampled == int(ref.argmax()), (
                f"{a.req_id} position {i}: engine greedy {r.sampled}, oracle {int(ref.argmax())}")
            assert r.token == r.sampled  # no teacher forcing here
            worst, checked = max(worst, err), checked + 1
    return worst, checked


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logits_match_transformers_with_chunked_prefill(shape, checkpoints):
    _, model = checkpoints(shape)
    cfg = chunked_config(shape)
    arrivals = mixed_arrivals(10 + cfg.seed, _lengths(cfg.block_size), cfg.vocab_size, (4, 8))
    assert len(arrivals) >= 8
    assert max(len(a.prompt) for a in arrivals) > cfg.max_num_batched_tokens
    e = LLMEngine(cfg)
    try:
        run_arrivals(e, arrivals)
        _, checked = check_against_oracle(model, e.trace, arrivals)
        assert checked == sum(a.max_tokens for a in arrivals)
    finally:
        e.shutdown()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_logits_match_transformers_under_preemption(shape, checkpoints):
    _, model = checkpoints(shape)
    cfg = preempt_config(shape)
    arrivals = preempt_arrivals(shape)
    e = LLMEngine(cfg)
    try:
        run_arrivals(e, arrivals)
        assert e.trace.num_preemptions > 0, "workload did not force a preemption"
        check_against_oracle(model, e.trace, arrivals)
    finally:
        e.shutdown()


def test_logits_match_transformers_with_staggered_arrivals(checkpoints):
    """Requests arriving while others decode: mixed decode/prefill steps still match."""
    shape = "gqa"
    _, model = checkpoints(shape)
    cfg = chunked_config(shape)
    first = mixed_arrivals(3, [9, 2, 30, 4], cfg.vocab_size, (5, 8), prefix="a")
    later = mixed_arrivals(4, [1, 13, 7, 26], cfg.vocab_size, (3, 6), prefix="b", at_step=3)
    e = LLMEngine(cfg)
    try:
        run_arrivals(e, first + later)
        check_against_oracle(model, e.trace, first + later)
    finally:
        e.shutdown()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_model_path_loads_the_same_logits_as_the_seeded_engine(shape, checkpoints):
    path, _ = checkpoints(shape)
    cfg = chunked_config(shape)
    arrivals = mixed_arrivals(5, [3, 11, 22], cfg.vocab_size, (3, 5))
    traces = []
    for c in (cfg, cfg.replace(model_path=path, seed=cfg.seed + 1000)):  # the seed must not matter
        e = LLMEngine(c)
        try:
            run_arrivals(e, arrivals)
            traces.append(e.trace)
        finally:
            e.shutdown()
    seeded, loaded = traces
    for a in arrivals:
        for r_s, r_l in zip(seeded.tokens[a.req_id], loaded.tokens[a.req_id], strict=True):
            err = (r_s.logits - r_l.logits).abs().max().item()
            assert err <= LOAD_ATOL, f"{a.req_id}: loaded logits differ by {err:.3g}"
            assert r_s.token == r_l.token


@pytest.mark.parametrize("field, value", [("intermediate_size", 64), ("vocab_size", 64),
                                          ("num_key_value_heads", 1), ("num_hidden_layers", 2)])
def test_model_path_rejects_a_checkpoint_whose_shapes_do_not_match_the_config(field, value, checkpoints):
    """A config that disagrees with the checkpoint must fail with a ConfigError naming
    model_path, not slice the checkpoint's tensors into a silently different model."""
    path, _ = checkpoints("gqa")
    cfg = EngineConfig(**SHAPES["gqa"]).replace(model_path=path, **{field: value})
    with pytest.raises(ConfigError, match="model_path"):
        e = LLMEngine(cfg)
        e.shutdown()
