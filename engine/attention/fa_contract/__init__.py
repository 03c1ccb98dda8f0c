"""The FlashAttention varlen contract: what one `flash_attn_varlen_func` call must satisfy.

A leaf package (torch and the standard library only; importing it loads no other engine
module), so the engine can check its own graph replays (engine/graph_runner.py) without
importing the harness; the fuzz harness, the FA guard and `llmfuzz check-fa` run this same
copy (`fuzz.invariants` re-exports it for users).

`check_varlen_args` raises `FAInvariantError` naming the first bad argument and index, or
returns a `VarlenReport`. Phase one, `check_varlen_shapes` (in shapes.py, re-exported here
with the error and report types), reads no device memory (shapes, dtypes, devices, strides,
host scalars): alone, it is what may run inside CUDA graph capture and on fake tensors.
Phase two, here, copies the integer metadata to the CPU once and checks its
values with vectorised torch ops. q/k/v are never read, so `meta` ones work (recorded calls).
"""
from __future__ import annotations

import torch

# Phase one (and the types both phases share) lives in shapes.py; re-exported here, the
# contract's one public home.
from engine.attention.fa_contract.shapes import (FAInvariantError, VarlenReport, _as_int, _check_num_reqs,
                                                 _check_tile_q, _fail, check_varlen_shapes, is_fake)

__all__ = ["FAInvariantError", "VarlenReport", "check_varlen_args", "check_varlen_shapes", "is_fake"]


def _show(t: torch.Tensor, limit: int = 12) -> str:
    """A tensor's values for a message, cut short so the message stays a readable line."""
    values = t[:limit].tolist()
    return f"{values}"[:-1] + f", ... ({t.numel()} entries)]" if t.numel() > limit else f"{values}"


def _first(mask: torch.Tensor) -> int | None:
    """Index of the first True in a 1-D mask, or None."""
    hits = mask.nonzero()
    return int(hits[0, 0]) if hits.numel() else None


def _values(name: str, t: torch.Tensor) -> torch.Tensor:
    """An index tensor's values as CPU int64 (its shape rules ran in the shapes phase)."""
    if t.device.type == "meta":
        _fail(name, f"{name} is a meta tensor; its values are needed")
    # int64 on the CPU, once: sums and products below must not overflow int32.
    return t.detach().to("cpu", torch.int64)


# -- values phase: the index tensors copied to the CPU --------------------------------------
def _check_offsets(name: str, cu: torch.Tensor, num_reqs: int, limit: int | None,
                   limit_name: str, expected_end: int | None = None) -> None:
    """cu_seqlens structure: starts at 0, non-decreasing over real requests, padded tail
    repeats cu[num_reqs] (vLLM graph padding: padded sequences are empty), within limit."""
    if cu[0] != 0:  # not empty: the shapes phase checked the lengths
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


def _check_block_table(bt: torch.Tensor, k: torch.Tensor, q_lens: torch.Tensor,
                       k_lens: torch.Tensor) -> None:
    """Paged KV: every real sequence's needed blocks are valid ids, and no block that a live
    sequence writes this step is used by another live one (shared read-only prefix blocks,
    as prefix caching makes them, are fine; block 0 is the null block padding may use)."""
    num_blocks, block_size = k.shape[0], k.shape[1]
    cols_ = bt.shape[1]
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


