"""The FA guard around flash-attn-4's `flash_attn.cute.flash_attn_varlen_func`.

On the CPU a stand-in module with flash-attn-4's signature (page_table, seqused_k, optional
max_seqlen_q/k, dense inputs when cu_seqlens_q is None) checks the argument mapping; on a GPU
with the package (marker `gpu`) the real function is wrapped and our `flash_attn` backend's
calls go through the wrapper, eagerly and at graph capture.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from fuzz import guard
from fuzz.verdict.invariants import FAInvariantError

I32 = torch.int32


@pytest.fixture(autouse=True)
def _no_guard_left():
    yield
    guard.uninstall()


def fa4_signature(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
                  softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
                  num_splits=1, pack_gqa=None, deterministic=False, score_mod=None, return_lse=False):
    return "fa4 kernel"


@pytest.fixture
def fake_fa4():
    """`flash_attn` (a namespace package, as flash-attn-4 installs it) and `flash_attn.cute`."""
    saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface")}
    pkg, cute, iface = (types.ModuleType(n) for n in saved)
    iface.flash_attn_varlen_func = fa4_signature
    cute.flash_attn_varlen_func = fa4_signature
    pkg.cute, cute.interface = cute, iface
    sys.modules.update({"flash_attn": pkg, "flash_attn.cute": cute, "flash_attn.cute.interface": iface})
    try:
        yield cute
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def paged(q_lens=(2, 10), k_lens=(5, 10), bs=4, dtype=torch.float16):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 4, 16, dtype=dtype)
    kc = torch.randn(16, bs, 2, 16, dtype=dtype)
    bt = torch.zeros(len(q_lens), 4, dtype=I32)
    nxt = 1
    for i, k in enumerate(k_lens):
        for j in range(-(-k // bs)):
            bt[i, j] = nxt
            nxt += 1
    return q, kc, torch.tensor(cu, dtype=I32), torch.tensor(k_lens, dtype=I32), bt


def test_fa4_entry_points_are_wrapped_and_checked(fake_fa4):
    st = guard.install("raise")
    assert {"flash_attn.cute.flash_attn_varlen_func",
            "flash_attn.cute.interface.flash_attn_varlen_func"} <= set(st["entry_points"])
    assert guard.is_wrapper(fake_fa4.flash_attn_varlen_func)
    assert fake_fa4.flash_attn_varlen_func is sys.modules["flash_attn.cute.interface"].flash_attn_varlen_func
    q, kc, cu, sl, bt = paged()
    ok = dict(cu_seqlens_q=cu, max_seqlen_q=10, max_seqlen_k=10, seqused_k=sl, page_table=bt, causal=True)
    assert fake_fa4.flash_attn_varlen_func(q, kc, kc, **ok) == "fa4 kernel"
    with pytest.raises(FAInvariantError, match="flash_attn.cute.flash_attn_varlen_func: max_seqlen_q=2 < query length 10"):
        fake_fa4.flash_attn_varlen_func(q, kc, kc, **{**ok, "max_seqlen_q": 2})
    bad_bt = bt.clone()
    bad_bt[1, 0] = 99  # past the cache's 16 blocks: `page_table` is the block table
    with pytest.raises(FAInvariantError, match="block_table"):
        fake_fa4.flash_attn_varlen_func(q, kc, kc, **{**ok, "page_table": bad_bt})
    assert guard.uninstall()["restored"]
    assert fake_fa4.flash_attn_varlen_func is fa4_signature


def test_fa4_optional_scalars_and_dense_calls(fake_fa4):
    """max_seqlen_q/k left out: checked against what the kernel then uses (total_q, the page
    table's row of keys), so a legal call passes. cu_seqlens_q left out: a dense call, no
    varlen contract, counted as skipped."""
    guard.install("raise")
    q, kc, cu, sl, bt = paged()
    assert fake_fa4.flash_attn_varlen_func(q, kc, kc, cu_seqlens_q=cu, seqused_k=sl, page_table=bt,
                                           causal=True) == "fa4 kernel"
    before = guard.stats()["skipped"]
    dense = torch.randn(2, 10, 4, 16, dtype=torch.float16)
    assert fake_fa4.flash_attn_varlen_func(dense, dense[..., :2, :], dense[..., :2, :], causal=True) == "fa4 kernel"
    assert guard.stats()["skipped"] == before + 1


# -- GPU with the package -------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_guard_wraps_the_real_fa4_and_sees_our_backend():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.attention.flash_attn_backend import probe

    found = probe()
    if found is None or found.kind != "fa4":
        pytest.skip("needs flash-attn-4 (flash_attn.cute)")
    import flash_attn.cute as fa4

    from engine.attention.flash_attn_backend import flash_attn_varlen as backend

    q, kc, cu, sl, bt = (t.cuda() for t in paged(dtype=torch.bfloat16))
    args = (cu, 10, sl, 10, bt, 0.25)
    plain = backend(q, kc, kc, *args)
    original = fa4.flash_attn_varlen_func
    guard.install("raise")
    assert guard.is_wrapper(fa4.flash_attn_varlen_func) and fa4.flash_attn_varlen_func.__wrapped__ is original
    calls = guard.stats()["calls"]
    assert torch.equal(backend(q, kc, kc, *args), plain)  # through the wrapper, same result
    assert guard.stats()["calls"] == calls + 1
    with pytest.raises(FAInvariantError, match=r"flash_attn\.cute\.flash_attn_varlen_func: max_seqlen_q=2 < query length 10"):
        backend(q, kc, kc, cu, 2, sl, 10, bt, 0.25)
    # Graph capture: the host-only check, no synchronisation (a sync would break the capture).
    before = guard.stats()["host_only_checks"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend(q, kc, kc, *args)
    g.replay()
    torch.cuda.synchronize()
    assert guard.stats()["host_only_checks"] == before + 1
    assert torch.equal(out, plain)
    guard.uninstall()
    assert fa4.flash_attn_varlen_func is original
