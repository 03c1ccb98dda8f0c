"""Attention, KV writes and collectives as `torch.library.custom_op`s.

A captured graph (make_fx on CPU) must still run these at replay: attention so its
FA call is recorded with the scalars the graph baked in, collectives so ranks meet.
A custom op takes only tensors and scalars, so inside a traced graph groups and attention
sinks are named by int keys into weak registries; eager calls pass the sink itself
(`attend`). Graph and eager run the same Python function. The sink holds the rank's
attention backend (engine/attention/selector.py), which `attend` calls after the KV write
and the record. `FACallRecord`, what a recorded call looked like, lives here beside
`_record` (engine.attention.metadata re-exports it): this module imports nothing of the
metadata module, which imports this one to register the ops.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch

# The reference backend calls `varlen_attention` by this module's name
# (engine/attention/selector.py), so a wrapper put on it here sees every call.
from engine.attention.reference import (FA2_PAGED_TILE_Q, PlanCache, reshape_and_cache,  # noqa: F401
                                        varlen_attention)

_keys = itertools.count(1)
# Weak values: the registries only find an engine's groups and sinks while the engine owns
# them. Strong ones would keep every engine ever built alive (its groups reach its world,
# workers, weights, KV cache and captured graphs): about 5 MB per engine over a long campaign.
GROUPS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()  # key -> GroupCoordinator
SINKS: "weakref.WeakValueDictionary[int, AttentionSink]" = weakref.WeakValueDictionary()  # key -> a runner's recording state


# Whether this thread is tracing a graph (engine/cpu_graph.py). Only a trace needs the ops
# themselves; everywhere else the same Python functions are called directly, which saves the
# dispatcher's ~10-80 us per call -- several calls per layer, the largest cost of a tiny step.
_trace_state = threading.local()


def tracing() -> bool:
    return getattr(_trace_state, "on", False)


@contextmanager
def tracing_ops():
    """While tracing: the model calls the custom ops, so the graph records them."""
    _trace_state.on = True
    try:
        yield
    finally:
        _trace_state.on = False


# FACallRecord fields that say where a call happened, not what the kernel was handed.
_WHERE = frozenset({"rank", "layer", "microbatch", "graph"})


@dataclass(slots=True)
class FACallRecord:
    """One attention call as the kernel saw it (cheap: int tensors are small clones)."""

    rank: int
    layer: int
    microbatch: int
    graph: bool  # replayed from a captured graph
    q_shape: tuple[int, ...]
    q_stride: tuple[int, ...]
    kv_shape: tuple[int, ...]
    kv_stride: tuple[int, ...]
    dtype: str
    device: str
    max_seqlen_q: int
    max_seqlen_k: int
    num_reqs: int
    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    backend: str = "reference"  # the kernel's dtype rules apply to real FA backends only

    def varlen_args(self) -> dict:
        """This call as keyword arguments of `engine.attention.fa_contract.check_varlen_args`.
        q/k/v are meta tensors with the recorded shapes and strides: the contract only looks
        at those, and a record keeps no activations."""
        dtype = getattr(torch, self.dtype)
        q = torch.empty_strided(self.q_shape, self.q_stride, dtype=dtype, device="meta")
        kv = torch.empty_strided(self.kv_shape, self.kv_stride, dtype=dtype, device="meta")
        return dict(q=q, k=kv, v=kv, cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=None,
                    max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                    block_table=self.block_table, seqused_k=self.seqused_k, causal=self.causal,
                    num_reqs=self.num_reqs, num_actual_tokens=self.num_actual_tokens,
                    slot_mapping=self.slot_mapping,
                    require_half=self.device.startswith("cuda") and self.backend != "reference")

    def contract_key(self, contents: dict | None = None) -> tuple:
        """Equal for two records the contract cannot tell apart: every field but where the
        call happened (so each layer's own scalars are in it), and the snapshot tensors by
        content -- the TP ranks of a stage and the layers of a forward hand the kernel the
        same metadata. A snapshot is a host copy nothing writes: `contents` memoizes each
        one's bytes by identity across the records of a check."""
        memo = {} if contents is None else contents
        out = []
        for v in (getattr(self, name) for name in _CONTRACT_FIELDS):
            if isinstance(v, torch.Tensor):
                hit = memo.get(id(v))
                if hit is None or hit[0] is not v:
                    hit = memo[id(v)] = (v, v.dtype, tuple(v.shape), v.numpy().tobytes())
                v = hit[1:]
            out.append(v)
        return tuple(out)


# Computed once: contract_key runs for every recorded attention call (hundreds an example).
_CONTRACT_FIELDS = tuple(f.name for f in fields(FACallRecord) if f.name not in _WHERE)


def register_group(group) -> int:
    key = next(_keys)
    GROUPS[key] = group
    return key


@dataclass
class AttentionSink:
    """Per-runner state the attention op reads at call time (host side, not baked)."""

    rank: int
    attn_backend: type  # an engine.attention.selector.AttentionBackend: runs the kernel
    records: list | None = None
    microbatch: int = 0
    graph: bool = False
    num_reqs: int = 0  # live (unpadded) batch, for the invariant check
    num_actual_tokens: int = 0
    tile_q: int | None = FA2_PAGED_TILE_Q  # the reference kernel's row tile (None: exact cut)
    key_len_pad: int | None = None  # pad key work shapes to this (max_model_len): bitwise modes
    # The memory the reference kernel writes its output into, [max tokens, heads, head_dim]:
    # rows it does not launch keep what an earlier call left there, as GPU memory does.
    attn_out: torch.Tensor | None = None
    key: int = 0  # its SINKS key, which a traced graph passes the op (set by register_sink)
    _snap: tuple | None = field(default=None, repr=False)  # this forward's metadata copy
    # The reference kernel's launch plan, made by a forward's first layer for all of them,
    # and likewise the KV slots its tokens write (engine/attention/reference.py).
    plans: PlanCache = field(default_factory=PlanCache, repr=False)
    slot_plans: PlanCache = field(default_factory=PlanCache, repr=False)

    def reset_snapshot(self) -> None:
        self._snap = None
        self.plans.clear()
        self.slot_plans.clear()

    def output_memory(self, q: torch.Tensor) -> torch.Tensor | None:
        """The output memory when it fits this call (a drafter's or a test's call may have
        other shapes: those get NaN for rows not launched)."""
        m = self.attn_out
        if m is None or m.shape[0] < q.shape[0] or m.shape[1:] != q.shape[1:] or m.dtype != q.dtype:
            return None
        return m


def register_sink(sink: AttentionSink) -> int:
    sink.key = key = next(_keys)
    SINKS[key] = sink
    return key


def tp_all_reduce(group, t: torch.Tensor) -> torch.Tensor:
    if group.world_size == 1:
        return t
    return torch.ops.llmfuzz.all_reduce(t, group.op_key) if tracing() else group.all_reduce(t)


def tp_all_gather(group, t: torch.Tensor, dim: int) -> torch.Tensor:
    if group.world_size == 1:
        return t
    if not tracing():
        return group.all_gather(t, dim=dim % t.dim())
    return torch.ops.llmfuzz.all_gather(t, group.op_key, dim % t.dim(), group.world_size)


def tp_reduce_scatter(group, t: torch.Tensor, dim: int) -> torch.Tensor:
    if group.world_size == 1:
        return t
    if not tracing():
        return reduce_scatter_impl(t, group.op_key, dim % t.dim(), group.world_size)
    return torch.ops.llmfuzz.reduce_scatter(t, group.op_key, dim % t.dim(), group.world_size)


def all_reduce_impl(t: torch.Tensor, group: int) -> torch.Tensor:
    return GROUPS[group].all_reduce(t)


def all_gather_impl(t: torch.Tensor, group: int, dim: int, world_size: int) -> torch.Tensor:
    return GROUPS[group].all_gather(t, dim=dim)


def reduce_scatter_impl(t: torch.Tensor, group: int, dim: int, world_size: int) -> torch.Tensor:
    return GROUPS[group].reduce_scatter(t, dim=dim).clone()


all_reduce = torch.library.custom_op("llmfuzz::all_reduce", all_reduce_impl, mutates_args=())


@all_reduce.register_fake
def _(t, group):
    return torch.empty_like(t)


all_gather = torch.library.custom_op("llmfuzz::all_gather", all_gather_impl, mutates_args=())


@all_gather.register_fake
def _(t, group, dim, world_size):
    shape = list(t.shape)
    shape[dim] *= world_size
    return t.new_empty(shape)


reduce_scatter = torch.library.custom_op("llmfuzz::reduce_scatter", reduce_scatter_impl, mutates_args=())


@reduce_scatter.register_fake
def _(t, group, dim, world_size):
    shape = list(t.shape)
    shape[dim] //= world_size
    return t.new_empty(shape)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
           slot_mapping: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
           sink: AttentionSink, layer: int) -> torch.Tensor:
    """One layer's attention: write the new keys and values, record the call (when the
    runner records), run the sink's backend."""
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, sink.slot_plans)
    if sink.records is not None:
        sink.records.append(_record(sink, layer, q, k_cache, query_start_loc, seq_lens, block_table,
                                    slot_mapping, max_seqlen_q, max_seqlen_k))
    return sink.attn_backend.forward(sink, q, k_cache, v_cache, query_start_loc, max_seqlen_q, seq_lens,
                                     max_seqlen_k, block_table, scale)


