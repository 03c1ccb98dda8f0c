"""FlashAttention varlen argument invariants (DESIGN.md, Properties, item 2).

`check_varlen_args` validates the arguments of one `flash_attn_varlen_func` call and
raises `FAInvariantError` naming the first bad argument and index. It is usable right
before a real kernel call and by the harness on recorded calls: q/k/v are only looked
at for shape, dtype, stride and device (so `meta` tensors work), and the integer
metadata is copied to the CPU once and checked with vectorised torch ops.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NoReturn

import torch

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


def _show(t: torch.Tensor, limit: int = 12) -> str:
    """A tensor's values for a message, cut short so the message stays a readable line."""
    values = t[:limit].tolist()
    return f"{values}"[:-1] + f", ... ({t.numel()} entries)]" if t.numel() > limit else f"{values}"


def _first(mask: torch.Tensor) -> int | None:
    """Index of the first True in a 1-D mask, or None."""
    hits = mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


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


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    # A meta tensor has no real device (recorded shapes only), so there is nothing to compare.
    if t.device.type != "meta" and device.type != "meta" and t.device != device:
        _fail(name, f"{name} is on {t.device} but q is on {device}")


def _index_shape(name: str, t: object, device: torch.device, dims: int,
                 dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> torch.Tensor:
    """An index tensor's type, dtype, device, rank and layout: the rules that need no values
    (the FA guard uses these alone inside CUDA graph capture)."""
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


def _int_tensor(name: str, t: object, device: torch.device, dims: int,
                dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> torch.Tensor:
    """Check an index tensor (`_index_shape`) and return its values as CPU int64."""
    _index_shape(name, t, device, dims, dtypes)
    if t.device.type == "meta":
        _fail(name, f"{name} is a meta tensor; its values are needed")
    # int64 on the CPU, once: sums and products below must not overflow int32.
    return t.detach().to("cpu", torch.int64)


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


def _check_offsets(name: str, cu: torch.Tensor, num_reqs: int, limit: int | None,
                   limit_name: str, expected_end: int | None = None) -> None:
    """cu_seqlens structure: starts at 0, non-decreasing over real requests, padded tail
    repeats cu[num_reqs] (vLLM graph padding: padded sequences are empty), within limit."""
    if cu.numel() == 0:
        _fail(name, f"{name} is empty; it needs batch + 1 entries")
    if cu[0] != 0:
        _fail(name, f"{name}[0]={int(cu[0])}, must be 0", 0)
    real = cu[: num_reqs + 1]
    i = _first(real[1:] < real[:-1])
    if i is not None:
        _fail(name, f"{name} decreases: {name}[{i + 1}]={int(cu[i + 1])} < {name}[{i}]={int(cu[i])}", i)
    end = int(cu[num_reqs])
    if expected_end is not None and end != expected_end:
        _fail(name, f"{name}[{num_reqs}]={end} != num_actual_tokens={expected_end} "
                    f"(num_reqs={num_reqs})", num_reqs)
    j = _first(cu[num_reqs + 1:] != end)
    if j is not None:
        j += num_reqs + 1
        _fail(name, f"{name} padded tail must repeat {name}[{num_reqs}]={end} (num_reqs={num_reqs}), "
                    f"got {name}[{j}]={int(cu[j])}; {name}={_show(cu)}", j)
    if limit is not None:
        j = _first(cu > limit)
        if j is not None:
            _fail(name, f"{name}[{j}]={int(cu[j])} > {limit_name}={limit}", j)


def _check_block_table(bt: torch.Tensor, k: torch.Tensor, batch: int, q_lens: torch.Tensor,
                       k_lens: torch.Tensor) -> None:
    """Paged KV: every real sequence's needed blocks are valid ids, and no block that a live
    sequence writes this step is used by another live one (shared read-only prefix blocks,
    as prefix caching makes them, are fine; block 0 is the null block padding may use)."""
    num_blocks, block_size = k.shape[0], k.shape[1]
    rows_, cols_ = bt.shape
    if rows_ < batch:
        _fail("block_table", f"block_table has {rows_} rows, fewer than the batch size {batch}")
    n = k_lens.numel()
    if n == 0:
        return
    need = (k_lens + block_size - 1) // block_size
    i = _first(need > cols_)
    if i is not None:
        _fail("block_table", f"sequence {i} has {int(k_lens[i])} keys, needs {int(need[i])} blocks of "
                             f"{block_size} but block_table has {cols_} columns", i)
    rows, cols = bt[:n], torch.arange(cols_)
    used = cols < need[:, None]
    bad = (used & ((rows < 0) | (rows >= num_blocks))).nonzero()
    if bad.numel():
        i, j = bad[0].tolist()
        _fail("block_table", f"block_table[{i}, {j}]={int(rows[i, j])} is not a block id in "
                             f"[0, {num_blocks}) (sequence {i} needs {int(need[i])} blocks)", i)
    live = used & (rows != 0)
    # Distinct (block, sequence) pairs, then the blocks claimed by two or more sequences.
    owners = torch.arange(n)[:, None].expand_as(rows)
    pairs = torch.unique(rows[live] * n + owners[live])
    blocks, counts = torch.unique(pairs // n, return_counts=True)
    shared = blocks[counts > 1]
    if shared.numel() == 0:
        return
    # Write range: the blocks holding key positions [k_len - q_len, k_len) of this step.
    start = (k_lens - q_lens).clamp(min=0)
    written = live & ((cols + 1) * block_size > start[:, None]) & (q_lens > 0)[:, None]
    hit = (written & torch.isin(rows, shared)).nonzero()
    if hit.numel():
        i, j = hit[0].tolist()
        b = int(rows[i, j])
        users = ((rows == b) & used).any(1)
        users[i] = False
        other = _first(users)
        _fail("block_table", f"block {b} (block_table[{i}, {j}]) is written by sequence {i} this step "
                             f"and also used by live sequence {other}", i)


def _check_slot_mapping(sm: torch.Tensor, num_tokens: int, capacity: int | None) -> None:
    """KV-write slots: in the cache or -1 (skip) for real tokens, -1 for padding, no slot twice."""
    if sm.numel() < num_tokens:
        _fail("slot_mapping", f"slot_mapping has {sm.numel()} entries < num_actual_tokens={num_tokens}")
    real = sm[:num_tokens]
    ok = (real == -1) | ((real >= 0) & (real < capacity) if capacity is not None else real >= 0)
    t = _first(~ok)
    if t is not None:
        bound = f"[0, {capacity})" if capacity is not None else "[0, inf)"
        _fail("slot_mapping", f"slot_mapping[{t}]={int(real[t])} is neither -1 nor a slot in {bound}", t)
    t = _first(sm[num_tokens:] != -1)
    if t is not None:
        t += num_tokens
        _fail("slot_mapping", f"padded slot_mapping[{t}]={int(sm[t])} must be -1 "
                              f"(num_actual_tokens={num_tokens})", t)
    tokens = (real >= 0).nonzero().flatten()
    slots, order = torch.sort(real[tokens], stable=True)
    dup = slots[1:] == slots[:-1]
    if dup.any():
        # Stable sort keeps equal slots in token order, so order[1:][dup] are repeat writers.
        t = int(tokens[order[1:][dup]].min())
        s = int(real[t])
        first = _first(real == s)
        _fail("slot_mapping", f"slot_mapping[{t}]={s} repeats slot_mapping[{first}]: two tokens "
                              f"write one KV slot", t)


def check_varlen_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
                      max_seqlen_q: int, max_seqlen_k: int, *,
                      block_table: torch.Tensor | None = None,
                      seqused_k: torch.Tensor | None = None, causal: bool = True,
                      num_reqs: int | None = None, num_actual_tokens: int | None = None,
                      slot_mapping: torch.Tensor | None = None, require_half: bool | None = None,
                      max_head_dim: int = 256, tile_q: int | None = None) -> VarlenReport:
    """Raise FAInvariantError at the first violated flash_attn_varlen_func invariant;
    otherwise return a VarlenReport. Never reads q/k/v values."""
    paged = block_table is not None
    _check_qkv(q, k, v, paged, require_half, max_head_dim)
    dev = q.device
    cu_q = _int_tensor("cu_seqlens_q", cu_seqlens_q, dev, 1)
    batch = cu_q.numel() - 1
    n = batch if num_reqs is None else _as_int("num_reqs", num_reqs)
    if n > batch:
        _fail("num_reqs", f"num_reqs={n} > batch size {batch} (len(cu_seqlens_q) - 1)")
    max_q, max_k = _as_int("max_seqlen_q", max_seqlen_q), _as_int("max_seqlen_k", max_seqlen_k)
    tokens = None if num_actual_tokens is None else _as_int("num_actual_tokens", num_actual_tokens)
    _check_offsets("cu_seqlens_q", cu_q, n, q.shape[0], "q.shape[0]", tokens)
    q_lens = cu_q[1: n + 1] - cu_q[:n]

    # Key lengths: seqused_k wins when given (as in the kernel), else cu_seqlens_k diffs.
    if cu_seqlens_k is not None:
        cu_k = _int_tensor("cu_seqlens_k", cu_seqlens_k, dev, 1)
        if cu_k.numel() != batch + 1:
            _fail("cu_seqlens_k", f"cu_seqlens_k has {cu_k.numel()} entries, cu_seqlens_q has {batch + 1}")
        _check_offsets("cu_seqlens_k", cu_k, n, None if paged else k.shape[0], "k.shape[0]")
        k_lens, k_src = cu_k[1: n + 1] - cu_k[:n], "cu_seqlens_k"
    elif not paged:
        _fail("cu_seqlens_k", "cu_seqlens_k is required without block_table")
    if seqused_k is not None:
        used = _int_tensor("seqused_k", seqused_k, dev, 1)
        if used.numel() != batch:
            _fail("seqused_k", f"seqused_k has {used.numel()} entries, the batch has {batch}")
        i = _first(used < 0)
        if i is not None:
            _fail("seqused_k", f"seqused_k[{i}]={int(used[i])} is negative", i)
        i = _first(used[n:] != 0)
        if i is not None:
            i += n
            _fail("seqused_k", f"padded seqused_k[{i}]={int(used[i])} must be 0 (num_reqs={n})", i)
        if cu_seqlens_k is not None and not paged:
            i = _first(used[:n] > k_lens)
            if i is not None:
                _fail("seqused_k", f"seqused_k[{i}]={int(used[i])} > key length {int(k_lens[i])} "
                                   f"from cu_seqlens_k", i)
        k_lens, k_src = used[:n], "seqused_k"
    elif cu_seqlens_k is None:
        _fail("seqused_k", "paged KV without cu_seqlens_k needs seqused_k")

    longest_q = int(q_lens.max()) if n else 0
    longest_k = int(k_lens.max()) if n else 0
    rows_dropped = None
    if tile_q is not None:
        tile_q = _as_int("tile_q", tile_q)
        if tile_q == 0:
            _fail("tile_q", "tile_q must be positive")
        # The kernel launches ceil(max_seqlen_q / tile_q) row tiles per sequence; rows past
        # the last tile are never computed (DESIGN.md: 200 vs 300 rows drops rows 256..299).
        covered = -(-max_q // tile_q) * tile_q
        rows_dropped = int((q_lens - covered).clamp(min=0).sum())
    report = VarlenReport(n, batch, int(cu_q[n]), longest_q, max_q - longest_q,
                          longest_k, max_k - longest_k, rows_dropped)
    i = _first(q_lens > max_q)
    if i is not None:
        skip = f"; with tile_q={tile_q} the kernel skips {rows_dropped} rows" if tile_q else ""
        _fail("max_seqlen_q", f"max_seqlen_q={max_q} < query length {int(q_lens[i])} of sequence {i} "
                              f"(cu_seqlens_q[{i}:{i + 2}]={cu_q[i:i + 2].tolist()}); longest query is "
                              f"{longest_q}{skip}", i, report)
    i = _first(k_lens > max_k)
    if i is not None:
        where = f"seqused_k[{i}]={int(k_lens[i])}" if k_src == "seqused_k" \
            else f"cu_seqlens_k[{i}:{i + 2}]={cu_k[i:i + 2].tolist()}"
        _fail("max_seqlen_k", f"max_seqlen_k={max_k} < key length {int(k_lens[i])} of sequence {i} "
                              f"({where}); longest key is {longest_k}", i, report)
    if causal:
        i = _first(q_lens > k_lens)
        if i is not None:
            _fail("causal", f"causal=True but sequence {i} has {int(q_lens[i])} queries > "
                            f"{int(k_lens[i])} keys", i)
    if paged:
        bt = _int_tensor("block_table", block_table, dev, 2)
        _check_block_table(bt, k, batch, q_lens, k_lens)
    if slot_mapping is not None:
        sm = _int_tensor("slot_mapping", slot_mapping, dev, 1, (torch.int64, torch.int32))
        _check_slot_mapping(sm, report.num_actual_tokens, k.shape[0] * k.shape[1] if paged else None)
    return report
