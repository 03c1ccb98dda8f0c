"""The torch_flash backend (PyTorch's FlashAttention-2 varlen kernel) on a real GPU."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    # A GPU test (marked gpu): CI has no GPU; the H200 runs it (bench/results/pytest_gpu_h200_flash_attn4.json).
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.attention.reference import varlen_attention  # noqa: E402
from engine.attention.torch_flash import torch_flash_varlen  # noqa: E402


def paged_batch(q_lens, k_lens, bs=16, H=8, Hkv=2, D=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-k // bs) for k in k_lens) + 1
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()
    width = max(-(-k // bs) for k in k_lens)
    bt = torch.zeros(len(k_lens), width, dtype=torch.int32)
    for i, k in enumerate(k_lens):
        n = -(-k // bs)
        bt[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    kc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), H, D, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sl = torch.tensor(k_lens, dtype=torch.int32)
    return [t.cuda() for t in (q, kc, vc, cu, sl, bt)]


def test_torch_flash_matches_reference():
    q_lens, k_lens = [1, 7, 33, 128], [20, 7, 50, 128]
    q, kc, vc, cu, sl, bt = paged_batch(q_lens, k_lens)
    a = torch_flash_varlen(q, kc, vc, cu, max(q_lens), sl, max(k_lens), bt, 64 ** -0.5)
    b = varlen_attention(q, kc, vc, cu, max(q_lens), sl, max(k_lens), bt, 64 ** -0.5)
    assert (a.float() - b.float()).abs().max() < 2e-2


def test_understated_max_seqlen_q_drops_whole_row_tiles():
    """docs/bug_classes.md#graph_stale_max_seqlen on the real kernel: max_seqlen_q=200 for a
    300-row query."""
    q, kc, vc, cu, sl, bt = paged_batch([300], [300], seed=1)
    good = torch_flash_varlen(q, kc, vc, cu, 300, sl, 300, bt, 64 ** -0.5)
    bad = torch_flash_varlen(q, kc, vc, cu, 200, sl, 300, bt, 64 ** -0.5)
    wrong = (~torch.isclose(bad.float(), good.float(), atol=1e-2)).any(-1).any(-1)
    assert wrong.any() and not wrong[:200].any()
    print("rows wrong with max_seqlen_q=200 of 300:", int(wrong.sum()))


def _run(eng, reqs, forced=None):
    eng.reset()
    for rid, prompt, n in reqs:
        eng.add_request(rid, prompt, n, forced[rid] if forced else None)
    while eng.has_unfinished_requests():
        eng.step()
    return eng.trace.tokens


def test_engine_torch_flash_close_to_reference_and_graph_bitwise():
    rng = random.Random(0)
    reqs = [(f"r{i}", [rng.randrange(128) for _ in range(rng.randint(1, 40))], 4) for i in range(6)]
    base = EngineConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        hidden_size=256, max_num_batched_tokens=32, max_model_len=64, device="cuda",
                        dtype="bfloat16")
    ref = LLMEngine(base)
    fa = LLMEngine(base.replace(attention_backend="torch_flash"))
    fa_graph = LLMEngine(base.replace(attention_backend="torch_flash", cudagraph_mode="FULL", capture_sizes=(8, 16, 32)))
    try:
        a = _run(ref, reqs)
        forced = {rid: [t.token for t in recs] for rid, recs in a.items()}  # teacher forcing
        b, c = _run(fa, reqs, forced), _run(fa_graph, reqs, forced)
        for rid in a:
            for x, y, z in zip(a[rid], b[rid], c[rid]):
                assert (x.logits - y.logits).abs().max() < 0.25  # bf16 kernels vs fp32-accumulated reference
                assert torch.equal(y.logits, z.logits)  # graph replay == eager, same kernel
    finally:
        for e in (ref, fa, fa_graph):
            e.shutdown()
