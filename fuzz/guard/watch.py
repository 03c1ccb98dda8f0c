"""The FA guard's post-import watcher and the settings the guard and its start-up hook share.

Standard library only, and it imports nothing of `fuzz`: both `fuzz.guard` and the start-up
hook `fuzz.guard.autoinstall` import it, and the hook imports the guard (to install it once
torch is whole), so the pieces both need live here, below the two, not in either.

`watch(callback)` puts a meta-path finder first on `sys.meta_path` that lets the normal
finders locate a watched module, then calls `callback(name)` right after that module's
code has run, before `import` returns to whoever asked for it. `fuzz.guard` uses it to patch
`flash_attn` / `vllm.vllm_flash_attn` / `torch.nn.attention.varlen` imported after
`install()`: a later `from flash_attn import flash_attn_varlen_func` then already sees the
guarded function. The start-up hook uses it to wait for torch.
"""
from __future__ import annotations

import sys
import threading

MODES = ("raise", "warn", "dump")
DEFAULT_DUMP_DIR = "fa_guard_dumps"

# Modules whose import completion is reported to the callback: torch itself (the guard can
# only be built once torch is whole) and every module that defines or re-exports an entry
# point `fuzz.guard` wraps.
WATCHED = frozenset({
    "torch",
    "torch.nn.attention.varlen",
    "flash_attn", "flash_attn.flash_attn_interface", "flash_attn.cute", "flash_attn.cute.interface",
    "vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface",
    "engine.attention.reference", "engine.custom_ops", "engine.attention.torch_flash",
})


def module_ready(name: str, just_loaded: str | None = None) -> bool:
    """True when `name` is imported and its module code has finished running.

    importlib marks a module's spec `_initializing` while its code runs; the module whose
    loader is reporting completion right now (`just_loaded`) is finished although the flag
    is still set until the loader returns."""
    mod = sys.modules.get(name)
    if mod is None:
        return False
    if name == just_loaded:
        return True
    return not getattr(getattr(mod, "__spec__", None), "_initializing", False)


class _NotifyingLoader:
    """Runs the real loader, restores it on the module, then reports the module."""

    def __init__(self, loader, finder: "_PostImportFinder") -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        real = self._loader
        real.exec_module(module)
        # Be invisible afterwards: importlib.reload, pkgutil and friends see the real loader.
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = real
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = real
        self._finder.notify(module.__name__)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _PostImportFinder:
    """A meta-path finder that never finds anything itself: it asks the other finders
    and wraps the loader of a watched module so the callback runs after its code."""

    def __init__(self) -> None:
        self.callback = None
        self._local = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _watched or self.callback is None:
            return None
        busy = self._local.__dict__.setdefault("busy", set())
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self)
        return spec

    def notify(self, name: str) -> None:
        callback = self.callback
        if callback is None:
            return
        try:
            callback(name)
        except Exception as e:  # never break the user's import because of the guard
            report(f"FA guard: could not patch after importing {name}: {type(e).__name__}: {e}")

    def invalidate_caches(self) -> None:
        pass


_finder: _PostImportFinder | None = None
_lock = threading.Lock()
_watched: set[str] = set(WATCHED)


def watch(callback, extra: tuple[str, ...] = ()) -> None:
    """Call `callback(module_name)` after each WATCHED module (and each name in `extra`) is
    imported; replaces any previous callback (one finder at most)."""
    global _finder
    with _lock:
        _watched.update(extra)
        if _finder is None:
            _finder = _PostImportFinder()
        _finder.callback = callback
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def unwatch() -> None:
    global _finder
    with _lock:
        if _finder is not None:
            _finder.callback = None
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
        _finder = None


def watching() -> bool:
    return _finder is not None and _finder in sys.meta_path


def report(message: str) -> None:
    """One line on stderr; never raises (it runs inside other people's imports)."""
    try:
        print(message, file=sys.stderr)
    except Exception:
        pass
