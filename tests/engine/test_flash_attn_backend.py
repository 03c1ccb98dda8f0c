"""The flash_attn backend's own arithmetic on the CPU, with stand-in kernels computed by the
reference attention: flash-attn-4's head-dim padding and FlashAttention-2's packed key
gather give the reference's result, and each kernel is looked up on its module at call time
(so the FA guard's wrapper there sees the backend's calls). No GPU, no package needed."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.attention import flash_attn_backend as fab
from engine.attention.reference import varlen_attention


def paged(q_lens, k_lens, bs=4, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = sum(-(-k // bs) for k in k_lens) + 1
    perm = (torch.randperm(nblocks - 1, generator=g) + 1).tolist()
    width = max(-(-k // bs) for k in k_lens)
    bt = torch.zeros(len(k_lens), width, dtype=torch.int32)
    for i, k in enumerate(k_lens):
        bt[i, :-(-k // bs)] = torch.tensor([perm.pop() for _ in range(-(-k // bs))])
    kc, vc = (torch.randn(nblocks, bs, Hkv, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(sum(q_lens), H, D, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return q, kc, vc, cu, torch.tensor(k_lens, dtype=torch.int32), bt


def fake_fa4(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
             seqused_k=None, page_table=None, softmax_scale=None, causal=False):
    assert cu_seqlens_k is None and page_table.dtype == torch.int32 and q.shape[-1] % 16 == 0
    return varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, page_table,
                            softmax_scale, causal=causal)


def fake_fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
             softmax_scale=None, causal=False, block_table=None):
    if block_table is not None:
        return varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k.diff(), max_seqlen_k,
                                block_table, softmax_scale, causal=causal)
    # packed keys: a paged view of block size 1, sequence b's blocks cu_k[b] + j
    B = cu_seqlens_q.shape[0] - 1
    bt = (cu_seqlens_k[:B, None] + torch.arange(max_seqlen_k)[None]).clamp(max=k.shape[0] - 1).int()
    return varlen_attention(q, k[:, None], v[:, None], cu_seqlens_q, max_seqlen_q, cu_seqlens_k.diff(),
                            max_seqlen_k, bt, softmax_scale, causal=causal)


@pytest.fixture
def modules(monkeypatch):
    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fake_fa4
    pkg.cute, pkg.flash_attn_varlen_func = cute, fake_fa2
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return pkg, cute


@pytest.mark.parametrize("D", [8, 16, 24])
def test_fa4_head_dim_padding_is_the_same_attention(modules, D):
    q, kc, vc, cu, sl, bt = paged([1, 5, 9], [3, 12, 9], D=D)
    args = (cu, 9, sl, 12, bt, D ** -0.5)
    out = fab.fa4_varlen(q, kc, vc, *args)
    assert out.shape == q.shape and out.is_contiguous()
    assert torch.allclose(out, varlen_attention(q, kc, vc, *args), atol=1e-12, rtol=0)


@pytest.mark.parametrize("bs", [4, 256])
def test_fa2_packed_gather_and_paged_path(modules, bs):
    q, kc, vc, cu, sl, bt = paged([1, 5, 9], [3, 12, 9], bs=bs)
    args = (cu, 9, sl, 12, bt, 8 ** -0.5)
    assert torch.allclose(fab.fa2_varlen(q, kc, vc, *args), varlen_attention(q, kc, vc, *args), atol=1e-12, rtol=0)


def test_kernel_is_looked_up_at_call_time(modules):
    """A wrapper put on the module attribute after the backend was imported is called."""
    _, cute = modules
    seen = []

    def wrapper(*a, **k):
        seen.append(1)
        return fake_fa4(*a, **k)

    cute.flash_attn_varlen_func = wrapper
    q, kc, vc, cu, sl, bt = paged([2], [6], D=16)
    fab.fa4_varlen(q, kc, vc, cu, 2, sl, 6, bt, 0.25)
    assert seen == [1]


def test_probe_and_dispatch_without_the_package(monkeypatch):
    monkeypatch.setattr(fab, "probe", lambda: None)
    with pytest.raises(RuntimeError, match="pip install flash-attn-4"):
        fab.flash_attn_varlen(*paged([1], [1])[:4], 1, torch.ones(1, dtype=torch.int32), 1,
                              torch.ones(1, 1, dtype=torch.int32), 1.0)
