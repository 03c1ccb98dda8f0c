"""FA guard: run `check_varlen_args` on every varlen FlashAttention call of a real engine.

    from fuzz import guard
    guard.install(mode="raise")          # or "warn", or "dump" with dump_dir=...
    ...                                  # run vLLM / your engine unmodified
    guard.uninstall()                    # the original functions are back, exactly

or, without touching the engine's code, `LLMFUZZ_FA_GUARD=raise python serve.py` (the
`llmfuzz_guard.pth` start-up hook; see fuzz/guard/autoinstall.py and docs/guard.md).

What is wrapped (each when importable; a module imported after install() is patched the
moment its code has run): `flash_attn.flash_attn_varlen_func`, flash-attn-4's
`flash_attn.cute.flash_attn_varlen_func` (`page_table` is its block table),
`vllm.vllm_flash_attn.flash_attn_varlen_func` (and the `flash_attn_interface` modules that
define them), `torch.nn.attention.varlen.varlen_attn` / `varlen_attn_out`, and our
backends: `engine.attention.reference.varlen_attention` (also the name `engine.custom_ops`
imported) and `engine.attention.torch_flash.torch_flash_varlen`. Arguments are mapped onto `check_varlen_args` by parameter
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
writes the call's arguments to `dump_dir/<one folder per violation>` (fuzz/guard/dump.py;
`llmfuzz check-fa DIR` re-checks it), warns once, and calls the kernel.

Device values. `check_varlen_args` copies cu_seqlens / seqused_k / block_table to the host
(a device synchronisation). With check_device_values=False, and always while the current
CUDA stream is capturing a graph, under torch.compile tracing, or for fake/meta tensors,
only `check_varlen_shapes` runs (the first phase of the contract in
engine/attention/fa_contract.py): shapes, dtypes, devices, strides and host scalars, no
device-to-host copy. A captured CUDA graph replays kernels without running Python, so the
guard sees a graphed call once, at capture, with the capture batch's buffers: a baked
`max_seqlen_q` that a later replay's batch outgrows is invisible to it (docs/guard.md).

The pieces: fuzz/guard/spec.py (the entry points and their argument mapping),
fuzz/guard/check.py (the check of one call, the wrapper, the mode's reaction),
fuzz/guard/patch.py (patching and restoring module namespaces), fuzz/guard/watch.py (the
import watcher); this module installs and uninstalls them and reports on them.
"""
from __future__ import annotations

import contextlib
import threading

from fuzz.guard import check as guard_check
from fuzz.guard import patch as guard_patch
# The import watcher, shared with the start-up hook (fuzz.guard.autoinstall imports this module).
from fuzz.guard import watch as _guard_watch
from fuzz.guard.spec import TARGETS, Target

MODES = _guard_watch.MODES
DEFAULT_DUMP_DIR = _guard_watch.DEFAULT_DUMP_DIR

_LOCK = threading.RLock()


def _on_import(name: str) -> None:
    with _LOCK:
        if guard_check.state() is not None:
            guard_patch._patch_available()


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
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if max_dumps < 0 or dump_max_bytes < 0:
        raise ValueError("max_dumps and dump_max_bytes must be >= 0")
    with _LOCK:
        chosen = tuple(TARGETS if targets is None else targets)
        guard_patch.set_targets(chosen)
        guard_check.set_state(guard_check._State(
            mode, str(dump_dir or DEFAULT_DUMP_DIR) if mode == "dump" else
            (str(dump_dir) if dump_dir else None), bool(check_device_values),
            int(max_dumps), int(dump_max_bytes)))
        if watch:
            _guard_watch.watch(_on_import, tuple(t.module for t in chosen))
        else:
            _guard_watch.unwatch()
        guard_patch._patch_available()
        return status()


def uninstall() -> dict:
    """Put back every function object install() replaced (where nobody has rebound the name
    since) and stop watching imports. Returns what was restored and what was left alone."""
    with _LOCK:
        _guard_watch.unwatch()
        restored, left = guard_patch.restore()
        guard_check.set_state(None)
        return {"restored": restored, "left_rebound": left}


def is_installed() -> bool:
    return guard_check.state() is not None


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
    st = guard_check.state()
    if st is None:
        return {}
    return {"calls": st.calls, "full_checks": st.full_checks, "host_only_checks": st.host_only_checks,
            "skipped": st.skipped, "violations": st.violations, "distinct_violations": len(st.seen),
            "dumps": list(st.dumps), "last_violation": st.last_violation,
            "internal_errors": st.internal_errors}


def status() -> dict:
    """Mode and what is patched: entry points (module attributes named by TARGETS), other
    module globals found by the sweep, targets not imported (yet), unguardable ones."""
    st = guard_check.state()
    return {"installed": st is not None, "mode": st.mode if st else None,
            "dump_dir": st.dump_dir if st else None,
            "check_device_values": st.check_device_values if st else None,
            "watching_imports": _guard_watch.watching(), **guard_patch.patch_status()}
