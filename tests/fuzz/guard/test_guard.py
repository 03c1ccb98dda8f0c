"""Tests for the FA guard (fuzz.guard, fuzz.guard.dump, fuzz.guard.autoinstall, llmfuzz_guard.pth).

A bad call must be stopped before the kernel: on CPU torch's varlen_attn kernel raises
NotImplementedError, so getting FAInvariantError instead shows the check ran first, and
getting NotImplementedError for a valid call shows the guard let it through.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch

import engine.attention.reference as reference
import engine.custom_ops as custom_ops
import torch.nn.attention.varlen as tvarlen
from fuzz.guard import autoinstall as hook
from fuzz import guard
from fuzz.guard import spec as guard_spec
from engine.attention.fa_contract import check_varlen_shapes
from fuzz.guard import dump as guard_dump
from fuzz.verdict.invariants import FAInvariantError

ROOT = Path(__file__).resolve().parents[3]
I32 = torch.int32
UNDERSTATED = "max_seqlen_q=2 < query length 10 of sequence 1"


@pytest.fixture(autouse=True)
def _no_guard_left():
    yield
    guard.uninstall()


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def torch_args(max_q: int = 10, cu=(0, 2, 12)):
    """A valid two-sequence, non-paged torch varlen_attn call (unless told otherwise)."""
    q = torch.randn(12, 4, 16, dtype=torch.float16)
    kv = torch.randn(12, 2, 16, dtype=torch.float16)
    return (q, kv, kv, i32(cu), i32([0, 2, 12]), max_q, 10), {"enable_gqa": True, "window_size": (-1, 0)}


def paged_args(q_lens=(2, 10), k_lens=(5, 10), block_size=4, dtype=torch.float32):
    """A valid paged call of the reference backend: queries are the last q_len keys."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], 4, 16, dtype=dtype)
    kc = torch.randn(16, block_size, 2, 16, dtype=dtype)
    vc = torch.randn(16, block_size, 2, 16, dtype=dtype)
    bt = torch.zeros(len(q_lens), 4, dtype=I32)
    nxt = 1
    for i, k in enumerate(k_lens):
        for j in range(-(-k // block_size)):
            bt[i, j] = nxt
            nxt += 1
    return dict(q=q, k_cache=kc, v_cache=vc, cu_seqlens_q=i32(cu), max_seqlen_q=max(q_lens),
                seqused_k=i32(k_lens), max_seqlen_k=max(k_lens), block_table=bt, softmax_scale=0.25)


def call_torch(*args, **kwargs):
    return tvarlen.varlen_attn(*args, **kwargs)


# -- install / uninstall ----------------------------------------------------------------------
def test_install_uninstall_restores_the_exact_objects():
    import engine.attention.torch_flash as torch_flash

    originals = {(tvarlen, "varlen_attn"): tvarlen.varlen_attn,
                 (tvarlen, "varlen_attn_out"): tvarlen.varlen_attn_out,
                 (reference, "varlen_attention"): reference.varlen_attention,
                 (custom_ops, "varlen_attention"): custom_ops.varlen_attention,
                 (torch_flash, "torch_flash_varlen"): torch_flash.torch_flash_varlen}
    assert custom_ops.varlen_attention is reference.varlen_attention
    early = types.ModuleType("llmfuzz_test_early_importer")  # did `from ... import` before install
    early.varlen_attn = tvarlen.varlen_attn
    sys.modules[early.__name__] = early
    registry = types.ModuleType("llmfuzz_test_registry")  # an engine that dispatches through a dict
    registry.BACKENDS = {"mine": tvarlen.varlen_attn_out, "other": len}
    backends = dict(registry.BACKENDS)
    sys.modules[registry.__name__] = registry
    try:
        st = guard.install("raise", targets=guard.TARGETS + (guard.Target(registry.__name__, "BACKENDS", key="mine"),))
        assert {"torch.nn.attention.varlen.varlen_attn", "torch.nn.attention.varlen.varlen_attn_out",
                "engine.attention.reference.varlen_attention", "engine.custom_ops.varlen_attention",
                "engine.attention.torch_flash.torch_flash_varlen",
                "llmfuzz_test_registry.BACKENDS['mine']"} <= set(st["entry_points"])
        assert "llmfuzz_test_early_importer.varlen_attn" in st["swept_references"]
        for (mod, attr), orig in originals.items():
            wrapped = getattr(mod, attr)
            assert wrapped is not orig and guard.is_wrapper(wrapped) and wrapped.__wrapped__ is orig
        assert early.varlen_attn is tvarlen.varlen_attn  # the sweep patched the early reference
        # a backend dispatched through a dict: its entry is patched in place, the others are left
        assert registry.BACKENDS["mine"] is tvarlen.varlen_attn_out and guard.is_wrapper(registry.BACKENDS["mine"])
        assert registry.BACKENDS["other"] is len
        # one wrapper per function object: the engine's two names stay one object
        assert custom_ops.varlen_attention is reference.varlen_attention
        assert guard.install("warn")["mode"] == "warn"  # reinstall: reconfigure, no double wrap
        assert tvarlen.varlen_attn.__wrapped__ is originals[(tvarlen, "varlen_attn")]
        done = guard.uninstall()
        assert "llmfuzz_test_early_importer.varlen_attn" in done["restored"] and not done["left_rebound"]
        for (mod, attr), orig in originals.items():
            assert getattr(mod, attr) is orig
        assert all(registry.BACKENDS[k] is v for k, v in backends.items())
        assert early.varlen_attn is originals[(tvarlen, "varlen_attn")]
        assert not guard.is_installed() and not hook.watching()
    finally:
        sys.modules.pop(early.__name__, None)
        sys.modules.pop(registry.__name__, None)


def test_uninstall_leaves_a_name_rebound_since_install_alone():
    orig = tvarlen.varlen_attn_out
    guard.install("raise")

    def mine(*a, **k):
        return None

    tvarlen.varlen_attn_out = mine
    try:
        assert "torch.nn.attention.varlen.varlen_attn_out" in guard.uninstall()["left_rebound"]
        assert tvarlen.varlen_attn_out is mine
    finally:
        tvarlen.varlen_attn_out = orig


FAKE_FA2 = '''
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    return "fa2 kernel"
'''
# vLLM's fork takes max_seqlen_q before cu_seqlens_q and seqused_k for paged KV.
FAKE_VLLM = '''
def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                           seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=None, block_table=None, out=None):
    return "vllm kernel"
'''


@pytest.fixture
def fake_fa(tmp_path, monkeypatch):
    """Two fake FlashAttention packages on sys.path (flash-attn 2 and vLLM argument orders)."""
    names = ("llmfuzz_fake_fa2", "llmfuzz_fake_vllm", "llmfuzz_fake_user_early", "llmfuzz_fake_user_late")
    for name, src in (("llmfuzz_fake_fa2", FAKE_FA2), ("llmfuzz_fake_vllm", FAKE_VLLM)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(src)
    (tmp_path / "llmfuzz_fake_user_early.py").write_text("from llmfuzz_fake_vllm import flash_attn_varlen_func\n")
    (tmp_path / "llmfuzz_fake_user_late.py").write_text("from llmfuzz_fake_fa2 import flash_attn_varlen_func\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield (guard.Target("llmfuzz_fake_fa2", "flash_attn_varlen_func"),
           guard.Target("llmfuzz_fake_vllm", "flash_attn_varlen_func"))
    guard.uninstall()
    for name in names:
        sys.modules.pop(name, None)


def test_entry_points_imported_before_and_after_install_are_guarded(fake_fa):
    vllm_fa = importlib.import_module("llmfuzz_fake_vllm")
    early = importlib.import_module("llmfuzz_fake_user_early")
    orig_vllm = vllm_fa.flash_attn_varlen_func
    st = guard.install("raise", targets=guard.TARGETS + fake_fa)
    assert "llmfuzz_fake_fa2.flash_attn_varlen_func" in st["waiting_for_import"]
    assert early.flash_attn_varlen_func is vllm_fa.flash_attn_varlen_func is not orig_vllm
    fa2 = importlib.import_module("llmfuzz_fake_fa2")  # imported after install: patched on import
    late = importlib.import_module("llmfuzz_fake_user_late")
    assert guard.is_wrapper(fa2.flash_attn_varlen_func) and late.flash_attn_varlen_func is fa2.flash_attn_varlen_func
    assert fa2.__spec__.loader.__class__.__name__ != "_NotifyingLoader"  # the watcher left no trace

    q, kv = torch.randn(12, 4, 16), torch.randn(12, 2, 16)
    cu = i32([0, 2, 12])
    assert late.flash_attn_varlen_func(q, kv, kv, cu, cu, 10, 10, causal=True) == "fa2 kernel"
    with pytest.raises(FAInvariantError, match=f"llmfuzz_fake_fa2.flash_attn_varlen_func: {UNDERSTATED}"):
        late.flash_attn_varlen_func(q, kv, kv, cu, cu, 2, 10)
    # vLLM order, paged: max_seqlen_q is the 4th positional argument, keys come from seqused_k.
    pq = paged_args()
    good = (pq["q"], pq["k_cache"], pq["v_cache"], 10, pq["cu_seqlens_q"], 10)
    paged = {"seqused_k": pq["seqused_k"], "block_table": pq["block_table"], "causal": True}
    assert early.flash_attn_varlen_func(*good, **paged) == "vllm kernel"
    with pytest.raises(FAInvariantError, match=r"max_seqlen_k=9 < key length 10"):
        early.flash_attn_varlen_func(*good[:5], 9, **paged)
    bad_bt = pq["block_table"].clone()
    bad_bt[1, 2] = 99
    with pytest.raises(FAInvariantError, match=r"block_table\[1, 2\]=99 is not a block id"):
        early.flash_attn_varlen_func(*good, **{**paged, "block_table": bad_bt})
    guard.uninstall()
    assert vllm_fa.flash_attn_varlen_func is orig_vllm and early.flash_attn_varlen_func is orig_vllm
    assert not guard.is_wrapper(fa2.flash_attn_varlen_func)


def test_fp8_kv_cache_is_not_a_dtype_violation(fake_fa):
    fa = importlib.import_module("llmfuzz_fake_vllm")
    guard.install("raise", targets=fake_fa)
    pq = paged_args(dtype=torch.bfloat16)
    kc, vc = pq["k_cache"].to(torch.float8_e4m3fn), pq["v_cache"].to(torch.float8_e4m3fn)
    kw = {"seqused_k": pq["seqused_k"], "block_table": pq["block_table"], "causal": True}
    assert fa.flash_attn_varlen_func(pq["q"], kc, vc, 10, pq["cu_seqlens_q"], 10, **kw) == "vllm kernel"
    with pytest.raises(FAInvariantError, match="cu_seqlens_q decreases"):
        fa.flash_attn_varlen_func(pq["q"], kc, vc, 10, i32([0, 3, 2]), 10, **kw)


# -- the three modes on torch.nn.attention.varlen.varlen_attn --------------------------------
def test_valid_torch_varlen_call_reaches_the_kernel():
    guard.install("raise")
    args, kw = torch_args()
    with pytest.raises(NotImplementedError):  # CPU has no FlashAttention kernel: it got there
        call_torch(*args, **kw)
    assert guard.stats()["full_checks"] == 1 and guard.stats()["violations"] == 0


@pytest.mark.parametrize("bad, match", [
    (dict(max_q=2), UNDERSTATED),
    (dict(cu=(0, 12, 2)), r"cu_seqlens_q decreases: cu_seqlens_q\[2\]=2 < cu_seqlens_q\[1\]=12"),
    (dict(cu=(1, 2, 12)), r"cu_seqlens_q\[0\]=1, must be 0"),
])
def test_raise_mode_stops_a_bad_call_before_the_kernel(bad, match):
    guard.install("raise")
    args, kw = torch_args(**bad)
    with pytest.raises(FAInvariantError, match=f"torch.nn.attention.varlen.varlen_attn: .*{match}") as ei:
        call_torch(*args, **kw)
    assert ei.value.target == "torch.nn.attention.varlen.varlen_attn"


def test_torch_causal_follows_window_size():
    guard.install("raise")
    q, kv = torch.randn(12, 2, 16), torch.randn(6, 2, 16)
    cu_q, cu_k = i32([0, 2, 12]), i32([0, 3, 6])  # sequence 1: 10 queries, 3 keys
    with pytest.raises(NotImplementedError):  # not causal: fine
        call_torch(q, kv, kv, cu_q, cu_k, 10, 3)
    with pytest.raises(FAInvariantError, match="causal=True but sequence 1 has 10 queries > 3 keys"):
        call_torch(q, kv, kv, cu_q, cu_k, 10, 3, window_size=(-1, 0))


def test_warn_mode_warns_once_and_still_calls_the_kernel():
    guard.install("warn")
    args, kw = torch_args(max_q=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with pytest.raises(NotImplementedError):
                call_torch(*args, **kw)
    msgs = [str(w.message) for w in caught if issubclass(w.category, guard.FAGuardWarning)]
    assert len(msgs) == 1 and UNDERSTATED in msgs[0]
    assert caught[0].filename == __file__  # points at the caller of the attention function
    assert guard.stats()["violations"] == 3 and guard.stats()["distinct_violations"] == 1


def check_fa(path) -> tuple[int, str]:
    """Run the check-fa subcommand as fuzz/cli/main.py registers it: (exit code, stdout + stderr)."""
    p = argparse.ArgumentParser()
    guard_dump.add_check_fa_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(["check-fa", str(path)])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = args.fn(args)
    return rc, out.getvalue() + err.getvalue()


def test_dump_mode_writes_a_dump_that_check_fa_reports(tmp_path):
    guard.install("raise")
    args, kw = torch_args(max_q=2)
    with pytest.raises(FAInvariantError) as ei:
        call_torch(*args, **kw)
    raised = str(ei.value)

    guard.install("dump", dump_dir=tmp_path / "dumps")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the same violation twice: one dump
            with pytest.raises(NotImplementedError):
                call_torch(*args, **kw)
    dumps = [d for d in (tmp_path / "dumps").iterdir()]
    assert len(dumps) == 1 and not dumps[0].name.startswith(".tmp-")
    assert "llmfuzz check-fa" in str(caught[0].message)
    rec = json.loads((dumps[0] / "call.json").read_text())
    assert rec["arguments"]["max_q"] == {"value": 2} and rec["tensors"]["cu_seq_q"]["saved"]
    assert rec["arguments"]["window_size"] == {"value": [-1, 0], "tuple": True}

    rc, out = check_fa(dumps[0])
    assert rc == 1 and out.strip() == f"{dumps[0]}: {raised}"
    rc, out = check_fa(tmp_path / "dumps")  # the directory of dumps works too
    assert rc == 1 and raised in out
    d = guard_dump.load_dump(dumps[0])
    assert d.arguments["window_size"] == (-1, 0) and torch.equal(d.arguments["cu_seq_q"], args[3])


def test_check_fa_passes_a_valid_dump_and_rejects_garbage(tmp_path):
    args, kw = torch_args()
    spec = guard_spec._Spec(guard.Target("torch.nn.attention.varlen", "varlen_attn", "torch"), tvarlen.varlen_attn)
    path = guard_dump.write_dump(tmp_path / "ok", spec.qualname, spec.arguments(args, kw),
                                 spec.check_kwargs(args, kw))
    rc, out = check_fa(path)
    assert rc == 0 and "passes" in out

    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "notes.txt").write_text("hello")
    assert check_fa(tmp_path / "garbage")[0] == 2
    assert check_fa(tmp_path / "missing")[0] == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "call.json").write_text("{not json")
    assert check_fa(broken)[0] == 2
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    rec = json.loads((path / "call.json").read_text())
    (trunc / "call.json").write_text(json.dumps(rec))  # tensors marked saved, tensor file absent
    rc, msg = check_fa(trunc)
    assert rc == 2 and msg.startswith("llmfuzz: ") and "tensor" in msg and msg.count("\n") == 1
    assert guard_dump.main([str(tmp_path / "garbage")]) == 2


def test_dump_without_safetensors_uses_npy(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # `import` now raises ImportError
    guard.install("dump", dump_dir=tmp_path)
    pq = paged_args(dtype=torch.bfloat16)
    pq["max_seqlen_q"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", guard.FAGuardWarning)
        reference.varlen_attention(**pq)
    (dump,) = list(tmp_path.iterdir())
    assert (dump / "tensors" / "q.npy").is_file() and not (dump / "tensors.safetensors").exists()
    d = guard_dump.load_dump(dump)
    assert d.arguments["q"].dtype == torch.bfloat16 and torch.equal(d.arguments["q"], pq["q"])
    rc, out = check_fa(dump)
    assert rc == 1 and f"engine.attention.reference.varlen_attention: {UNDERSTATED}" in out


def test_module_import_stays_light():
    code = ("import sys, fuzz.guard.dump, fuzz.guard.autoinstall, fuzz.guard.build; "
            "print('torch' in sys.modules)")  # the CLI's --help and the build hook stay torch-free
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- device values ----------------------------------------------------------------------------
def test_without_device_values_only_host_visible_rules_run():
    guard.install("raise", check_device_values=False)
    args, kw = torch_args(max_q=2)
    with pytest.raises(NotImplementedError):  # understated max_seqlen_q needs cu_seqlens values
        call_torch(*args, **kw)
    bad = list(args)
    bad[3] = bad[3].long()
    with pytest.raises(FAInvariantError, match="cu_seqlens_q has dtype torch.int64, expected torch.int32"):
        call_torch(*bad, **kw)
    bad = list(args)
    bad[4] = i32([0, 12])
    with pytest.raises(FAInvariantError, match="cu_seqlens_k has 2 entries, cu_seqlens_q has 3"):
        call_torch(*bad, **kw)
    # values that cannot be read at all (meta) pass: nothing was copied to the host
    pq = paged_args()
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) and k in ("cu_seqlens_q", "seqused_k", "block_table")
                else v) for k, v in pq.items()}
    check_varlen_shapes(meta["q"], meta["k_cache"], meta["v_cache"], meta["cu_seqlens_q"], None,
                              2, 10, block_table=meta["block_table"], seqused_k=meta["seqused_k"])
    s = guard.stats()
    assert s["host_only_checks"] == 3 and s["full_checks"] == 0


def test_host_only_dump_holds_no_values_and_rechecks_shapes(tmp_path):
    guard.install("dump", dump_dir=tmp_path, check_device_values=False)
    args, kw = torch_args()
    bad = list(args)
    bad[4] = i32([0, 12])
    with warnings.catch_warnings(), pytest.raises(NotImplementedError):
        warnings.simplefilter("ignore", guard.FAGuardWarning)
        call_torch(*bad, **kw)
    (dump,) = list(tmp_path.iterdir())
    rec = json.loads((dump / "call.json").read_text())
    assert rec["host_only"] and not any(m["saved"] for m in rec["tensors"].values())
    assert rec["tensor_format"] is None
    rc, out = check_fa(dump)
    assert rc == 1 and "cu_seqlens_k has 2 entries, cu_seqlens_q has 3 (shapes only" in out


def test_fake_tensors_get_host_only_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    guard.install("raise")
    pq = paged_args()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in pq.items()}
        reference.varlen_attention(**fake)  # tracing-style call: no values to read
    s = guard.stats()
    assert s["host_only_checks"] == 1 and s["full_checks"] == 0


