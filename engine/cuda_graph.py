"""Graph mode: CUDAGraphMode, BatchDescriptor, the dispatcher, capture and replay.

A captured graph freezes every Python scalar and every buffer address; replay reads
whatever the static buffers hold. GPU: a real `torch.cuda.CUDAGraph` per captured size.
CPU: the forward traced by make_fx into an FX graph, replayed on the same static buffers
(engine/cpu_graph.py): the scalars it read at capture are constants of the graph, so a
replay reads live buffers with stale scalars, as a CUDA graph does, and a host read of a
device value (which a graph would freeze or refuse) fails at capture.

Baked at capture (from `AttentionMetadataBuilder.build_for_cudagraph_capture`):
`max_seqlen_q` (= the padded token count, an upper bound of every query length the size
can hold), `max_seqlen_k` (= max_model_len), the padded batch shape (tokens, requests),
every other Python value the forward reads (attention scale, faults) and every buffer
address. Read from the static buffers at replay: input_ids, positions, query_start_loc,
seq_lens, block table, slot_mapping, PP intermediate tensors, KV cache.
"""
from __future__ import annotations

import enum
import time
from typing import Callable

import torch

from engine.cpu_graph import CAPTURE_LOCK
from engine.outputs import BatchDescriptor


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    FULL = "FULL"


class CudagraphDispatcher:
    """Pads a batch up to the smallest captured size that holds it; None = run eager."""

    def __init__(self, capture_sizes: tuple[int, ...], max_num_reqs: int, multiple_of: int = 1) -> None:
        self.sizes = sorted(s for s in capture_sizes if s % multiple_of == 0)
        self.max_num_reqs = max_num_reqs

    def dispatch(self, num_tokens: int, num_reqs: int) -> BatchDescriptor | None:
        for s in self.sizes:
            if s >= num_tokens:
                return BatchDescriptor(s, self.max_num_reqs)
        return None


class GraphStore:
    """Captured graphs of one rank, keyed by BatchDescriptor."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.graphs: dict[BatchDescriptor, Callable] = {}
        self.capture_seconds = 0.0
        self.pool = None

    def clear(self) -> None:
        if self.graphs and self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.graphs.clear()
        # Graphs captured later get a fresh private pool: capturing into the pool of
        # destroyed graphs trips the caching allocator (`use_count > 0` internal assert).
        self.pool = None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def get_or_capture(self, desc: BatchDescriptor, fn: Callable, static_args: list,
                       capture_cpu: Callable[[], Callable]) -> Callable:
        """The graph of `desc`, captured on first use: on a GPU `fn` on `static_args`, on the
        CPU what `capture_cpu` makes (engine/cpu_graph.py)."""
        g = self.graphs.get(desc)
        if g is None:
            t0 = time.perf_counter()
            g = self._capture_gpu(fn, static_args) if self.device.startswith("cuda") else capture_cpu()
            self.capture_seconds += time.perf_counter() - t0
            self.graphs[desc] = g
        return g

    def _capture_gpu(self, fn: Callable, static_args: list) -> Callable:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_args)  # warm-up outside the graph (allocator, lazy init)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with CAPTURE_LOCK:
            # cuBLAS keeps a workspace per (handle, stream) in a process-wide cache. One first
            # made during a capture lives in the graph's pool, and the cache then pins that
            # pool for good: every engine's graphs would leak their pools (~64 MiB a rank,
            # measured on an H200). Emptied before, the capture makes its own workspace in its pool;
            # emptied after, the cache holds none of it, so the pool goes with the graphs. Only
            # a later capture into this store's pool can reuse the freed workspace (the model's
            # tensors are small-pool blocks, the workspace a large one: in practice the next
            # capture's workspace), and one store's graphs replay one at a time on its rank's
            # stream, so sharing that scratch is safe.
            _clear_cublas_workspaces()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = fn(*static_args)
            _clear_cublas_workspaces()

        def replay(*args):
            graph.replay()  # reads the same static buffers; args are those buffers
            return out
        return replay


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces (torch's, as its CUDA graph trees do around a capture);
    eager calls make new ones as needed. A no-op on builds without CUDA."""
    torch.cuda.synchronize()  # the cached workspaces may still be in use by queued kernels
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
