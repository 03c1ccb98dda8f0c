"""FA guard entry points, and how each one's arguments map onto `check_varlen_args`.

`Target` names one entry point (`module.attr`, or `module.attr[key]` for a backend registry
dict) and its family's argument conventions; `TARGETS` are the built-in ones. `_Spec` reads
an entry point's own signature once and turns a call's (args, kwargs) into
`check_varlen_args` keyword arguments by parameter name, so no per-version tables are
needed. Used by fuzz/guard/check.py (the check of one call) and fuzz/guard/patch.py.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Target:
    """One entry point: `module.attr` (or `module.attr[key]` for a function kept in a
    module-level dict, a backend registry), and the argument conventions of its family.

    style "flash_attn": flash-attn 2, vLLM's fork, and any paged FA wrapper (a `causal`
    argument; fp16/bf16 on CUDA); "torch": torch.nn.attention.varlen (causal iff
    window_size == (-1, 0)); "reference": our reference backend (any float dtype, `tile_q`)."""

    module: str
    attr: str
    style: str = "flash_attn"
    key: str | None = None

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.attr}" + ("" if self.key is None else f"[{self.key!r}]")


TARGETS: tuple[Target, ...] = (
    Target("flash_attn", "flash_attn_varlen_func"),
    Target("flash_attn.flash_attn_interface", "flash_attn_varlen_func"),
    # flash-attn-4 (CuTe DSL): `page_table` for the block table, `seqused_k`, `cu_seqlens_k=None`.
    Target("flash_attn.cute", "flash_attn_varlen_func"),
    Target("flash_attn.cute.interface", "flash_attn_varlen_func"),
    Target("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
    Target("vllm.vllm_flash_attn.flash_attn_interface", "flash_attn_varlen_func"),
    Target("torch.nn.attention.varlen", "varlen_attn", "torch"),
    Target("torch.nn.attention.varlen", "varlen_attn_out", "torch"),
    Target("engine.attention.reference", "varlen_attention", "reference"),
    Target("engine.custom_ops", "varlen_attention", "reference"),
    # Our GPU backend around torch.ops.aten._flash_attention_forward (the selector's
    # TorchFlashBackend looks it up on its module at each call). Its "flash_attn" sibling
    # (engine/attention/flash_attn_backend.py) looks flash_attn.cute.flash_attn_varlen_func (or
    # FA2's) up at each call: that is wrapped itself.
    Target("engine.attention.torch_flash", "torch_flash_varlen"),
)
_STYLES = ("flash_attn", "torch", "reference")

# check_varlen_args parameter -> the names entry points use for it.
_ALIASES = {
    "q": ("q", "query"),
    "k": ("k", "key", "k_cache"),
    "v": ("v", "value", "v_cache"),
    "cu_seqlens_q": ("cu_seqlens_q", "cu_seq_q"),
    "cu_seqlens_k": ("cu_seqlens_k", "cu_seq_k"),
    "max_seqlen_q": ("max_seqlen_q", "max_q"),
    "max_seqlen_k": ("max_seqlen_k", "max_k"),
    "seqused_k": ("seqused_k",),
    "block_table": ("block_table", "page_table"),
    "causal": ("causal", "is_causal"),
    "window_size": ("window_size",),
    "tile_q": ("tile_q",),
}
_REQUIRED = ("q", "k", "v", "cu_seqlens_q", "max_seqlen_q", "max_seqlen_k")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                          "float8_e5m2fnuz") if hasattr(torch, n))
_MISSING = object()


def _default_max_seqlens(kw: dict) -> None:
    """flash-attn-4 makes max_seqlen_q/k optional: then the kernel bounds the query rows by
    total_q and the keys by the page-table row (or the key tensor). Check with those."""
    q, k, bt = kw["q"], kw["k"], kw["block_table"]
    if kw["max_seqlen_q"] is None and isinstance(q, torch.Tensor):
        kw["max_seqlen_q"] = q.shape[0]
    if kw["max_seqlen_k"] is None and isinstance(k, torch.Tensor):
        kw["max_seqlen_k"] = bt.shape[1] * k.shape[1] if isinstance(bt, torch.Tensor) else k.shape[0]


# -- argument mapping -----------------------------------------------------------------------
class _Unbound(Exception):
    """The call lacks an argument the check needs: let the original raise its TypeError."""


class _Spec:
    """How one entry point's (args, kwargs) become check_varlen_args' arguments."""

    def __init__(self, target: Target, fn) -> None:
        if target.style not in _STYLES:
            raise ValueError(f"{target.qualname}: unknown style {target.style!r}")
        self.target, self.qualname, self.style = target, target.qualname, target.style
        self.signature = inspect.signature(fn)  # ValueError/TypeError: not guardable
        params = list(self.signature.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.fetch: dict[str, tuple[str, int | None, object]] = {}
        for key, names in _ALIASES.items():
            for i, p in enumerate(params):
                if p.name in names and p.kind is not inspect.Parameter.VAR_POSITIONAL:
                    pos = i if p.kind in positional else None
                    default = _MISSING if p.default is inspect.Parameter.empty else p.default
                    self.fetch[key] = (p.name, pos, default)
                    break
        missing = [k for k in _REQUIRED if k not in self.fetch]
        if missing:
            raise ValueError(f"{self.qualname}{self.signature}: no parameter for {', '.join(missing)}")

    def get(self, args: tuple, kwargs: dict, key: str, default=None):
        spec = self.fetch.get(key)
        if spec is None:
            return default
        name, pos, dflt = spec
        if pos is not None and pos < len(args):
            return args[pos]
        value = kwargs.get(name, dflt)
        if value is _MISSING:
            raise _Unbound(name)
        return value

    def check_kwargs(self, args: tuple, kwargs: dict) -> dict:
        g = functools.partial(self.get, args, kwargs)
        kw = {"q": g("q"), "k": g("k"), "v": g("v"), "cu_seqlens_q": g("cu_seqlens_q"),
              "cu_seqlens_k": g("cu_seqlens_k"), "max_seqlen_q": g("max_seqlen_q"),
              "max_seqlen_k": g("max_seqlen_k"), "block_table": g("block_table"),
              "seqused_k": g("seqused_k")}
        if kw["cu_seqlens_q"] is None:
            # flash-attn-4's varlen entry point also takes dense [batch, seqlen, ...] inputs:
            # no varlen contract to check (counted as skipped).
            raise _Unbound("cu_seqlens_q")
        _default_max_seqlens(kw)
        if self.style == "reference":
            kw["causal"] = bool(g("causal", True))
            kw["tile_q"] = g("tile_q")
            kw["require_half"] = False  # the reference backend takes any float dtype
            return kw
        if self.style == "torch":
            # Exactly varlen_attn's rule: a list [-1, 0] is not causal there either.
            kw["causal"] = g("window_size", (-1, -1)) == (-1, 0)
        else:
            kw["causal"] = bool(g("causal", False))
        q, k, v = kw["q"], kw["k"], kw["v"]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and (q.dtype in _FP8 or k.dtype in _FP8):
            # FP8 attention (vLLM's fp8 KV cache, FA3 fp8): k/v legitimately differ from q and
            # nothing is fp16/bf16; check their shapes/strides as if they had q's dtype.
            kw["require_half"] = False
            if k.dtype != q.dtype:
                kw["k"] = torch.empty_strided(k.shape, k.stride(), dtype=q.dtype, device="meta")
                if isinstance(v, torch.Tensor):
                    kw["v"] = torch.empty_strided(v.shape, v.stride(), dtype=q.dtype, device="meta")
        return kw

    def arguments(self, args: tuple, kwargs: dict) -> dict:
        """Every argument of the call by parameter name, defaults included (for dumps)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
        except TypeError:
            out = {f"args[{i}]": a for i, a in enumerate(args)}
            out.update(kwargs)
            return out
        out = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                out.update({f"{name}[{i}]": a for i, a in enumerate(value)})
            elif kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out
