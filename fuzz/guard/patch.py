"""The FA guard's patching: put wrappers into module namespaces, and take them out again.

`_patch_available` wraps every target whose module is imported, then sweeps `sys.modules`
for module globals that are the very same function object (`from flash_attn import
flash_attn_varlen_func` done before install) and patches those too; every patch is recorded
so that `restore` can undo it. The caller (fuzz/guard.py) holds its lock around these.
"""
from __future__ import annotations

import sys
import types

from fuzz.guard.check import _make_wrapper, is_wrapper
from fuzz.guard.spec import _MISSING, TARGETS, Target, _Spec

_TARGETS: tuple[Target, ...] = TARGETS
_PATCHES: list[tuple[dict, str, object, object, str]] = []  # (namespace, key, original, wrapper, where)
_WRAPPERS: dict[int, tuple[object, object]] = {}  # id(original) -> (original, wrapper)
_UNGUARDABLE: dict[str, str] = {}  # qualname -> why its signature could not be mapped


def set_targets(targets: tuple[Target, ...]) -> None:
    global _TARGETS
    _TARGETS = targets


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


def restore() -> tuple[list[str], list[str]]:
    """Put back every function object patched (where nobody has rebound the name since) and
    forget the patches; return (restored, left_rebound), in patching order."""
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
    return restored[::-1], left[::-1]


def patch_status() -> dict:
    """What is patched: entry points (module attributes named by the targets), other module
    globals found by the sweep, targets not imported (yet), unguardable ones."""
    targets = {t.qualname for t in _TARGETS}
    patched = [where for *_, where in _PATCHES]
    done = {p for p in patched if p in targets}
    return {"entry_points": sorted(done), "swept_references": sorted(set(patched) - targets),
            "waiting_for_import": sorted(t.qualname for t in _TARGETS
                                         if t.qualname not in done and t.module not in sys.modules),
            "unguardable": dict(_UNGUARDABLE)}