# -- our reference backend and engine ---------------------------------------------------------
def test_reference_backend_output_is_unchanged():
    pq = paged_args()
    plain = reference.varlen_attention(**pq)
    guard.install("raise")
    guarded = reference.varlen_attention(**pq)
    torch.testing.assert_close(guarded, plain, rtol=0, atol=0, equal_nan=True)
    assert guard.stats()["full_checks"] == 1
    pq["max_seqlen_q"] = 2
    with pytest.raises(FAInvariantError, match=f"engine.attention.reference.varlen_attention: {UNDERSTATED}"):
        custom_ops.varlen_attention(**pq)


def test_torch_flash_backend_is_checked_before_the_aten_kernel():
    import engine.attention.torch_flash as torch_flash

    guard.install("raise")
    pq = paged_args()
    pq.pop("k_cache"), pq.pop("v_cache")
    kc, vc = paged_args()["k_cache"], paged_args()["v_cache"]
    with pytest.raises(NotImplementedError):  # valid: reaches aten's CPU-less flash kernel
        torch_flash.torch_flash_varlen(k_cache=kc, v_cache=vc, **pq)
    pq["max_seqlen_q"] = 2
    with pytest.raises(FAInvariantError, match=r"engine\.attention\.torch_flash\.torch_flash_varlen: "
                                               + UNDERSTATED):
        torch_flash.torch_flash_varlen(k_cache=kc, v_cache=vc, **pq)


