"""Graph mode: capture with padding replays bitwise like eager, and bakes scalars faithfully."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.cuda_graph import BatchDescriptor, CudagraphDispatcher

BASE = EngineConfig(num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    max_num_batched_tokens=16, max_model_len=64, num_gpu_blocks=64)
SIZES = (4, 8, 12)  # a 16-token prefill chunk is larger than every size: runs eager


def workload(seed: int = 0):
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(128) for _ in range(rng.choice([1, 2, 5, 7, 9, 20, 30]))],
             rng.randint(2, 5), rng.randint(0, 3)) for i in range(6)]


def run(engine: LLMEngine, reqs, faults=()):
    engine.reset(faults=faults)
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, prompt, n)
        if engine.has_unfinished_requests():
            engine.step()
        step += 1
    return engine.trace


def test_dispatcher_pads_to_smallest_size():
    d = CudagraphDispatcher((8, 4, 16), max_num_reqs=8)
    assert d.dispatch(1, 1) == BatchDescriptor(4, 8)
    assert d.dispatch(5, 3) == BatchDescriptor(8, 8)
    assert d.dispatch(16, 8) == BatchDescriptor(16, 8)
    assert d.dispatch(17, 2) is None  # larger than every captured size: eager
    assert CudagraphDispatcher((4, 6, 8), 8, multiple_of=4).dispatch(5, 1) == BatchDescriptor(8, 8)


@pytest.mark.parametrize("layout,sp", [("tp1pp1", False), ("tp2pp4", False), ("tp1pp8", False), ("tp2pp2", True)])
def test_graph_equals_eager_bitwise(layout, sp):
    eager = LLMEngine(BASE.replace(layout=layout, sequence_parallel=sp))
    graph = LLMEngine(BASE.replace(layout=layout, sequence_parallel=sp, cudagraph_mode="FULL", capture_sizes=SIZES),
                      record_fa=True)
    try:
        for seed in range(2):
            a, b = run(eager, workload(seed)), run(graph, workload(seed))
            records = graph.collect_fa_records()
            replays = {r.microbatch for r in records if r.graph}
            eager_steps = {r.microbatch for r in records if not r.graph}
            assert replays and eager_steps, "workload must mix padded replays and oversized eager batches"
            assert any(r.num_actual_tokens not in SIZES for r in records if r.graph), "no batch needed padding"
            for rid in a.tokens:
                assert [t.token for t in a.tokens[rid]] == [t.token for t in b.tokens[rid]]
                for x, y in zip(a.tokens[rid], b.tokens[rid]):
                    assert torch.equal(x.logits, y.logits), f"{layout} {rid} step {y.step}"
        counts = graph.executor.workers[0].runner.graphs
        assert 1 <= counts.num_graphs <= len(SIZES) and counts.capture_seconds > 0
    finally:
        eager.shutdown()
        graph.shutdown()


def test_a_python_value_changed_after_capture_does_not_reach_the_replay():
    """A CUDA graph keeps the scalars of its capture; the CPU replay runs the captured graph,
    so a runner attribute the forward reads (the attention scale), changed after capture,
    changes eager logits but not replayed ones."""
    reqs = [("a", [1, 2, 3], 3, 0)]  # every step fits size 8: all replays
    graph = LLMEngine(BASE.replace(cudagraph_mode="FULL", capture_sizes=(8,)), record_fa=True)
    eager = LLMEngine(BASE)
    try:
        g0, e0 = run(graph, reqs), run(eager, reqs)
        assert all(r.graph for r in graph.collect_fa_records())
        for e in (graph, eager):
            e.executor.workers[0].runner.scale *= 4.0
        g1, e1 = run(graph, reqs), run(eager, reqs)
        assert not torch.equal(e0.tokens["a"][0].logits, e1.tokens["a"][0].logits)  # the change matters
        for x, y in zip(g0.tokens["a"], g1.tokens["a"]):
            assert torch.equal(x.logits, y.logits), f"step {y.step}: the replay saw the new scale"
    finally:
        graph.shutdown()
        eager.shutdown()


def test_tp_ranks_and_pooled_engines_share_one_trace_per_code_path():
    """Tracing is the cost of a CPU capture: the TP ranks of a stage, and a second engine that
    differs only in what the forward does not read (KV blocks, token budget), reuse it. A
    capture is traced part by part, and the layers after the first share one trace."""
    from engine import cpu_graph

    cpu_graph.clear_templates()
    cfg = BASE.replace(layout="tp2pp1", cudagraph_mode="FULL", capture_sizes=(8,))
    before = dict(cpu_graph.STATS)
    for c in (cfg, cfg.replace(num_gpu_blocks=48, max_num_batched_tokens=12)):
        eng = LLMEngine(c)
        try:
            run(eng, [("a", [1, 2, 3], 2, 0)])
        finally:
            eng.shutdown()
    # 4 captures (2 engines x 2 TP ranks) of 10 parts: before the layers, the first layer
    # (no residual yet), the 7 others, after the layers. Traced: 4 parts, once.
    assert cpu_graph.STATS["traces"] - before["traces"] == 4
    assert cpu_graph.STATS["shared"] - before["shared"] == 4 * 10 - 4


def test_captures_baking_other_scalars_share_traces_and_replay_their_own():
    """The scalars a capture bakes (max_seqlen_q/k, the padded request count) and the KV
    cache's geometry reach the forward only through the attention op: engines differing in
    max_model_len and block_size, and batches baking other scalars, replay one trace per
    code path, each replay with its own capture's scalars, bitwise its own eager run."""
    from engine import cpu_graph

    cpu_graph.clear_templates()
    reqs = [("a", [1, 2, 3, 4, 5], 3, 0), ("b", [6, 7], 2, 1)]
    cfgs = [BASE.replace(cudagraph_mode="FULL", capture_sizes=(8,), max_model_len=m, block_size=b)
            for m, b in ((64, 4), (128, 8))]
    before = dict(cpu_graph.STATS)
    for cfg in cfgs:
        graph, eager = LLMEngine(cfg, record_fa=True), LLMEngine(cfg.replace(cudagraph_mode="NONE", capture_sizes=()))
        try:
            g, e = run(graph, reqs), run(eager, reqs)
            baked = {r.max_seqlen_k for r in graph.collect_fa_records() if r.graph}
            assert baked == {cfg.max_model_len}, "each replay passes the max_seqlen_k its capture baked"
        finally:
            graph.shutdown()
            eager.shutdown()
        for rid, _, _, _ in reqs:
            for x, y in zip(g.tokens[rid], e.tokens[rid]):
                assert torch.equal(x.logits, y.logits), f"{cfg.max_model_len}: {rid} step {x.step}"
    # One capture per engine (size 8) of 10 parts: traced once (4 parts), then shared.
    assert cpu_graph.STATS["traces"] - before["traces"] == 4
    assert cpu_graph.STATS["shared"] - before["shared"] == 2 * 10 - 4


