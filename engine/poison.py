"""What a reset leaves in a rank's persistent memory: NaN poison or stale values.

A read of memory nothing in this Case wrote is the bug class behind stale metadata, unsynced
copies and short copies. Two ways to fill that memory at each reset:

- "nan": NaN in float buffers, an out-of-range index in int buffers, a huge finite value in
  the KV cache (paged kernels load whole pages, and 0 x NaN would be NaN). Loud: such a read
  shows as non-finite logits or an out-of-range index, whatever the batch.
- "stale": what GPU memory really holds -- finite values from earlier batches: K/V and
  activations of a normal size, in-range token ids, positions, block ids and slots,
  monotone query offsets. A read of it gives wrong but plausible numbers, or a valid index
  to the wrong place, and only a comparison with an oracle or an invariant sees it.

Both are deterministic (the stale values are a function of the buffer's role and position),
so a Case's verdict never depends on the Cases an engine ran before. They are computed on
the buffer's device at each reset, cheaply (a few ops, no generator, nothing cached).
"""
from __future__ import annotations

import zlib

import torch

POISON_MODES = ("nan", "stale")
POISON_INT = -(2 ** 30)  # out-of-range index poison for int buffers
KV_POISON = 1.0e4  # finite: paged kernels load whole pages and 0 x NaN would be NaN


def check_mode(mode: str) -> str:
    if mode not in POISON_MODES:
        raise ValueError(f"poison: {mode!r} is not one of {', '.join(POISON_MODES)}")
    return mode


def fill_floats(t: torch.Tensor, mode: str, role: str, *, nan_value: float = float("nan"),
                scale: float = 1.0) -> None:
    """Activations, K/V, output memory: NaN (or `nan_value`), or values in [-scale, scale]
    with the spread of activations (a sine of the flat index, its phase from the role)."""
    if mode == "nan":
        t.fill_(nan_value)
        return
    i = torch.arange(t.numel(), device=t.device, dtype=torch.float32)
    t.copy_((torch.sin(i * 0.7548776662 + _phase(role)) * scale).view(t.shape))


def fill_ints(t: torch.Tensor, mode: str, role: str, *, high: int, step: int = 1, low: int = 0) -> None:
    """Index buffers: POISON_INT, or in-range values of an earlier batch: low + (i * step) %
    (high - low) over the flattened buffer (step > 0 with one row per request gives monotone
    offsets, as query_start_loc holds)."""
    if mode == "nan":
        t.fill_(POISON_INT)
        return
    span = max(high - low, 1)
    t.copy_((low + (torch.arange(t.numel(), device=t.device) * step) % span).view(t.shape))


def _phase(role: str) -> float:
    return zlib.crc32(role.encode()) % 6283 / 1000.0
