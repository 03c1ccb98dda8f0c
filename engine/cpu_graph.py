"""CPU graph capture: the rank's forward traced by make_fx, replayed as a CUDA graph replays.

make_fx traces the forward in fake mode into an FX GraphModule. Every Python value the
forward read while tracing (max_seqlen_q/k, the padded shape, the attention scale, which
faults were on) is a constant of that graph, and every tensor it touched is an input bound
at capture: the weights, the KV cache and the static buffers. Replay calls the GraphModule
on those same tensors, so it reads live buffer contents with the scalars of its capture,
and a Python-side value changed after capture does not reach it -- as with a CUDA graph.
Attention, KV writes and collectives are custom ops, opaque to the trace: they run at
replay with their captured scalar arguments, and the attention op records each call.

Tracing costs ~50 ms per layer, and a campaign captures each (rank, size) of every pooled
engine. So a capture is traced in parts (engine/graph_runner.py: before the layers, each
layer, after them), and one trace serves every part whose code path it is: a `CaptureSpec.share_key`
names the code path (partition, options, faults, padded token count), the traced function
takes the rank's tensors as inputs instead of closing over them, and the ints of custom-op
calls that differ between captures of one code path become inputs too: those naming a
rank's sink, groups and layer, and the max_seqlen_q/k a capture bakes (each capture's
replay passes its own, so what a replay reads is still frozen at its capture). Sharing is verified,
not assumed: a trace that still holds a tensor constant (state this module was not told
about) or an unknown custom-op int is used by its own capture only, and a shared trace is
reused only where the inputs its aten ops read (not only custom ops) have the same shapes.
"""
from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from engine.custom_ops import EAGER_IMPLS, tracing_ops

# make_fx keeps global tracing state and is not thread-safe: one trace at a time.
CAPTURE_LOCK = threading.Lock()
# Custom ops whose int arguments are lifted to inputs: op -> {arg index: kind}. "key" is a
# sink or group key naming per-rank state (its role is found by value); the others are
# fixed-position roles whose value the capture names: "layer", the layer whose KV cache and
# records a call uses, and the metadata scalars the graph bakes, max_seqlen_q/k. A replay
# still passes the values of its own capture (baked, as a CUDA graph's), but one trace then
# serves every capture of its padded shape, whatever scalars each baked. A call whose int
# is not its capture's role value leaves the trace unshared.
_ROLE_ARGS = {"llmfuzz::unified_attention": {9: "max_seqlen_q", 10: "max_seqlen_k", 12: "key", 13: "layer"},
              "llmfuzz::all_reduce": {1: "key"}, "llmfuzz::all_gather": {1: "key"},
              "llmfuzz::reduce_scatter": {1: "key"}}
_POSITIONAL = frozenset(k for args in _ROLE_ARGS.values() for k in args.values()) - {"key"}
MAX_TEMPLATES = 256  # shared traces kept per process (~0.3 MB of generated code each at 8 layers)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where the forward finds one piece of rank state: an attribute of an object or an
    entry of a dict. Its value is a tensor or a tuple of tensors (a layer's K/V cache)."""

    owner: object
    key: object

    def get(self):
        return self.owner[self.key] if isinstance(self.owner, dict) else getattr(self.owner, self.key)

    def set(self, value) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)


def tensor_slots(*owners) -> list[Slot]:
    """Every tensor attribute of the given objects, and every tensor (or tuple of tensors)
    value of the given dicts, in a stable order."""
    slots = []
    for o in owners:
        items = o.items() if isinstance(o, dict) else vars(o).items()
        for k, v in items:
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple) and v and
                                                all(isinstance(t, torch.Tensor) for t in v)):
                slots.append(Slot(o, k))
    return slots


@dataclass(frozen=True, slots=True)
class CaptureSpec:
    """What a CPU capture needs beyond the function: the rank state it reads (as slots),
    the ints naming this rank's sink, groups and layer in custom-op calls (role -> value),
    and the key of its code path (None: never share)."""

    slots: tuple[Slot, ...]
    roles: dict
    share_key: tuple | None


