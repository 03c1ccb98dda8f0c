"""The FlashAttention varlen contract, phase one: the rules that read no device memory.

`check_varlen_shapes` checks q/k/v shapes, dtypes, devices and strides, the index tensors'
dtypes, ranks and lengths, and the host scalars: alone, it is what may run inside CUDA graph
capture and on fake tensors. Phase two, the values of the index tensors, is
`check_varlen_args` in the package (engine/attention/fa_contract/__init__.py), which
re-exports this module's public names: import them from `engine.attention.fa_contract`.
Torch and the standard library only.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NoReturn

import torch

__all__ = ["FAInvariantError", "VarlenReport", "check_varlen_shapes", "is_fake"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class VarlenReport:
    """What a checked call looked like, and how loose its frozen scalars are."""

    num_reqs: int  # real requests; the rest of the batch is graph padding
    batch_size: int  # padded batch handed to the kernel: len(cu_seqlens_q) - 1
    num_actual_tokens: int
    max_query_len: int
    max_seqlen_q_overstated_by: int  # negative only on an error's report (understated)
    max_key_len: int
    max_seqlen_k_overstated_by: int
    rows_dropped: int | None = None  # query rows a kernel with tile_q would skip


class FAInvariantError(AssertionError):
    """A violated FlashAttention varlen invariant: the argument, the index, one line of why.

    `report` is set when the lengths were already known (an understated max_seqlen),
    so callers can still see `rows_dropped` and how far the scalar is off.
    """

    def __init__(self, argument: str, message: str, index: int | None = None,
                 report: VarlenReport | None = None) -> None:
        # One line, always: the harness groups and shrinks failures by their message.
        message = " ".join(str(message).split())
        if argument not in message:
            message = f"{argument}: {message}"
        super().__init__(message)
        self.argument, self.message, self.index, self.report = argument, message, index, report

    def __reduce__(self):  # keep it picklable across worker processes
        return type(self), (self.argument, self.message, self.index, self.report)


def _fail(argument: str, message: str, index: int | None = None,
          report: VarlenReport | None = None) -> NoReturn:
    raise FAInvariantError(argument, message, index, report)


def _as_int(name: str, x: object) -> int:
    # Scalars arrive as Python ints, numpy ints or 1-element tensors (recorded calls).
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_floating_point() or x.device.type == "meta":
            _fail(name, f"{name} must be an integer scalar, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool):
        _fail(name, f"{name} must be an int, got bool")
    try:
        value = operator.index(x)
    except TypeError:
        _fail(name, f"{name} must be an int, got {type(x).__name__} {x!r}")
    if value < 0:
        _fail(name, f"{name}={value} is negative")
    return value


_fake_type = None


def is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (torch.compile, tracing) or a meta tensor: it has no values to read."""
    global _fake_type
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t.device.type == "meta"
    if _fake_type is None:  # imported on first need: most callers never meet a subclass
        from torch._subclasses.fake_tensor import FakeTensor
        _fake_type = FakeTensor
    return isinstance(t, _fake_type) or t.device.type == "meta"


