"""Graph mode: CUDAGraphMode, BatchDescriptor, the dispatcher, capture and replay.

A captured graph freezes every Python scalar and every buffer address; replay reads
whatever the static buffers hold. GPU: a real `torch.cuda.CUDAGraph` per captured size.
CPU: the captured function is a closure over the scalars frozen at capture (the padded
shape, max_seqlen_q/k, num_reqs), replayed on the same static buffers, so it reads live
buffers with stale scalars exactly as a CUDA graph does. That it is graph-safe (no host
read of device values, which a graph would freeze or refuse) is proven once per code path:
`make_fx` traces it in fake mode the first time a trace key (the rank's partition and
options) is captured in this process. Tracing is ~1 s per 8 layers on CPU; tracing every
(engine, rank, size) made CPU graph mode 10-50x slower than eager.

Baked at capture (from `AttentionMetadataBuilder.build_for_cudagraph_capture`):
`max_seqlen_q` (= the padded token count, an upper bound of every query length the size
can hold), `max_seqlen_k` (= max_model_len), the padded batch shape (tokens, requests)
and every buffer address. Read from the static buffers at replay: input_ids, positions,
query_start_loc, seq_lens, block table, slot_mapping, PP intermediate tensors, KV cache.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

# make_fx keeps global tracing state and is not thread-safe: one capture at a time.
CAPTURE_LOCK = threading.Lock()
TRACED: set = set()  # trace keys proven graph-safe by make_fx in this process


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    FULL = "FULL"


@dataclass(frozen=True, slots=True)
class BatchDescriptor:
    """The padded shape a graph was captured for."""

    num_tokens: int
    num_reqs: int


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
                       trace_key: object = None) -> Callable:
        g = self.graphs.get(desc)
        if g is None:
            t0 = time.perf_counter()
            g = self._capture_gpu(fn, static_args) if self.device.startswith("cuda") else \
                self._capture_cpu(fn, static_args, trace_key)
            self.capture_seconds += time.perf_counter() - t0
            self.graphs[desc] = g
        return g

    @staticmethod
    def _capture_cpu(fn: Callable, static_args: list, trace_key: object = None) -> Callable:
        from torch.fx.experimental.proxy_tensor import make_fx

        if trace_key is None or trace_key not in TRACED:
            with CAPTURE_LOCK:
                # Fake mode: collectives and KV writes do not execute while tracing; a host
                # read of a device value fails here, as it would break a CUDA graph.
                make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*static_args)
                TRACED.add(trace_key)
        return fn

    def _capture_gpu(self, fn: Callable, static_args: list) -> Callable:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static_args)  # warm-up outside the graph (allocator, lazy init)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn(*static_args)

        def replay(*args):
            graph.replay()  # reads the same static buffers; args are those buffers
            return out
        return replay