@dataclass(slots=True)
class _Template:
    forward: Callable  # the traced graph's generated code (its FX graph is dropped: ~1 MB)
    roles: tuple[str, ...]  # role placeholders, after state and buffer inputs
    shape_inputs: tuple[int, ...]  # inputs read by aten ops: their shapes must match
    shapes: tuple
    outputs: tuple  # (tree spec, [(shape, dtype) or None per leaf]): examples for the next part


_TEMPLATES: "OrderedDict[tuple, list[_Template]]" = OrderedDict()
STATS = {"traces": 0, "shared": 0, "trace_seconds": 0.0}  # this process's captures (llmfuzz bench)


def capture(fn: Callable, static_args: list, spec: CaptureSpec) -> Callable:
    """Trace fn (or reuse a shared trace of its code path) and return its replay: a
    callable taking the static buffers, as `fn` does, bound to this rank's state now."""
    state, tree = pytree.tree_flatten([s.get() for s in spec.slots])
    inputs = state + list(static_args)
    t = _find(spec.share_key, inputs)
    if t is None:
        t = _trace(fn, spec, state, tree, static_args)
    try:
        role_values = tuple(spec.roles[r] for r in t.roles)
    except KeyError as e:
        raise KeyError(f"cpu graph: this rank has no {e.args[0]!r} for a shared trace") from None
    forward = t.forward

    def replay(*bufs):
        return forward(None, *state, *bufs, *role_values)  # `self` is unused: no constants
    replay.outputs = t.outputs
    return replay


def output_examples(replay: Callable):
    """Tensors shaped as `replay`'s outputs (zeros): the inputs a following part of the same
    capture is traced with, without running this one (it may hold collectives)."""
    tree, leaves = replay.outputs
    return pytree.tree_unflatten([None if x is None else torch.zeros(x[0], dtype=x[1]) for x in leaves], tree)


def _find(key: tuple | None, inputs: list) -> _Template | None:
    if key is None or key not in _TEMPLATES:
        return None
    _TEMPLATES.move_to_end(key)
    for t in _TEMPLATES[key]:
        if tuple(_shape(inputs[i]) for i in t.shape_inputs) == t.shapes:
            STATS["shared"] += 1
            return t
    return None


def _shape(x) -> tuple | None:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None


def _trace(fn: Callable, spec: CaptureSpec, state: list, tree, static_args: list) -> _Template:
    from torch.fx.experimental.proxy_tensor import make_fx

    n = len(state)

    def traced(*flat):
        # The rank's tensors become inputs for the length of the trace: the graph reads
        # them through placeholders, not as constants of whichever rank traced it.
        saved = [s.get() for s in spec.slots]
        for s, v in zip(spec.slots, pytree.tree_unflatten(list(flat[:n]), tree)):
            s.set(v)
        try:
            return fn(*flat[n:])
        finally:
            for s, v in zip(spec.slots, saved):
                s.set(v)

    inputs = state + list(static_args)
    t0 = time.perf_counter()
    with CAPTURE_LOCK:
        # Fake mode: collectives and KV writes do not execute while tracing; a host read of
        # a device value fails here, as it would break a CUDA graph.
        with tracing_ops():  # the model calls the custom ops, so the graph records them
            gm = make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    STATS["traces"] += 1
    STATS["trace_seconds"] += time.perf_counter() - t0
    roles, shareable = _lift_roles(gm, spec.roles)
    shareable = shareable and not any(nd.op == "get_attr" and isinstance(getattr(gm, nd.target), torch.Tensor)
                                      for nd in gm.graph.nodes)
    shape_inputs = _shape_inputs(gm, len(inputs))
    _call_impls(gm)
    # Kept: the generated forward alone. Its code reads only its inputs (no tensor constants,
    # checked above for a shared trace), so neither the GraphModule nor the FX graph with its
    # fake tensors needs to live on; the graph of an unshared trace dies with its capture.
    forward = _direct_calls(gm)
    t = _Template(forward if shareable else _bound(gm, forward), roles, shape_inputs,
                  tuple(_shape(inputs[i]) for i in shape_inputs), _outputs(gm))
    if spec.share_key is not None and shareable:
        _TEMPLATES.setdefault(spec.share_key, []).append(t)
        _TEMPLATES.move_to_end(spec.share_key)
        while len(_TEMPLATES) > MAX_TEMPLATES:
            _TEMPLATES.popitem(last=False)
    return t