def test_engine_under_the_guard():
    from engine import EngineConfig, LLMEngine
    from engine.inproc_world import RankFailure

    guard.install("raise")
    eng = LLMEngine(EngineConfig(cudagraph_mode="FULL", capture_sizes=(12,)))
    try:
        for faults in ((), ("graph_stale_max_seqlen",)):
            eng.reset(faults=faults)
            eng.add_request("short", [1, 2], 2)
            eng.step()  # 2 tokens: captures the size-12 graph
            eng.add_request("long", list(range(1, 11)), 2)
            if not faults:
                while eng.has_unfinished_requests():
                    eng.step()
                assert guard.stats()["violations"] == 0 and guard.stats()["full_checks"] > 0
                continue
            with pytest.raises(RankFailure, match=r"FAInvariantError: engine\.attention\.reference\."
                                                  r"varlen_attention: max_seqlen_q=2 < query length 10"):
                eng.step()  # replays the graph baked with max_seqlen_q=2
    finally:
        eng.shutdown()


# -- the start-up hook ------------------------------------------------------------------------
def test_pth_file_is_the_hook_line():
    text = (ROOT / hook.PTH_NAME).read_text()
    assert text == hook.PTH_LINE and text.startswith("import ") and text.count("\n") == 1


HOOK_SCRIPT = textwrap.dedent("""
    import site, sys
    site.addsitedir(sys.argv[1])   # what interpreter start-up does with site-packages/*.pth
    print("torch_at_start", "torch" in sys.modules, "hook", "fuzz.guard.autoinstall" in sys.modules)
    if sys.argv[2] == "off":
        raise SystemExit(0)
    import torch
    q = torch.randn(12, 2, 16)
    cu = torch.tensor([0, 2, 12], dtype=torch.int32)
    try:
        if sys.argv[2] == "torch":
            from torch.nn.attention.varlen import varlen_attn
            varlen_attn(q, q, q, cu, cu, 2, 12)
        else:  # our backend, paged: one block per 4 keys
            from engine.attention.reference import varlen_attention
            kv = torch.randn(8, 4, 2, 16)
            bt = torch.tensor([[1, 0, 0], [2, 3, 4]], dtype=torch.int32)
            varlen_attention(q, kv, kv, cu, 2, torch.tensor([2, 10], dtype=torch.int32), 10, bt, 0.25)
            print("returned")
    except Exception as e:
        print("error", type(e).__name__, e)
""")


