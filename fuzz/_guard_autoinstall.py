"""Start-up hook of the FA guard (`llmfuzz_guard.pth`) and its post-import watcher.

The `.pth` line imports this module only when `LLMFUZZ_FA_GUARD` is set, and this module
imports nothing but the standard library: the cost at interpreter start is one
environment lookup when the variable is unset, and a few microseconds when it is set.
The guard itself (`fuzz.guard`, which needs torch) is installed later, the moment torch
has finished importing, so an engine that never imports torch pays nothing, and start-up
never imports torch on the guard's behalf.

`watch(callback)` puts a meta-path finder first on `sys.meta_path` that lets the normal
finders locate a watched module, then calls `callback(name)` right after that module's
code has run, before `import` returns to whoever asked for it. `fuzz.guard` uses the same
watcher to patch `flash_attn` / `vllm.vllm_flash_attn` / `torch.nn.attention.varlen`
imported after `install()`: a later `from flash_attn import flash_attn_varlen_func` then
already sees the guarded function.

Environment:
  LLMFUZZ_FA_GUARD=raise|warn|dump      install the guard in that mode (unset/off: nothing)
  LLMFUZZ_FA_GUARD_DIR=PATH             dump directory (mode dump; default ./fa_guard_dumps)
  LLMFUZZ_FA_GUARD_DEVICE_VALUES=0      only shape/dtype/scalar checks (no device-to-host copies)
"""
from __future__ import annotations

import os
import sys
import threading

ENV_MODE, ENV_DIR, ENV_DEVICE_VALUES = "LLMFUZZ_FA_GUARD", "LLMFUZZ_FA_GUARD_DIR", \
    "LLMFUZZ_FA_GUARD_DEVICE_VALUES"
MODES = ("raise", "warn", "dump")
DEFAULT_DUMP_DIR = "fa_guard_dumps"

# Modules whose import completion is reported to the callback: torch itself (the guard can
# only be built once torch is whole) and every module that defines or re-exports an entry
# point `fuzz.guard` wraps.
WATCHED = frozenset({
    "torch",
    "torch.nn.attention.varlen",
    "flash_attn", "flash_attn.flash_attn_interface",
    "vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface",
    "engine.attention.reference", "engine.custom_ops", "engine.attention.torch_flash",
})

# The one line of `llmfuzz_guard.pth` (the build hook in fuzz/guard_build.py writes this;
# tests check that the checked-in file matches). site.py executes .pth lines that start
# with "import"; this one imports nothing unless the variable is set.
PTH_NAME = "llmfuzz_guard.pth"
PTH_LINE = ('import os; os.environ.get("LLMFUZZ_FA_GUARD") and '
            '__import__("fuzz._guard_autoinstall", fromlist=["bootstrap"]).bootstrap()\n')


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
            _report(f"FA guard: could not patch after importing {name}: {type(e).__name__}: {e}")

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


def _report(message: str) -> None:
    try:
        print(message, file=sys.stderr)
    except Exception:
        pass


def config_from_env(environ=os.environ) -> dict | None:
    """The install() arguments LLMFUZZ_FA_GUARD* ask for, or None when the guard is off."""
    mode = environ.get(ENV_MODE, "").strip().lower()
    if mode in ("", "0", "off", "no", "false", "none"):
        return None
    if mode not in MODES:
        raise ValueError(f"{ENV_MODE}={mode!r} is not one of {', '.join(MODES)}")
    device_values = environ.get(ENV_DEVICE_VALUES, "1").strip().lower() not in ("0", "no", "false", "off")
    return {"mode": mode, "dump_dir": environ.get(ENV_DIR) or DEFAULT_DUMP_DIR,
            "check_device_values": device_values}


_pending: dict | None = None


def _install_pending(just_loaded: str | None = None) -> None:
    global _pending
    if _pending is None or not module_ready("torch", just_loaded):
        return
    config, _pending = _pending, None
    from fuzz import guard  # imports torch, which is whole by now

    guard.install(**config)  # takes the watcher over with its own callback


def _on_import(name: str) -> None:
    _install_pending(just_loaded=name)


def bootstrap(environ=os.environ) -> None:
    """Entry point of the .pth line. Cheap: reads the environment and, when the guard is
    on, registers the watcher; torch and the guard are imported once torch is."""
    global _pending
    try:
        config = config_from_env(environ)
    except ValueError as e:
        _report(f"FA guard: {e}; not installed")
        return
    if config is None:
        return
    _pending = config
    try:
        if module_ready("torch"):
            _install_pending()
        else:
            watch(_on_import)
    except Exception as e:
        _report(f"FA guard: not installed: {type(e).__name__}: {e}")
