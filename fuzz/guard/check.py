"""The FA guard's check of one call: the wrapper, the install-time state, what a violation does.

`_make_wrapper` / `wrap` build the function that runs `check_varlen_args` (or only
`check_varlen_shapes`, where reading device values is impossible or unwanted) before the
original. What the check does with a violation follows the installed mode: "raise" raises,
"warn" warns once per distinct message, "dump" also writes the call (fuzz/guard/dump.py).
The state lives here, set by `fuzz.guard.install()` through `set_state`; with none the
wrapper is a plain pass-through.
"""
from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass, field

import torch

from engine.attention.fa_contract import FAInvariantError, check_varlen_args, check_varlen_shapes, is_fake
from fuzz.guard.spec import Target, _Spec, _Unbound


class FAGuardWarning(RuntimeWarning):
    """A FlashAttention varlen invariant violated by a guarded call (mode warn / dump)."""


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
_MAX_SEEN = 10_000


def state() -> _State | None:
    """The installed guard's state, or None when it is not installed."""
    return _STATE


def set_state(st: _State | None) -> None:
    global _STATE
    _STATE = st


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
        from fuzz.guard.dump import write_dump

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