def _host_int(name: str, x: object) -> int | None:
    """An integer scalar's value when it is on the host; None for a device tensor (reading it
    would synchronise), after checking what is visible without reading."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() \
            and x.device.type != "meta" and (x.device.type != "cpu" or is_fake(x)):
        return None
    return _as_int(name, x)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    # A meta tensor has no real device (recorded shapes only), so there is nothing to compare.
    if t.device.type != "meta" and device.type != "meta" and t.device != device:
        _fail(name, f"{name} is on {t.device} but q is on {device}")


def _index_shape(name: str, t: object, device: torch.device, dims: int,
                 dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> torch.Tensor:
    """An index tensor's type, dtype, device, rank and layout: the rules that need no values."""
    if not isinstance(t, torch.Tensor):
        _fail(name, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(name, f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    _check_device(name, t, device)
    if t.dim() != dims:
        _fail(name, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    # The kernel indexes these with a unit inner stride (CHECK_CONTIGUOUS / stride(-1) == 1).
    if t.numel() > 1 and t.size(-1) > 1 and t.stride(-1) != 1:
        _fail(name, f"{name} has stride(-1)={t.stride(-1)}, the kernel needs 1")
    return t


def _check_qkv(q: object, k: object, v: object, paged: bool, require_half: bool | None,
               max_head_dim: int) -> None:
    """Shape/dtype/layout rules of q, k, v; never reads their values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(name, f"{name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 3:
        _fail("q", f"q must be [total_q, nheads, head_dim], got shape {tuple(q.shape)}")
    kv_dims, kv_layout = (4, "[num_blocks, block_size, nheads_k, head_dim]") if paged \
        else (3, "[total_k, nheads_k, head_dim]")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != kv_dims:
            _fail(name, f"{name} must be {kv_layout}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            _fail(name, f"{name} has dtype {t.dtype} but q has {q.dtype}")
    half = q.device.type == "cuda" if require_half is None else require_half
    if half and q.dtype not in _HALF:
        _fail("q", f"q has dtype {q.dtype}; the kernel takes float16 or bfloat16")
    for name, t in (("k", k), ("v", v)):
        _check_device(name, t, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            _fail(name, f"{name} has stride(-1)={t.stride(-1)}; the last dim must be contiguous")
    head_dim = q.shape[-1]
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != head_dim:
            _fail(name, f"{name} head_dim {t.shape[-1]} != q head_dim {head_dim}")
    if v.shape[:-1] != k.shape[:-1]:
        _fail("v", f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)}")
    if head_dim > max_head_dim:
        _fail("q", f"q head_dim {head_dim} > max_head_dim {max_head_dim}")
    # The %8 rule is the CUDA kernel's (vectorised loads); the CPU reference has no such limit.
    if half and head_dim % 8:
        _fail("q", f"q head_dim {head_dim} is not a multiple of 8")
    nheads, nheads_k = q.shape[1], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k:
        _fail("k", f"q has {nheads} heads, not a multiple of k's {nheads_k} heads (GQA)")


def _check_num_reqs(num_reqs: object, batch: int, read) -> int | None:
    n = batch if num_reqs is None else read("num_reqs", num_reqs)
    if n is not None and n > batch:
        _fail("num_reqs", f"num_reqs={n} > batch size {batch} (len(cu_seqlens_q) - 1)")
    return n


def _check_tile_q(tile_q: object, read) -> int | None:
    tile = None if tile_q is None else read("tile_q", tile_q)
    if tile == 0:
        _fail("tile_q", "tile_q must be positive")
    return tile


def check_varlen_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
                        max_seqlen_q: int, max_seqlen_k: int, *,
                        block_table: torch.Tensor | None = None,
                        seqused_k: torch.Tensor | None = None, causal: bool = True,
                        num_reqs: int | None = None, num_actual_tokens: int | None = None,
                        slot_mapping: torch.Tensor | None = None, require_half: bool | None = None,
                        max_head_dim: int = 256, tile_q: int | None = None) -> None:
    """The rules of `check_varlen_args` that read no device memory: q/k/v shapes, dtypes,
    devices and strides, the index tensors' dtypes/ranks/lengths, host scalars. Safe inside
    CUDA graph capture and on fake tensors; it cannot see cu_seqlens / seqused_k /
    block_table values (so not an understated max_seqlen)."""
    paged = block_table is not None
    _check_qkv(q, k, v, paged, require_half, max_head_dim)
    dev = q.device
    cu_q = _index_shape("cu_seqlens_q", cu_seqlens_q, dev, 1)
    batch = cu_q.numel() - 1
    _check_num_reqs(num_reqs, batch, _host_int)
    _host_int("max_seqlen_q", max_seqlen_q)
    _host_int("max_seqlen_k", max_seqlen_k)
    tokens = None if num_actual_tokens is None else _host_int("num_actual_tokens", num_actual_tokens)
    if cu_q.numel() == 0:
        _fail("cu_seqlens_q", "cu_seqlens_q is empty; it needs batch + 1 entries")
    if cu_seqlens_k is not None:
        cu_k = _index_shape("cu_seqlens_k", cu_seqlens_k, dev, 1)
        if cu_k.numel() != batch + 1:
            _fail("cu_seqlens_k", f"cu_seqlens_k has {cu_k.numel()} entries, cu_seqlens_q has {batch + 1}")
    elif not paged:
        _fail("cu_seqlens_k", "cu_seqlens_k is required without block_table")
    if seqused_k is not None:
        used = _index_shape("seqused_k", seqused_k, dev, 1)
        if used.numel() != batch:
            _fail("seqused_k", f"seqused_k has {used.numel()} entries, the batch has {batch}")
    elif cu_seqlens_k is None:
        _fail("seqused_k", "paged KV without cu_seqlens_k needs seqused_k")
    _check_tile_q(tile_q, _host_int)
    if paged:
        bt = _index_shape("block_table", block_table, dev, 2)
        if bt.shape[0] < batch:
            _fail("block_table", f"block_table has {bt.shape[0]} rows, fewer than the batch size {batch}")
    if slot_mapping is not None:
        sm = _index_shape("slot_mapping", slot_mapping, dev, 1, (torch.int64, torch.int32))
        if tokens is not None and sm.numel() < tokens:
            _fail("slot_mapping", f"slot_mapping has {sm.numel()} entries < num_actual_tokens={tokens}")
