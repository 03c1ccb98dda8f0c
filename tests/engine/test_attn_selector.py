"""The backend selector: one registry, resolved from the config; the attention op runs the
backend its sink holds, and each backend reaches its kernel through one module attribute
(where the FA guard puts its wrapper)."""
from __future__ import annotations

import pytest
import torch

import engine.attention.torch_flash as torch_flash
import engine.custom_ops as custom_ops
from engine import ConfigError, EngineConfig, LLMEngine
from engine.attention import flash_attn_backend
from engine.attention.selector import (ATTENTION_BACKENDS, FlashAttnBackend, ReferenceBackend, TorchFlashBackend,
                                       get_attn_backend, get_attn_backend_cls)

CUDA_BF16 = dict(device="cuda", dtype="bfloat16")


def test_the_registry_holds_the_names_the_config_accepts():
    assert list(ATTENTION_BACKENDS) == ["reference", "torch_flash", "flash_attn"]
    for name, backend in ATTENTION_BACKENDS.items():
        assert backend.name == name
        EngineConfig(attention_backend=name, **CUDA_BF16)  # valid by the config's rules
    with pytest.raises(ConfigError, match=r"^attention_backend: 'flash' is not one of reference, torch_flash, "
                                          r"flash_attn$"):
        get_attn_backend_cls("flash")


def test_resolved_from_the_config():
    assert get_attn_backend(EngineConfig()) is ReferenceBackend
    assert get_attn_backend(EngineConfig(attention_backend="torch_flash", **CUDA_BF16)) is TorchFlashBackend


def test_flash_attn_without_the_package_is_one_line_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(flash_attn_backend, "probe", lambda: None)
    cfg = EngineConfig(attention_backend="flash_attn", **CUDA_BF16)  # the config does not probe
    with pytest.raises(ConfigError) as err:
        LLMEngine(cfg)  # a rank on this CPU machine would fail on CUDA instead
    assert str(err.value) == flash_attn_backend.missing_message()
    assert "\n" not in str(err.value) and "pip install flash-attn-4" in str(err.value)
    monkeypatch.setattr(flash_attn_backend, "probe", lambda: flash_attn_backend.Found("fa4", "m", "p", "v"))
    assert get_attn_backend(cfg) is FlashAttnBackend


def test_the_engine_runs_its_sinks_backend_through_the_patchable_kernel(monkeypatch):
    """The reference backend calls `engine.custom_ops.varlen_attention` at every call, so a
    wrapper put there sees every layer's call; records name the backend."""
    calls = []
    real = custom_ops.varlen_attention

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def run():
        e = LLMEngine(EngineConfig(), record_fa=True)
        try:
            e.add_request("r", [1, 2, 3], 2)
            while e.has_unfinished_requests():
                e.step()
            return e.trace.output_token_ids(), e.collect_fa_records()
        finally:
            e.shutdown()

    plain, _ = run()
    monkeypatch.setattr(custom_ops, "varlen_attention", counted)
    wrapped, records = run()
    assert wrapped == plain and len(calls) == len(records) > 0
    assert {r.backend for r in records} == {"reference"}


def test_torch_flash_calls_go_through_the_module_attribute(monkeypatch):
    seen = []
    monkeypatch.setattr(torch_flash, "torch_flash_varlen", lambda *a: seen.append(len(a)) or "kernel")
    q = torch.zeros(1, 1, 8)
    assert TorchFlashBackend.forward(None, q, q, q, q, 1, q, 1, q, 1.0) == "kernel"
    assert seen == [9]
