"""Reference attention backend: paged varlen attention in pure torch, FA contract taken literally.

It computes what FlashAttention-2 launches, from the scalars it is given. FA2 launches
ceil(max_seqlen_q / tile) row tiles per sequence (`FA2_PAGED_TILE_Q` = 64 rows with paged
KV) and loops over each sequence's own key blocks (`seqused_k`), whatever `max_seqlen_k`
says; it writes only the rows it launched, so every other row of the output keeps what
that memory held before -- stale, finite values on a GPU. So does this backend, given the
output memory (`out`): an understated max_seqlen_q changes a result only where a GPU's would
change, in whole tiles, and those rows hold whatever the memory held (finite garbage, or NaN
only when the engine's reset left NaN there: engine/poison.py).
`tile_q=None` cuts rows at max_seqlen_q exactly (for unit tests); without `out` the rows
not computed are NaN. Keys are read within a work width of max(max_seqlen_k, key_len_pad):
the engine pads it to max_model_len, so there an understated max_seqlen_k changes nothing,
as on the GPU (only the invariant check sees it); without the pad, keys past max_seqlen_k
fall outside the work and are dropped. Keys are gathered through the block table only below each
sequence's `seqused_k`, so poisoned or out-of-range entries past the live batch are never
touched.

The launch -- which (sequence, row) pairs run, which KV slots each reads, its mask -- depends
on the metadata only, so it is planned once (`plan_launch`) and reused by every layer of a
forward, every TP rank and the reference run of the same batch: a tiny model's step is
dominated by such per-call work, not by arithmetic.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

FA2_PAGED_TILE_Q = 64  # query rows per FA2 thread block with a paged KV cache (kBlockM)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      plans: "PlanCache | None" = None) -> None:
    """Write each token's k/v to its slot; slot -1 (padding) writes nothing.

    On CUDA the -1 slots are redirected into the null block 0 instead of being filtered:
    filtering needs a device-to-host sync, which a CUDA graph capture forbids, and block 0
    is never read for a live token (its poison must only stay finite, which k/v are).
    `plans`: a sink's cache of the filtered slots (CPU): a forward's layers write through
    the same slot_mapping, so its rows are picked once, while it is unwritten."""
    n = min(k.shape[0], slot_mapping.shape[0])
    k, v = k[:n], v[:n]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    if k.is_cuda:
        slots = slot_mapping[:n].long()
        valid = (slots >= 0)[:, None, None]
        slots = torch.where(slots >= 0, slots, torch.zeros_like(slots))
        # Padded rows may hold NaN (poisoned inputs); the null block must stay finite.
        k = torch.where(valid, k, torch.zeros_like(k))
        v = torch.where(valid, v, torch.zeros_like(v))
    else:
        hit, picked = plans.get((slot_mapping,), (n,)) if plans is not None else (False, None)
        if not hit:
            picked = _pick_slots(slot_mapping[:n])
            if plans is not None:
                plans.put((slot_mapping,), (n,), picked)
        slots, keep = picked
        if keep is not None:
            k, v = k[keep], v[keep]
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)


def _pick_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots written (as int64) and the rows that write them (None: every row)."""
    slots = slot_mapping.long()
    if bool((slots >= 0).all()):
        return slots, None
    keep = (slots >= 0).nonzero().squeeze(1)
    return slots[keep], keep


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, max_seqlen_q: int, seqused_k: torch.Tensor,
                     max_seqlen_k: int, block_table: torch.Tensor, softmax_scale: float,
                     causal: bool = True, tile_q: int | None = None,
                     key_len_pad: int | None = None, out: torch.Tensor | None = None,
                     plans: "PlanCache | None" = None) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].

    `out`: the output memory, [>= T, Hq, D]. The computed rows are written into it, as the
    kernel writes its output buffer, and rows not launched keep its earlier contents.
    `plans`: a GPU sink's cache of the launch (`plan_launch`): every layer of a forward
    reads the same buffers (engine/custom_ops.py).

    Each launched (sequence, row) pair is computed on its own, over a key width that masks
    what it may not see, so a row's bits do not depend on the batch's other sequences, on
    the padding, or on the width: eager and padded graph runs agree bitwise."""
    T, Hq, D = q.shape
    plan = plan_launch(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, T,
                       k_cache.shape[1], causal, tile_q, key_len_pad, plans)
    mem = torch.empty((T + 1, Hq, D), dtype=q.dtype, device=q.device)  # row T: the trash row
    if out is None:
        mem[:T].fill_(float("nan"))
    else:
        mem[:T].copy_(out[:T])
    for part in () if plan is None else (plan, *plan.rest):
        res = _attend(part, q, k_cache, v_cache, softmax_scale)
        # Computed rows go to their place, the rest to the trash row (no boolean indexing:
        # that would sync the device and break CUDA graph capture).
        mem.index_put_((part.dst,), res)
    if out is not None:
        out[:T].copy_(mem[:T])
    return mem[:T]


@dataclass(slots=True)
class LaunchPlan:
    """What one call launches, decided by its metadata alone. The work is a list of
    (sequence, query row) pairs: the row of q each pair reads (`q_row`), the KV slots of its
    sequence (`slots`, Lk per pair), the keys it may not see (`blocked`) and where its
    result is written (`dst`; T, a trash row, for a pair not launched). A host plan may come
    in several such parts, each with its own key width (`rest`)."""

    R: int  # pairs
    Lk: int
    q_row: torch.Tensor  # [R]
    slots: torch.Tensor  # [R * Lk]
    blocked: torch.Tensor  # [R, 1, 1, Lk]: broadcast over kv heads and query-head groups
    dst: torch.Tensor  # [R]
    rest: tuple = ()  # further parts (LaunchPlan) of the same launch


# A host launch with more key work than this is split by the keys each row can see: a long
# prefill's early rows and a batch's short sequences then do not pay for its longest row.
SPLIT_WORK = 16384
WIDTHS = (64, 128, 256, 512, 1024, 2048)


def _split_by_width(plan: LaunchPlan, need: torch.Tensor) -> LaunchPlan:
    """The same pairs, grouped by the key width they need (`need`: per pair, the last key it
    may see + 1). A row's bits do not depend on the width (test_reference_attention)."""
    if plan.R * plan.Lk <= SPLIT_WORK:
        return plan
    widths = torch.tensor([w for w in WIDTHS if w < plan.Lk] + [plan.Lk])
    bucket = torch.bucketize(need.clamp(max=plan.Lk), widths)
    slots, blocked = plan.slots.view(plan.R, plan.Lk), plan.blocked
    parts = []
    for i in bucket.unique().tolist():
        idx = (bucket == i).nonzero().squeeze(1)
        W = int(widths[i])
        parts.append(LaunchPlan(idx.shape[0], W, plan.q_row[idx], slots[idx, :W].reshape(-1),
                                blocked[idx, ..., :W], plan.dst[idx]))
    return dataclasses.replace(parts[0], rest=tuple(parts[1:]))