def _bound(gm: GraphModule, forward: Callable) -> Callable:
    """An unshared trace may read tensor constants of its GraphModule: keep it."""
    return lambda _self, *args: forward(gm, *args)


_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def _direct_calls(gm: GraphModule) -> Callable:
    """The trace's generated forward, with each `torch.ops.ns.op.overload(...)` call bound to
    the overload's C++ entry point (`OpOverload._op`, which its Python `__call__` forwards
    to). The same ops with the same arguments, so the same bits; without four attribute
    lookups and a Python frame per op, a replay costs what the eager forward does (measured:
    a norm-projection-RoPE block replayed in 117 us through FX's code, 90 us bound, 78 us eager)."""
    glb = dict(type(gm).forward.__globals__)

    def bind(m: re.Match) -> str:
        ns, name, overload = m.groups()
        op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        key = f"_op_{ns}_{name}_{overload}"
        glb[key] = op._op
        return key + "("
    src = _OP_CALL.sub(bind, gm.code)
    exec(compile(src, f"<cpu graph {id(gm):x}>", "exec"), glb)
    return glb["forward"]


def _outputs(gm: GraphModule) -> tuple:
    out = next(nd for nd in gm.graph.nodes if nd.op == "output").args[0]
    leaves, tree = pytree.tree_flatten(out)
    vals = [getattr(x, "meta", {}).get("val") if isinstance(x, torch.fx.Node) else None for x in leaves]
    return tree, [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in vals]


def _lift_roles(gm: GraphModule, roles: dict) -> tuple[tuple[str, ...], bool]:
    """Turn the sink, group, layer and metadata-scalar ints baked into custom-op calls into
    trailing inputs, one per role. Returns the roles in input order, and whether every such int was a known
    role."""
    g = gm.graph
    placeholders = [nd for nd in g.nodes if nd.op == "placeholder"]
    lifted: dict[str, torch.fx.Node] = {}
    by_value = {v: name for name, v in roles.items() if name not in _POSITIONAL}
    known = True
    for nd in list(g.nodes):
        idx = _ROLE_ARGS.get(getattr(getattr(nd.target, "_schema", None), "name", None), {}) \
            if nd.op == "call_function" else {}
        for i, kind in idx.items():
            value = nd.args[i]
            role = (kind if kind in roles and roles[kind] == value else None) if kind in _POSITIONAL \
                else by_value.get(value)
            if role is None:
                known = False
                continue
            if role not in lifted:
                with g.inserting_after(placeholders[-1] if not lifted else list(lifted.values())[-1]):
                    lifted[role] = g.placeholder(f"role_{role}")
            args = list(nd.args)
            args[i] = lifted[role]
            nd.args = tuple(args)
    gm.recompile()
    return tuple(lifted), known


def _call_impls(gm: GraphModule) -> None:
    """Replay calls each custom op's own function, with the arguments the trace recorded:
    the same code the op runs, without the dispatcher's cost on every call."""
    for nd in gm.graph.nodes:
        name = getattr(getattr(nd.target, "_schema", None), "name", None) if nd.op == "call_function" else None
        if name in EAGER_IMPLS:
            nd.target = EAGER_IMPLS[name]
    gm.recompile()


def _shape_inputs(gm: GraphModule, num_inputs: int) -> tuple[int, ...]:
    """Indices of inputs some node other than a custom op reads: their shapes are baked into
    the graph's aten calls (views, aranges). Inputs only handed to custom ops (the KV cache,
    the block table) are read by the op at replay, whatever their size."""
    placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"][:num_inputs]
    out = []
    for i, p in enumerate(placeholders):
        if any(u.op != "call_function" or str(getattr(u.target, "namespace", "")) != "llmfuzz"
               for u in p.users):
            out.append(i)
    return tuple(out)


def clear_templates() -> None:
    """Drop the shared traces, and the dispatch cache make_fx's fake mode filled while tracing
    them (torch's, process-wide and unbounded: an entry per op and input shape traced)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _TEMPLATES.clear()
    FakeTensorMode.cache_clear()
