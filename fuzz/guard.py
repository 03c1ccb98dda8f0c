"""FA guard: run `check_varlen_args` on every varlen FlashAttention call of a real engine.

    from fuzz import guard
    guard.install(mode="raise")          # or "warn", or "dump" with dump_dir=...
    ...                                  # run vLLM / your engine unmodified
    guard.uninstall()                    # the original functions are back, exactly

or, without touching the engine's code, `LLMFUZZ_FA_GUARD=raise python serve.py` (the
`llmfuzz_guard.pth` start-up hook; see fuzz/_guard_autoinstall.py and docs/guard.md).

What is wrapped (each when importable; a module imported after install() is patched the
moment its code has run): `flash_attn.flash_attn_varlen_func`,
`vllm.vllm_flash_attn.flash_attn_varlen_func` (and the `flash_attn_interface` modules that
define them), `torch.nn.attention.varlen.varlen_attn` / `varlen_attn_out`, and our
backends: `engine.attention.reference.varlen_attention` (also the name `engine.custom_ops`
imported) and `engine.attention.torch_flash.torch_flash_varlen` (also its entry in that
module's BACKENDS dict). Arguments are mapped onto `check_varlen_args` by parameter
name from each function's own signature, so vLLM's different argument order and torch's
`query`/`cu_seq_q`/`max_q` names need no per-version tables.

Besides the module attributes, install() sweeps `sys.modules` for module globals that are
the very same function object (`from flash_attn import flash_attn_varlen_func` done before
install) and patches those too; uninstall() undoes every patch it made. What it cannot
reach: references held anywhere but a module global (a class attribute, a dict, a
closure, a default argument, a functools.partial, a bound C++ op such as
`torch.ops._vllm_fa2_C.varlen_fwd` called directly).

Modes: "raise" raises FAInvariantError (naming the entry point) before the kernel runs;
"warn" warns once per distinct violation (FAGuardWarning) and calls the kernel; "dump"
writes the call's arguments to `dump_dir/<one folder per violation>` (fuzz/guard_dump.py;
`llmfuzz check-fa DIR` re-checks it), warns once, and calls the kernel.

Device values. `check_varlen_args` copies cu_seqlens / seqused_k / block_table to the host
(a device synchronisation). With check_device_values=False, and always while the current
CUDA stream is capturing a graph, under torch.compile tracing, or for fake/meta tensors,
only `check_varlen_shapes` runs (the first phase of the contract in
engine/attention/fa_contract.py): shapes, dtypes, devices, strides and host scalars, no
device-to-host copy. A captured CUDA graph replays kernels without running Python, so the
guard sees a graphed call once, at capture, with the capture batch's buffers: a baked
`max_seqlen_q` that a later replay's batch outgrows is invisible to it (docs/guard.md).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field

import torch

from engine.attention.fa_contract import FAInvariantError, check_varlen_args, check_varlen_shapes, is_fake
# The import watcher, shared with the start-up hook (fuzz._guard_autoinstall imports this module).
from fuzz import _guard_watch

__all__ = ["FAGuardWarning", "FAInvariantError", "MODES", "TARGETS", "Target", "check_varlen_shapes",
           "install", "installed", "is_installed", "stats", "status", "uninstall", "wrap"]

MODES = _guard_watch.MODES
DEFAULT_DUMP_DIR = _guard_watch.DEFAULT_DUMP_DIR


class FAGuardWarning(RuntimeWarning):
    """A FlashAttention varlen invariant violated by a guarded call (mode warn / dump)."""


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
    Target("vllm.vllm_flash_attn", "flash_attn_varlen_func"),
    Target("vllm.vllm_flash_attn.flash_attn_interface", "flash_attn_varlen_func"),
    Target("torch.nn.attention.varlen", "varlen_attn", "torch"),
    Target("torch.nn.attention.varlen", "varlen_attn_out", "torch"),
    Target("engine.attention.reference", "varlen_attention", "reference"),
    Target("engine.custom_ops", "varlen_attention", "reference"),
    # Our GPU backend around torch.ops.aten._flash_attention_forward (custom_ops dispatches
    # through the BACKENDS dict). Its "flash_attn" sibling calls flash_attn_varlen_func,
    # which is wrapped itself.
    Target("engine.attention.torch_flash", "torch_flash_varlen"),
    Target("engine.attention.torch_flash", "BACKENDS", key="torch_flash"),
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


# -- state ----------------------------------------------------------------------------------
@dataclass
class _State:
    mode: str
    dump_dir: str | None
    check_device_values: bool
    max_dumps: int
    dump_max_bytes: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    seen: set = field(default_factory=set)
    calls: int = 0
    full_checks: int = 0
    host_only_checks: int = 0
    skipped: int = 0  # torch.compile tracing, or arguments the check could not bind
    violations: int = 0
    dumps: list = field(default_factory=list)
    last_violation: str | None = None
    internal_errors: int = 0


_STATE: _State | None = None
_LOCK = threading.RLock()
_TARGETS: tuple[Target, ...] = TARGETS
_PATCHES: list[tuple[dict, str, object, object, str]] = []  # (namespace, key, original, wrapper, where)
_WRAPPERS: dict[int, tuple[object, object]] = {}  # id(original) -> (original, wrapper)
_UNGUARDABLE: dict[str, str] = {}  # qualname -> why its signature could not be mapped
_MAX_SEEN = 10_000


def _check_call(spec: _Spec, args: tuple, kwargs: dict) -> None:
    st = _STATE
    if st is None:
        return
    st.calls += 1
    if torch.compiler.is_compiling():
        st.skipped += 1  # traced code: no values, and the check must not enter the graph
        return
    violation = None
    try:
        kw = spec.check_kwargs(args, kwargs)
        q, cu = kw["q"], kw["cu_seqlens_q"]
        host_only = not st.check_device_values
        if not host_only and isinstance(q, torch.Tensor):
            if is_fake(q) or (isinstance(cu, torch.Tensor) and is_fake(cu)):
                host_only = True
            elif q.is_cuda and torch.cuda.is_current_stream_capturing():
                host_only = True  # a device-to-host copy would break (or invalidate) the capture
        if host_only:
            st.host_only_checks += 1
            check_varlen_shapes(**kw)
        else:
            st.full_checks += 1
            check_varlen_args(**kw)
    except FAInvariantError as e:
        violation = e
    except _Unbound:  # the original raises its own TypeError
        st.skipped += 1
        return
    except Exception as e:  # a bug of ours must not take the engine down
        st.internal_errors += 1
        if st.internal_errors == 1:
            warnings.warn(f"FA guard: checking {spec.qualname} failed: {type(e).__name__}: {e}",
                          FAGuardWarning, stacklevel=3)
        return
    if violation is not None:  # handled outside the except block: no chained traceback
        _violation(st, spec, violation, args, kwargs, kw, host_only)


def _violation(st: _State, spec: _Spec, err: FAInvariantError, args: tuple, kwargs: dict,
               kw: dict, host_only: bool) -> None:
    message = f"{spec.qualname}: {err.message}"
    with st.lock:
        st.violations += 1
        st.last_violation = message
        first = message not in st.seen
        if first and len(st.seen) < _MAX_SEEN:
            st.seen.add(message)
    if st.mode == "raise":
        exc = FAInvariantError(err.argument, message, err.index, err.report)
        exc.target = spec.qualname
        raise exc
    if not first:
        return
    if st.mode == "dump" and len(st.dumps) < st.max_dumps:
        from fuzz.guard_dump import write_dump

        try:
            path = write_dump(st.dump_dir, spec.qualname, spec.arguments(args, kwargs), kw,
                              violation=err, values=not host_only, max_float_bytes=st.dump_max_bytes)
        except Exception as e:
            message += f" (dump failed: {type(e).__name__}: {e})"
        else:
            with st.lock:
                st.dumps.append(str(path))
            message += f" (dumped to {path}; re-check with: llmfuzz check-fa {path})"
    warnings.warn(message, FAGuardWarning, stacklevel=4)


def _make_wrapper(original, spec: _Spec):
    @functools.wraps(original)
    def fa_guard(*args, **kwargs):
        if _STATE is not None:
            _check_call(spec, args, kwargs)
        return original(*args, **kwargs)

    fa_guard.__llmfuzz_fa_guard__ = spec.qualname
    return fa_guard


def is_wrapper(fn) -> bool:
    return getattr(fn, "__llmfuzz_fa_guard__", None) is not None


def wrap(fn, style: str = "flash_attn", name: str | None = None):
    """A guarded version of any varlen attention function (your engine's own entry point):
    it checks while the guard is installed (same mode, counters, dumps) and is a plain
    pass-through otherwise. Arguments are mapped by parameter name like the built-in targets."""
    qual = name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    module, _, attr = qual.rpartition(".")
    return _make_wrapper(fn, _Spec(Target(module, attr, style), fn))


# -- patching -------------------------------------------------------------------------------
def _wrapper_for(original, target: Target):
    hit = _WRAPPERS.get(id(original))
    if hit is not None and hit[0] is original:
        return hit[1]
    try:
        spec = _Spec(target, original)
    except (TypeError, ValueError) as e:
        _UNGUARDABLE[target.qualname] = str(e)
        return None
    wrapper = _make_wrapper(original, spec)
    _WRAPPERS[id(original)] = (original, wrapper)
    return wrapper


def _set(namespace: dict, key: str, original, wrapper, where: str) -> None:
    namespace[key] = wrapper
    _PATCHES.append((namespace, key, original, wrapper, where))


def _patch_available() -> None:
    """Patch every target whose module is imported, then every module global that is the
    same function object."""
    new: dict[int, tuple[object, object]] = {}
    for t in _TARGETS:
        mod = sys.modules.get(t.module)
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        slot = t.attr
        if t.key is not None:
            namespace, slot = namespace.get(t.attr), t.key
            if not isinstance(namespace, dict):
                continue
        original = namespace.get(slot, _MISSING)
        if original is _MISSING or not callable(original) or is_wrapper(original):
            continue
        wrapper = _wrapper_for(original, t)
        if wrapper is None:
            continue
        _set(namespace, slot, original, wrapper, t.qualname)
        new[id(original)] = (original, wrapper)
    if new:
        _sweep(new)


def _sweep(new: dict[int, tuple[object, object]]) -> None:
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType):
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for attr, value in list(d.items()):
            hit = new.get(id(value))
            if hit is not None and hit[0] is value:
                _set(d, attr, value, hit[1], f"{name}.{attr}")


def _on_import(name: str) -> None:
    with _LOCK:
        if _STATE is not None:
            _patch_available()


def install(mode: str = "raise", dump_dir: str | None = None, check_device_values: bool = True, *,
            max_dumps: int = 100, dump_max_bytes: int = 16 << 20,
            targets: tuple[Target, ...] | None = None, watch: bool = True) -> dict:
    """Wrap every importable varlen attention entry point with the invariant check.

    mode: "raise" | "warn" | "dump". dump_dir: where mode "dump" writes (default
    ./fa_guard_dumps, created on the first violation). check_device_values=False: shape,
    dtype and host-scalar checks only, no device-to-host copies. max_dumps: dumps per
    install (one per distinct violation). dump_max_bytes: budget for the float tensors
    (q/k/v/out) a dump stores by value; index tensors are always stored. targets: the
    entry points (default TARGETS; add `Target("mypkg.attn", "my_varlen")` for your own).
    watch: also patch targets whose modules are imported later. Installing again
    reconfigures the guard in place. Returns status()."""
    global _STATE, _TARGETS
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if max_dumps < 0 or dump_max_bytes < 0:
        raise ValueError("max_dumps and dump_max_bytes must be >= 0")
    with _LOCK:
        _TARGETS = tuple(TARGETS if targets is None else targets)
        _STATE = _State(mode, str(dump_dir or DEFAULT_DUMP_DIR) if mode == "dump" else
                        (str(dump_dir) if dump_dir else None), bool(check_device_values),
                        int(max_dumps), int(dump_max_bytes))
        if watch:
            _guard_watch.watch(_on_import, tuple(t.module for t in _TARGETS))
        else:
            _guard_watch.unwatch()
        _patch_available()
        return status()


def uninstall() -> dict:
    """Put back every function object install() replaced (where nobody has rebound the name
    since) and stop watching imports. Returns what was restored and what was left alone."""
    global _STATE
    with _LOCK:
        _guard_watch.unwatch()
        restored, left = [], []
        for namespace, key, original, wrapper, where in reversed(_PATCHES):
            if namespace.get(key, _MISSING) is wrapper:
                namespace[key] = original
                restored.append(where)
            else:
                left.append(where)
        _PATCHES.clear()
        _WRAPPERS.clear()
        _UNGUARDABLE.clear()
        _STATE = None
        return {"restored": restored[::-1], "left_rebound": left[::-1]}


def is_installed() -> bool:
    return _STATE is not None


@contextlib.contextmanager
def installed(mode: str = "raise", dump_dir: str | None = None, check_device_values: bool = True, **kw):
    """`with guard.installed("raise"): ...`: install for a block, uninstall after."""
    install(mode, dump_dir, check_device_values, **kw)
    try:
        yield
    finally:
        uninstall()


def stats() -> dict:
    """Counters since install(): calls, full/host-only checks, skipped, violations, dumps."""
    st = _STATE
    if st is None:
        return {}
    return {"calls": st.calls, "full_checks": st.full_checks, "host_only_checks": st.host_only_checks,
            "skipped": st.skipped, "violations": st.violations, "distinct_violations": len(st.seen),
            "dumps": list(st.dumps), "last_violation": st.last_violation,
            "internal_errors": st.internal_errors}


def status() -> dict:
    """Mode and what is patched: entry points (module attributes named by TARGETS), other
    module globals found by the sweep, targets not imported (yet), unguardable ones."""
    st = _STATE
    targets = {t.qualname for t in _TARGETS}
    patched = [where for *_, where in _PATCHES]
    done = {p for p in patched if p in targets}
    return {"installed": st is not None, "mode": st.mode if st else None,
            "dump_dir": st.dump_dir if st else None,
            "check_device_values": st.check_device_values if st else None,
            "watching_imports": _guard_watch.watching(),
            "entry_points": sorted(done), "swept_references": sorted(set(patched) - targets),
            "waiting_for_import": sorted(t.qualname for t in _TARGETS
                                         if t.qualname not in done and t.module not in sys.modules),
            "unguardable": dict(_UNGUARDABLE)}