def test_pipeline_stages_share_their_layers_trace():
    """A layer's trace does not depend on its index or stage: pp8 traces the first stage's
    layer (no residual yet) and one layer for the seven others, where a whole-stage trace
    per stage traced eight; and the replay is bitwise the eager forward."""
    from engine import cpu_graph

    cpu_graph.clear_templates()
    cfg = BASE.replace(layout="tp1pp8", cudagraph_mode="FULL", capture_sizes=(8,))
    before = dict(cpu_graph.STATS)
    graph, eager = LLMEngine(cfg), LLMEngine(cfg.replace(cudagraph_mode="NONE", capture_sizes=()))
    try:
        reqs = [("a", [1, 2, 3], 3, 0), ("b", [4, 5], 2, 1)]
        g, e = run(graph, reqs), run(eager, reqs)
    finally:
        graph.shutdown()
        eager.shutdown()
    # Layers: 2 traces. Before and after the layers: the first stage, the middle six (one
    # trace each), the last stage (is_first and is_last are read there).
    assert cpu_graph.STATS["traces"] - before["traces"] == 2 + 3 + 3
    assert cpu_graph.STATS["shared"] - before["shared"] == 8 * 3 - 8
    for rid in ("a", "b"):
        for x, y in zip(g.tokens[rid], e.tokens[rid]):
            assert torch.equal(x.logits, y.logits), f"{rid} step {x.step}: the replay differs from eager"


def test_padding_follows_vllm_rules():
    eng = LLMEngine(BASE.replace(cudagraph_mode="FULL", capture_sizes=(8,)), record_fa=True)
    try:
        eng.reset()
        eng.add_request("a", [1, 2, 3], 1)  # 3 tokens, 1 request -> padded to 8 tokens, 8 requests
        eng.step()
        rec = next(r for r in eng.collect_fa_records() if r.graph)
        assert eng.collect_fa_records() == []  # collecting drains the ranks: an idle pooled engine holds none
        assert rec.q_shape[0] == 8 and rec.num_actual_tokens == 3 and rec.num_reqs == 1
        assert rec.cu_seqlens_q.tolist() == [0, 3] + [3] * 7  # tail repeats the last offset
        assert rec.seqused_k.tolist() == [3] + [0] * 7  # padded seq_lens are 0
        assert (rec.block_table[1:] == 0).all()  # padded rows point at the null block
        assert rec.slot_mapping[3:8].tolist() == [-1] * 5  # padded slots write nothing
        assert rec.max_seqlen_q == 8 and rec.max_seqlen_k == BASE.max_model_len  # baked bounds
    finally:
        eng.shutdown()