def _key_lengths(cu_seqlens_k: torch.Tensor | None, seqused_k: torch.Tensor | None, n: int,
                 k: torch.Tensor, paged: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Key length per real request: seqused_k wins when given (as in the kernel), else the
    cu_seqlens_k differences. Also returns cu_seqlens_k's values when the lengths came from
    it (for messages). The shapes phase made sure one of the two is there."""
    cu_k = k_lens = None
    if cu_seqlens_k is not None:
        cu_k = _values("cu_seqlens_k", cu_seqlens_k)
        _check_offsets("cu_seqlens_k", cu_k, n, None if paged else k.shape[0], "k.shape[0]")
        k_lens = cu_k[1: n + 1] - cu_k[:n]
    if seqused_k is None:
        return k_lens, cu_k
    used = _values("seqused_k", seqused_k)
    i = _first(used < 0)
    if i is not None:
        _fail("seqused_k", f"seqused_k[{i}]={int(used[i])} is negative", i)
    i = _first(used[n:] != 0)
    if i is not None:
        i += n
        _fail("seqused_k", f"padded seqused_k[{i}]={int(used[i])} must be 0 (num_reqs={n})", i)
    if cu_k is not None and not paged:
        i = _first(used[:n] > k_lens)
        if i is not None:
            _fail("seqused_k", f"seqused_k[{i}]={int(used[i])} > key length {int(k_lens[i])} "
                               f"from cu_seqlens_k", i)
    return used[:n], None


def _check_max_lengths(cu_q: torch.Tensor, n: int, max_q: int, max_k: int, k_lens: torch.Tensor,
                       cu_k: torch.Tensor | None, tile_q: int | None) -> VarlenReport:
    """max_seqlen_q/k bound every real sequence; the report says by how much they overstate."""
    q_lens = cu_q[1: n + 1] - cu_q[:n]
    longest_q = int(q_lens.max()) if n else 0
    longest_k = int(k_lens.max()) if n else 0
    rows_dropped = None
    if tile_q is not None:
        # The kernel launches ceil(max_seqlen_q / tile_q) row tiles per sequence; rows past
        # the last tile are never computed (docs/bug_classes.md#graph_stale_max_seqlen:
        # 200 vs 300 rows drops rows 256..299).
        covered = -(-max_q // tile_q) * tile_q
        rows_dropped = int((q_lens - covered).clamp(min=0).sum())
    report = VarlenReport(n, cu_q.numel() - 1, int(cu_q[n]), longest_q, max_q - longest_q,
                          longest_k, max_k - longest_k, rows_dropped)
    i = _first(q_lens > max_q)
    if i is not None:
        skip = f"; with tile_q={tile_q} the kernel skips {rows_dropped} rows" if tile_q else ""
        _fail("max_seqlen_q", f"max_seqlen_q={max_q} < query length {int(q_lens[i])} of sequence {i} "
                              f"(cu_seqlens_q[{i}:{i + 2}]={cu_q[i:i + 2].tolist()}); longest query is "
                              f"{longest_q}{skip}", i, report)
    i = _first(k_lens > max_k)
    if i is not None:
        where = f"seqused_k[{i}]={int(k_lens[i])}" if cu_k is None \
            else f"cu_seqlens_k[{i}:{i + 2}]={cu_k[i:i + 2].tolist()}"
        _fail("max_seqlen_k", f"max_seqlen_k={max_k} < key length {int(k_lens[i])} of sequence {i} "
                              f"({where}); longest key is {longest_k}", i, report)
    return report


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
    check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        block_table=block_table, seqused_k=seqused_k, causal=causal, num_reqs=num_reqs,
                        num_actual_tokens=num_actual_tokens, slot_mapping=slot_mapping,
                        require_half=require_half, max_head_dim=max_head_dim, tile_q=tile_q)
    paged = block_table is not None
    cu_q = _values("cu_seqlens_q", cu_seqlens_q)
    # The scalars again, reading device ones now (the shapes phase leaves those alone).
    n = _check_num_reqs(num_reqs, cu_q.numel() - 1, _as_int)
    max_q, max_k = _as_int("max_seqlen_q", max_seqlen_q), _as_int("max_seqlen_k", max_seqlen_k)
    tokens = None if num_actual_tokens is None else _as_int("num_actual_tokens", num_actual_tokens)
    tile = _check_tile_q(tile_q, _as_int)
    _check_offsets("cu_seqlens_q", cu_q, n, q.shape[0], "q.shape[0]", tokens)
    k_lens, cu_k = _key_lengths(cu_seqlens_k, seqused_k, n, k, paged)
    report = _check_max_lengths(cu_q, n, max_q, max_k, k_lens, cu_k, tile)
    q_lens = cu_q[1: n + 1] - cu_q[:n]
    if causal:
        i = _first(q_lens > k_lens)
        if i is not None:
            _fail("causal", f"causal=True but sequence {i} has {int(q_lens[i])} queries > "
                            f"{int(k_lens[i])} keys", i)
    if paged:
        _check_block_table(_values("block_table", block_table), k, q_lens, k_lens)
    if slot_mapping is not None:
        _check_slot_mapping(_values("slot_mapping", slot_mapping), report.num_actual_tokens,
                            k.shape[0] * k.shape[1] if paged else None)
    return report
