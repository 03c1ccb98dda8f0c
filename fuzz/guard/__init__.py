"""The FlashAttention guard: `check_varlen_args` on every varlen FA call of a real engine.

    from fuzz import guard
    guard.install(mode="raise")   # or "warn", or "dump" with dump_dir=...
    guard.uninstall()

Exports `install`, `uninstall`, `installed`, `is_installed`, `stats`, `status` and `MODES`
(`installer`); `FAGuardWarning`, `wrap`, `is_wrapper` (`check`); the entry points it wraps,
`Target` and `TARGETS` (`spec`); and the contract's `FAInvariantError` and
`check_varlen_shapes`. They load on first use: the start-up hook (`autoinstall`, standard
library only) and the build hook (`build`) import this package without torch.
"""
_EXPORTS = {
    "install": "fuzz.guard.installer", "uninstall": "fuzz.guard.installer", "installed": "fuzz.guard.installer",
    "is_installed": "fuzz.guard.installer", "stats": "fuzz.guard.installer", "status": "fuzz.guard.installer",
    "MODES": "fuzz.guard.installer", "FAGuardWarning": "fuzz.guard.check", "wrap": "fuzz.guard.check",
    "is_wrapper": "fuzz.guard.check", "Target": "fuzz.guard.spec", "TARGETS": "fuzz.guard.spec",
    "FAInvariantError": "engine.attention.fa_contract", "check_varlen_shapes": "engine.attention.fa_contract",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fuzz.guard' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