def unified_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, slot_mapping: torch.Tensor, max_seqlen_q: int,
                           max_seqlen_k: int, scale: float, sink: int, layer: int) -> torch.Tensor:
    """`attend` as the op sees it: a custom op's arguments are tensors and scalars only, so a
    traced graph names the sink by its SINKS key (rebound to each rank's own sink when a trace
    is shared, engine/cpu_graph.py)."""
    return attend(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping,
                  max_seqlen_q, max_seqlen_k, scale, SINKS[sink], layer)


unified_attention = torch.library.custom_op("llmfuzz::unified_attention", unified_attention_impl,
                                            mutates_args=("k_cache", "v_cache"))
# What a replayed trace calls instead of each op (engine/cpu_graph.py): the op's own function.
EAGER_IMPLS = {"llmfuzz::unified_attention": unified_attention_impl, "llmfuzz::all_reduce": all_reduce_impl,
               "llmfuzz::all_gather": all_gather_impl, "llmfuzz::reduce_scatter": reduce_scatter_impl}


@unified_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping,
      max_seqlen_q, max_seqlen_k, scale, sink, layer):
    return torch.empty_like(q)


def _record(s: AttentionSink, layer, q, k_cache, qsl, seq_lens, bt, sm, max_q, max_k) -> FACallRecord:
    if s._snap is None:
        # One snapshot per forward: every layer of a rank reads the same metadata buffers.
        s._snap = tuple(t.detach().to("cpu", copy=True) for t in (qsl, seq_lens, bt, sm))
    cu, sl, btc, smc = s._snap
    return FACallRecord(
        rank=s.rank, layer=layer, microbatch=s.microbatch, graph=s.graph, q_shape=tuple(q.shape),
        q_stride=tuple(q.stride()), kv_shape=tuple(k_cache.shape), kv_stride=tuple(k_cache.stride()),
        dtype=str(q.dtype).removeprefix("torch."), device=str(q.device), max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k), num_reqs=s.num_reqs, num_actual_tokens=s.num_actual_tokens,
        cu_seqlens_q=cu, seqused_k=sl, block_table=btc, slot_mapping=smc, backend=s.attn_backend.name)