# Long enough for queries past one 64-row tile (engine.attention.reference.FA2_PAGED_TILE_Q).
LONG = BASE.replace(num_hidden_layers=2, max_num_batched_tokens=128, max_model_len=256, num_gpu_blocks=80)


def _first_logits_after_short_capture(cfg, prompt_len, poison, faults=("graph_stale_max_seqlen",)):
    eng = LLMEngine(cfg, record_fa=True)
    try:
        eng.reset(faults=faults, poison=poison)
        eng.add_request("short", [5, 6], 1)  # captures size 128 with max_seqlen_q = 2 baked
        eng.step()
        eng.add_request("long", [(7 * i) % 128 for i in range(prompt_len)], 1)  # replays size 128
        while eng.has_unfinished_requests():
            eng.step()
        recs = [r for r in eng.collect_fa_records() if r.graph]
        return eng.trace.tokens["long"][0].logits, recs
    finally:
        eng.shutdown()


@pytest.mark.parametrize("poison", ["nan", "stale"])
def test_a_stale_max_seqlen_q_leaves_whole_tiles_unlaunched_like_the_gpu(poison):
    """The graph bakes max_seqlen_q = 2 from the batch that captured it (fault
    graph_stale_max_seqlen); FA2 then launches one 64-row tile per sequence. A 60-token query
    replayed at that size is computed whole: its logits are exact and only the call's record
    shows the understated scalar, as on the H200. A 100-token query leaves rows 64..99 as the
    output memory held them: NaN under NaN poison, finite stale values under stale poison;
    wrong logits either way."""
    cfg = LONG.replace(cudagraph_mode="FULL", capture_sizes=(128,))
    right = {n: _first_logits_after_short_capture(cfg, n, poison, faults=())[0] for n in (60, 100)}
    short_logits, recs = _first_logits_after_short_capture(cfg, 60, poison)
    assert torch.equal(short_logits, right[60])
    assert any(r.max_seqlen_q == 2 and int((r.cu_seqlens_q[1:] - r.cu_seqlens_q[:-1]).max()) == 60 for r in recs)
    long_logits, _ = _first_logits_after_short_capture(cfg, 100, poison)
    if poison == "nan":
        assert not torch.isfinite(long_logits).all()
    else:
        assert torch.isfinite(long_logits).all() and not torch.allclose(long_logits, right[100], atol=1e-3)


def test_baked_scalar_nan_rows_exactly_past_max_seqlen_q():
    """The capture itself (make_fx) keeps a Python int as a constant: replaying with a
    longer query gives NaN rows from index max_seqlen_q on, and finite rows before it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from engine.attention.reference import varlen_attention

    torch.manual_seed(0)
    kc, vc = torch.randn(16, 4, 2, 8), torch.randn(16, 4, 2, 8)
    bt = torch.arange(1, 9, dtype=torch.int32).view(2, 4)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    sl = torch.tensor([2, 2], dtype=torch.int32)
    q = torch.randn(12, 4, 8)

    def fn(q, cu, sl):
        return varlen_attention(q, kc, vc, cu, 2, sl, 16, bt, 0.35)  # max_seqlen_q=2 baked

    gm = make_fx(fn)(q, cu, sl)
    cu.copy_(torch.tensor([0, 2, 12], dtype=torch.int32))  # replay: second query is 10 long
    sl.copy_(torch.tensor([2, 10], dtype=torch.int32))
    out = gm(q, cu, sl)
    bad = ~torch.isfinite(out).all(-1).all(-1)
    assert bad.tolist() == [False, False, False, False] + [True] * 8


@pytest.mark.gpu
def test_graph_equals_eager_on_cuda():
    if not torch.cuda.is_available():
        # A GPU test (marked gpu): CI has no GPU; the H200 runs it (bench/results/pytest_gpu_h200_flash_attn4.json).
        pytest.skip("needs CUDA")
    cfg = BASE.replace(device="cuda", layout="tp1pp2")
    eager = LLMEngine(cfg)
    graph = LLMEngine(cfg.replace(cudagraph_mode="FULL", capture_sizes=SIZES))
    try:
        a, b = run(eager, workload(0)), run(graph, workload(0))
        for rid in a.tokens:
            for x, y in zip(a.tokens[rid], b.tokens[rid]):
                assert torch.equal(x.logits, y.logits)
    finally:
        eager.shutdown()
        graph.shutdown()