class PlanCache:
    """The last launch plan and the metadata it was made from. A forward's layers hand the
    kernel the same buffers and scalars, so the plan is made once per forward. It is reused
    only for the same tensor objects (held here, so none is freed and its address reused),
    unwritten since (their version counters) and the same scalars."""

    __slots__ = ("tensors", "key", "plan")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.tensors, self.key, self.plan = (), None, None

    def get(self, tensors: tuple, scalars: tuple):
        if len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors)) \
                and self.key == (_versions(tensors), scalars):
            return True, self.plan
        return False, None

    def put(self, tensors: tuple, scalars: tuple, plan) -> None:
        versions = _versions(tensors)
        # An inference tensor has no version counter, so a write to it could not be seen:
        # a plan made from one is never reused.
        self.tensors, self.key, self.plan = (tensors, (versions, scalars), plan) if versions is not None \
            else ((), None, None)


def _versions(tensors: tuple) -> tuple | None:
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


# Plans by their metadata's content, on the CPU: the TP ranks of a stage, a Case's reference
# and test runs, and the layers of a forward all launch the same work for the same batch.
# A plan is read-only once made. Bounded by bytes as well as by count: a long Case's plan
# holds ~1 MB of indices, and 32 of those grew a campaign's RSS by ~45 MB (the memory test).
_CPU_PLANS: "OrderedDict[tuple, LaunchPlan | None]" = OrderedDict()
CPU_PLANS_KEPT, CPU_PLANS_BYTES = 64, 8 << 20
_cpu_plan_bytes = 0


