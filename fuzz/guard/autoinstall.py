"""Start-up hook of the FA guard (`llmfuzz_guard.pth`): install it once torch is imported.

The `.pth` line imports this module only when `LLMFUZZ_FA_GUARD` is set, and this module
imports nothing but the standard library: the cost at interpreter start is one
environment lookup when the variable is unset, and a few microseconds when it is set.
The guard itself (`fuzz.guard`, which needs torch) is installed later, the moment torch
has finished importing, so an engine that never imports torch pays nothing, and start-up
never imports torch on the guard's behalf.

The import watcher (`watch`, `unwatch`, `watching`) lives in `fuzz.guard.watch`, which
`fuzz.guard` imports too; this module only uses it (and still answers to those names), so
the hook can import the guard without the guard importing the hook: no import cycle.

Environment:
  LLMFUZZ_FA_GUARD=raise|warn|dump      install the guard in that mode (unset/off: nothing)
  LLMFUZZ_FA_GUARD_DIR=PATH             dump directory (mode dump; default ./fa_guard_dumps)
  LLMFUZZ_FA_GUARD_DEVICE_VALUES=0      only shape/dtype/scalar checks (no device-to-host copies)
"""
from __future__ import annotations

import os

ENV_MODE, ENV_DIR, ENV_DEVICE_VALUES = "LLMFUZZ_FA_GUARD", "LLMFUZZ_FA_GUARD_DIR", \
    "LLMFUZZ_FA_GUARD_DEVICE_VALUES"

# The one line of `llmfuzz_guard.pth` (the build hook in fuzz/guard/build.py writes this;
# tests check that the checked-in file matches). site.py executes .pth lines that start
# with "import"; this one imports nothing unless the variable is set.
PTH_NAME = "llmfuzz_guard.pth"
PTH_LINE = ('import os; os.environ.get("LLMFUZZ_FA_GUARD") and '
            '__import__("fuzz.guard.autoinstall", fromlist=["bootstrap"]).bootstrap()\n')


# Names that live in fuzz.guard.watch, still reachable here (`hook.watch(...)` in tests and
# bench). Looked up on first use, not imported at the top: fuzz/guard/build.py loads this file
# by path in a build environment where the `fuzz` package is not importable.
_FROM_WATCH = frozenset({"MODES", "DEFAULT_DUMP_DIR", "WATCHED", "module_ready", "watch", "unwatch",
                         "watching"})


def __getattr__(name: str):
    if name in _FROM_WATCH:
        from fuzz.guard import watch as _guard_watch

        return getattr(_guard_watch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def config_from_env(environ=os.environ) -> dict | None:
    """The install() arguments LLMFUZZ_FA_GUARD* ask for, or None when the guard is off."""
    from fuzz.guard.watch import DEFAULT_DUMP_DIR, MODES

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
    from fuzz.guard.watch import module_ready

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
    from fuzz.guard.watch import module_ready, report, watch

    try:
        config = config_from_env(environ)
    except ValueError as e:
        report(f"FA guard: {e}; not installed")
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
        report(f"FA guard: not installed: {type(e).__name__}: {e}")