def run_hook(tmp_path, env: dict, arg: str) -> str:
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / hook.PTH_NAME).write_text((ROOT / hook.PTH_NAME).read_text())
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFUZZ_FA_GUARD")}
    full_env.update(env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", HOOK_SCRIPT, str(site_dir), arg], capture_output=True,
                         text=True, env=full_env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_env_hook_raise_in_a_fresh_interpreter(tmp_path):
    out = run_hook(tmp_path, {"LLMFUZZ_FA_GUARD": "raise"}, "reference")
    assert "torch_at_start False hook True" in out  # installed lazily, torch not imported by the hook
    assert f"error FAInvariantError engine.attention.reference.varlen_attention: {UNDERSTATED}" in out


def test_env_hook_off_imports_nothing(tmp_path):
    assert "torch_at_start False hook False" in run_hook(tmp_path, {}, "off")


def test_env_config_in_process(tmp_path, capsys):
    """What the hook does once torch is imported, for each variable (no subprocess needed)."""
    hook.bootstrap({"LLMFUZZ_FA_GUARD": "loud"})
    assert not guard.is_installed() and "LLMFUZZ_FA_GUARD='loud'" in capsys.readouterr().err
    hook.bootstrap({"LLMFUZZ_FA_GUARD": "off"})
    assert not guard.is_installed()
    hook.bootstrap({"LLMFUZZ_FA_GUARD": "warn", "LLMFUZZ_FA_GUARD_DEVICE_VALUES": "0"})
    assert guard.status()["mode"] == "warn" and guard.status()["check_device_values"] is False
    hook.bootstrap({"LLMFUZZ_FA_GUARD": "dump", "LLMFUZZ_FA_GUARD_DIR": str(tmp_path / "d")})
    assert guard.status()["mode"] == "dump" and guard.status()["check_device_values"] is True
    pq = paged_args()
    pq["max_seqlen_q"] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", guard.FAGuardWarning)
        reference.varlen_attention(**pq)  # dumped, then the kernel ran
    rc, line = check_fa(tmp_path / "d")
    assert rc == 1 and f"engine.attention.reference.varlen_attention: {UNDERSTATED}" in line


def test_cli_registration_when_present():
    from fuzz.cli import main as cli

    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    if "check-fa" not in sub.choices:
        pytest.skip("fuzz/cli/main.py does not register check-fa yet")
    assert cli.main(["check-fa", "/nonexistent/fa-dumps"]) == 2


# -- GPU (skipped without CUDA) ---------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_torch_varlen_guarded():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import inspect

    # torch's varlen API moves between releases: pass only what this torch accepts.
    params = inspect.signature(tvarlen.varlen_attn).parameters
    kw = {k: v for k, v in (("enable_gqa", True), ("window_size", (-1, 0))) if k in params}
    dev = "cuda"
    q = torch.randn(12, 4, 64, dtype=torch.float16, device=dev)
    kv = torch.randn(12, 2, 64, dtype=torch.float16, device=dev)
    cu = torch.tensor([0, 2, 12], dtype=I32, device=dev)
    plain = tvarlen.varlen_attn(q, kv, kv, cu, cu, 10, 10, **kw)
    guard.install("raise")
    out = tvarlen.varlen_attn(q, kv, kv, cu, cu, 10, 10, **kw)
    assert torch.equal(out, plain)
    with pytest.raises(FAInvariantError, match=UNDERSTATED):
        tvarlen.varlen_attn(q, kv, kv, cu, cu, 2, 10, **kw)
    # Inside graph capture: shapes only, no synchronisation (a sync would fail the capture).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tvarlen.varlen_attn(q, kv, kv, cu, cu, 10, 10, **kw)
    torch.cuda.current_stream().wait_stream(s)
    before = guard.stats()["host_only_checks"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tvarlen.varlen_attn(q, kv, kv, cu, cu, 10, 10, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert guard.stats()["host_only_checks"] == before + 1