def clear_plans() -> None:
    global _cpu_plan_bytes
    _CPU_PLANS.clear()
    _cpu_plan_bytes = 0


def _plan_bytes(plan: LaunchPlan | None) -> int:
    return 0 if plan is None else sum(t.nbytes for p in (plan, *plan.rest)
                                      for t in (p.q_row, p.slots, p.blocked, p.dst))


def plan_launch(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, T, block_size, causal,
                tile_q, key_len_pad, plans: PlanCache | None = None) -> LaunchPlan | None:
    """The launch for these metadata (None: nothing is launched). On the CPU, from the
    plans made for the same metadata content; elsewhere from `plans` when it holds one made
    from the same buffers, unwritten since (a GPU's buffers are not read from the host)."""
    scalars = (int(max_seqlen_q), int(max_seqlen_k), T, block_size, causal, tile_q, key_len_pad)
    tensors = (cu_seqlens_q, seqused_k, block_table)
    if plans is not None:  # the forward's earlier layers: the same buffers, unwritten since
        hit, plan = plans.get(tensors, scalars)
        if hit:
            return plan
    if _host_readable(cu_seqlens_q):
        plan = _cpu_plan(cu_seqlens_q, seqused_k, block_table, scalars)
    else:
        plan = _make_plan(cu_seqlens_q, seqused_k, block_table, *scalars)
    if plans is not None:
        plans.put(tensors, scalars, plan)
    return plan


def _cpu_plan(cu_seqlens_q, seqused_k, block_table, scalars: tuple) -> LaunchPlan | None:
    global _cpu_plan_bytes
    B = max(cu_seqlens_q.shape[0] - 1, 0)
    key = (_content(cu_seqlens_q), _content(seqused_k[:B]), _content(block_table[:B])) + scalars
    if key in _CPU_PLANS:
        _CPU_PLANS.move_to_end(key)
        return _CPU_PLANS[key]
    plan = _CPU_PLANS[key] = _make_plan(cu_seqlens_q, seqused_k, block_table, *scalars, host=True)
    _cpu_plan_bytes += _plan_bytes(plan)
    while len(_CPU_PLANS) > 1 and (len(_CPU_PLANS) > CPU_PLANS_KEPT or _cpu_plan_bytes > CPU_PLANS_BYTES):
        _cpu_plan_bytes -= _plan_bytes(_CPU_PLANS.popitem(last=False)[1])
    return plan


def _host_readable(t: torch.Tensor) -> bool:
    """A plain CPU tensor: its values can be read (not a GPU's, not a fake one being traced)."""
    return type(t) is torch.Tensor and t.device.type == "cpu"


