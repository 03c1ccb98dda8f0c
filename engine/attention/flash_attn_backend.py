"""The `flash_attn` attention backend: the real flash-attn package on the paged KV cache.

Two entry points, the first one importable wins:

1. flash-attn-4 (`pip install flash-attn-4`): `flash_attn.cute.flash_attn_varlen_func`, the
   CuTe DSL kernels (SM90 Hopper, SM100 Blackwell). Paged KV natively: `page_table` (int32,
   [batch, pages]), `seqused_k`, `cu_seqlens_k=None`. Any block size: a page of `tile_n`
   (128) keys loads by TMA, any other size (the engine's 4, 16, ...) per row by cp.async
   (`paged_kv_non_tma`), which needs a head dim that is a multiple of 16: a smaller one (the
   fuzz model's 8) runs on copies of q and the cache zero-padded to the next multiple (the
   same sums, so the same attention). Each new shape class JIT-compiles once per process
   (seconds); after that a call costs about 200 us, Python included. It takes `max_seqlen_q`
   as a scheduling hint only: an understated value leaves no row uncomputed (README, "What a
   kernel cannot show"), so under this kernel only the FA invariant check flags that bug.
2. FlashAttention-2 (`pip install flash-attn`): `flash_attn.flash_attn_varlen_func`. Its
   paged path needs a block size divisible by 256, so for smaller blocks the keys are first
   gathered through the block table into a packed layout (`cu_seqlens_k` from seqused_k, on
   the device: no host sync, so it captures into a CUDA graph). Typed against its documented
   signature and checked on the CPU with a stand-in kernel (tests/engine/
   test_flash_attn_backend.py); no FA2 wheel exists for the torch this project pins, so no
   GPU run covers it.

The kernel is looked up on its module at every call (`flash_attn.cute.flash_attn_varlen_func`,
not a reference kept at import), so the FA guard's wrapper on that attribute sees our calls.
`probe()` says which entry point is importable without importing the heavy kernels; it is
what the backend selector (engine/attention/selector.py) checks and what the CLI prints in
one line.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

# flash-attn-4 tiles the head dim in multiples of 16; its paged path needs no padding there.
FA4_HDIM_MULTIPLE = 16
INSTALL_HINT = "pip install flash-attn-4 (flash_attn.cute; Hopper, Blackwell) or pip install flash-attn (FlashAttention-2)"


@dataclass(frozen=True)
class Found:
    kind: str  # "fa4" | "fa2"
    module: str  # where flash_attn_varlen_func is looked up at call time
    package: str  # the distribution's name
    version: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.flash_attn_varlen_func"

    def line(self) -> str:
        """The one line the CLI prints."""
        how = ("paged KV through page_table" if self.kind == "fa4"
               else "paged KV through block_table (block size % 256), else keys gathered first")
        return f"attention backend flash_attn: {self.package} {self.version} ({self.qualname}, {how})"


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(version unknown)"


@functools.lru_cache(maxsize=None)
def probe() -> Found | None:
    """Which flash-attn entry point is installed, without importing its kernels (flash-attn-4
    also needs the CuTe DSL, `cutlass`, from nvidia-cutlass-dsl); None: neither."""
    if _spec("flash_attn.cute") is not None and _spec("cutlass") is not None:
        return Found("fa4", "flash_attn.cute", "flash-attn-4", _version("flash-attn-4"))
    if _spec("flash_attn.flash_attn_interface") is not None:
        return Found("fa2", "flash_attn", "flash-attn", _version("flash-attn"))
    return None


def missing_message() -> str:
    return f"attention_backend: flash_attn needs the flash-attn package, which is not importable: {INSTALL_HINT}"


def fa4_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
               max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int, block_table: torch.Tensor,
               softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """flash-attn-4 on the paged cache: [num_blocks, block_size, Hkv, D] with page_table."""
    import flash_attn.cute as fa4

    q = q.contiguous()  # the engine's q is a view of the fused q/k rotation (engine/model.py)
    B = cu_seqlens_q.shape[0] - 1
    D = q.shape[-1]
    pad = -D % FA4_HDIM_MULTIPLE
    if pad:
        # SM90 loads pages of any size other than its key tile row by row (cp.async), and that
        # path refuses a head dim its tiles would pad ("Paged KV does not support irregular head
        # dim"): the fuzz model's head_dim 8, say. Zero columns change no dot product and give
        # zero output columns, so the kernel computes the same attention on padded copies.
        q, k_cache, v_cache = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k_cache, v_cache))
    out = fa4.flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q.int(), cu_seqlens_k=None,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k[:B].int(),
        page_table=block_table[:B].int(), softmax_scale=softmax_scale, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    return out[..., :D].contiguous() if pad else out


def _gather_packed(cache: torch.Tensor, block_table: torch.Tensor, cu_k: torch.Tensor,
                   capacity: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] -> [capacity, H, D], sequence b's keys at cu_k[b]:cu_k[b+1];
    rows past cu_k[-1] read the null block (the kernel never reads them). Device ops only."""
    bs, H, D = cache.shape[1], cache.shape[2], cache.shape[3]
    B = cu_k.shape[0] - 1
    j = torch.arange(capacity, device=cache.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_k[1:].long(), j, right=True).clamp(max=B - 1)
    pos = j - cu_k[seq].long()
    col = (pos // bs).clamp(0, block_table.shape[1] - 1)
    blk = torch.where(j < cu_k[B].long(), block_table[seq, col].long(), torch.zeros_like(j))
    return cache.view(-1, H, D)[blk * bs + pos.clamp(min=0) % bs]


def fa2_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
               max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int, block_table: torch.Tensor,
               softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """FlashAttention-2's `flash_attn_varlen_func`: k lengths as cu_seqlens_k (it has no
    seqused_k); paged natively when the block size is a multiple of 256."""
    import flash_attn as fa2

    q = q.contiguous()  # see fa4_varlen
    B = cu_seqlens_q.shape[0] - 1
    cu_k = torch.nn.functional.pad(seqused_k[:B].int().cumsum(0, dtype=torch.int32), (1, 0))
    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal)
    if k_cache.shape[1] % 256 == 0:
        return fa2.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q.int(), cu_k,
                                          block_table=block_table[:B].int(), **kw)
    cap = B * max_seqlen_k
    k = _gather_packed(k_cache, block_table[:B], cu_k, cap)
    v = _gather_packed(v_cache, block_table[:B], cu_k, cap)
    return fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q.int(), cu_k, **kw)


def flash_attn_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      max_seqlen_q: int, seqused_k: torch.Tensor, max_seqlen_k: int, block_table: torch.Tensor,
                      softmax_scale: float, causal: bool = True) -> torch.Tensor:
    """The `flash_attn` backend: flash-attn-4 where importable, else FlashAttention-2."""
    found = probe()
    if found is None:
        raise RuntimeError(missing_message())
    fn = fa4_varlen if found.kind == "fa4" else fa2_varlen
    return fn(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table,
              softmax_scale, causal)