def _content(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.numpy().tobytes()


def _make_plan(cu_seqlens_q, seqused_k, block_table, max_seqlen_q, max_seqlen_k, T, bs, causal, tile_q,
               key_len_pad, host: bool = False) -> LaunchPlan | None:
    """`host`: the metadata's values may be read on the host (plain CPU tensors); the plan
    then holds only the launched pairs and the keys some sequence has."""
    B = cu_seqlens_q.shape[0] - 1
    if B <= 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        return None
    dev = cu_seqlens_q.device
    cu = cu_seqlens_q.to(dev, torch.long)
    q_lens = cu[1:] - cu[:-1]
    k_lens = seqused_k[:B].to(dev, torch.long)
    rows = max_seqlen_q if tile_q is None else -(-max_seqlen_q // tile_q) * tile_q
    Lq, Lk = min(int(rows), T), max(int(max_seqlen_k), key_len_pad or 0)  # no sequence has more than T rows
    if key_len_pad and host:
        # Keys past every sequence's seqused_k are masked, and a masked key changes no bit of
        # a row's result (test_reference_attention: any work width gives the same bits), so
        # the CPU's work stops at the batch's longest sequence, not at max_model_len, nor at
        # a graph's baked max_seqlen_k (max_model_len too: it cost a replay 4x the key work).
        # (A GPU plan cannot read seqused_k from the host.) Only a seqused_k past the pad,
        # which no valid batch has, keeps the whole width.
        longest = -(-int(k_lens.max()) // 16) * 16
        Lk = max(longest, 1) if longest <= key_len_pad else max(int(max_seqlen_k), key_len_pad)

    # Launched pairs: row j < min(q_len, rows) of each sequence. On the host only those are
    # computed; on a GPU every (sequence, j < Lq) pair is, the rest written to the trash row
    # (counting the launched ones would read the device from the host, which a CUDA graph
    # capture forbids). A pair's arithmetic is the same either way.
    j = torch.arange(Lq, device=dev)
    launched = j[None, :] < torch.clamp(q_lens, max=Lq)[:, None]  # [B, Lq]
    if host:
        b, j = launched.nonzero(as_tuple=True)
        q_row = (cu[b] + j).clamp(0, max(T - 1, 0))
        dst = q_row
    else:
        b, j = torch.arange(B, device=dev).repeat_interleave(Lq), j.repeat(B)
        q_row = (cu[b] + j).clamp(0, max(T - 1, 0))
        dst = torch.where(launched.reshape(-1), q_row, torch.full_like(q_row, T))

    # Keys the kernel reads: p < seqused_k within the work width Lk, page by page.
    p = torch.arange(Lk, device=dev)
    k_valid = p[None, :] < torch.clamp(k_lens, max=Lk)[:, None]  # [B, Lk]
    col = (p // bs).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[:B].to(dev, torch.long)[:, col]  # [B, Lk]
    blocks = torch.where(k_valid, blocks, torch.zeros_like(blocks))
    slots = (blocks * bs + (p % bs)[None, :])[b]  # [R, Lk]
    allowed = k_valid[b]  # [R, Lk]
    need = k_lens[b]
    if causal:
        # Query row j sits at absolute position k_len - q_len + j (bottom-right aligned).
        qpos = (k_lens - q_lens)[b] + j  # [R]
        allowed = allowed & (p[None, :] <= qpos[:, None])
        need = torch.minimum(need, qpos + 1)
    plan = LaunchPlan(b.shape[0], Lk, q_row, slots.reshape(-1), ~allowed[:, None, None, :], dst)
    return _split_by_width(plan, need) if host else plan


def _attend(plan: LaunchPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Each pair's output row, [R, Hq, D]. Query heads are grouped by their kv head (head h
    reads kv head h // G), so keys are never repeated per query head."""
    R, Lk = plan.R, plan.Lk
    _, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    # Accumulate wider than the inputs (fp64 for fp32, fp32 for half): a row's result then
    # does not depend on how many heads or rows share the call.
    acc = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    qr = q.index_select(0, plan.q_row).to(acc).view(R, Hkv, G, D)
    kr = k_cache.view(-1, Hkv, D).index_select(0, plan.slots).to(acc).view(R, Lk, Hkv, D)
    vr = v_cache.view(-1, Hkv, D).index_select(0, plan.slots).to(acc).view(R, Lk, Hkv, D)
    scores = torch.matmul(qr, kr.permute(0, 2, 3, 1)) * scale  # [R, Hkv, G, Lk]
    probs = torch.softmax(scores.masked_fill_(plan.blocked, float("-inf")), dim=-1)
    return torch.matmul(probs, vr.transpose(1, 2)).view(R, Hq, D).to(q.dtype)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, contiguous k/v [Lk, Hkv, D], bottom-right causal: the test oracle."""
    Lq, Hq, _ = q.shape
    Lk, Hkv, _ = k.shape
    k = k.repeat_interleave(Hq // Hkv, dim=1).float()
    v = v.repeat_interleave(Hq // Hkv, dim=1).float()
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    mask = torch.arange(Lk)[None, :] <= (Lk - Lq + torch.arange(Lq))[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(q.dtype)
