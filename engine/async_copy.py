"""AsyncCopier: the only way engine code makes `non_blocking` copies.

A rank's copies and compute launches form one ordered stream, as on a GPU stream. On CPU
nothing runs asynchronously, so the copier models the stream: each copy stays pending until
the Schedule lands it, a host `wait` forces it, or the compute launched after it starts
(stream order). A copy issued by running compute (a received PP tensor into its persistent
buffer, on a side stream on a GPU) lands at once unless the Schedule delays it, as a small
copy usually beats the next kernel: then it lands at a wait or when that compute ends. A pending copy reads its source when it lands, as DMA from pinned memory
does, so a host write to the source before the copy landed is visible, deterministically,
in the result. On CUDA the same API issues real `non_blocking` copies on a side stream with
events, and the Schedule's delays become `torch.cuda._sleep` before each copy
(`CudaAsyncCopier`): there the hardware decides when a copy lands, and the Schedule only
widens the window.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(slots=True)
class CopyHandle:
    seq: int
    dst: torch.Tensor
    src: torch.Tensor
    landed: bool = False
    event: object = None  # torch.cuda.Event on GPU


@dataclass(slots=True)
class _Launch:
    microbatch: int


class AsyncCopier:
    """Per-rank model of one device stream of copies and compute launches (CPU)."""

    def __init__(self, land_immediately: bool = True) -> None:
        self.land_immediately = land_immediately
        self.stream: deque[CopyHandle | _Launch] = deque()
        self._seq = 0
        self.computing: int | None = None  # microbatch whose compute is running now
        self.in_compute: list[CopyHandle] = []  # copies issued by the running compute
        self.should_delay: Callable[[], bool] | None = None  # the Schedule's per-copy decision

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        h = CopyHandle(self._seq, dst, src)
        self._seq += 1
        if self.computing is not None:
            # Issued by the running compute: lands now, or -- delayed by the Schedule -- at a
            # wait or at the compute's end. Reading its destination before a wait is then
            # the race of docs/bug_classes.md#intermediate_copy_unsynced.
            self.in_compute.append(h)
            if not (not self.land_immediately and self.should_delay is not None and self.should_delay()):
                self._land(h)
            return h
        self.stream.append(h)
        if self.land_immediately and len(self.stream) == 1:
            self._land(self.stream.popleft())
        return h

    def launch(self, microbatch: int) -> None:
        """Host launched microbatch's compute: later copies must not overtake it."""
        self.stream.append(_Launch(microbatch))

    def start_compute(self, microbatch: int) -> None:
        """The launched compute starts: everything queued before its launch has landed.
        Copies queued after it stay pending until `end_compute` (stream order)."""
        while self.stream:
            item = self.stream[0]
            self.stream.popleft()
            if isinstance(item, _Launch) and item.microbatch == microbatch:
                break
            if isinstance(item, CopyHandle):
                self._land(item)
        self.computing = microbatch

    def end_compute(self, microbatch: int) -> None:
        for h in self.in_compute:
            if not h.landed:
                self._land(h)
        self.in_compute.clear()
        self.computing = None
        self._land_ready_copies()

    def wait(self, h: CopyHandle) -> None:
        """Host waits on the copy's event: the stream drains up to and including it."""
        if h in self.in_compute:
            for c in self.in_compute[:self.in_compute.index(h) + 1]:
                if not c.landed:
                    self._land(c)
            return
        while not h.landed and self.stream:
            item = self.stream[0]
            if isinstance(item, _Launch):
                # The copy sits behind compute that has not run yet; on a GPU the host would
                # block until it does. Here the launch is the rank's own pending work, so the
                # wait cannot be satisfied early: report it instead of deadlocking silently.
                raise RuntimeError(f"wait on copy {h.seq} queued behind microbatch {item.microbatch}")
            self.stream.popleft()
            self._land(item)

    def land_head(self) -> bool:
        """Schedule-driven progress: land the copy at the head of the stream, if any.
        Nothing queued behind a running compute may overtake it."""
        if self.computing is None and self.stream and isinstance(self.stream[0], CopyHandle):
            self._land(self.stream.popleft())
            return True
        return False

    def synchronize(self) -> None:
        for h in self.in_compute:
            if not h.landed:
                self._land(h)
        while self.stream:
            item = self.stream.popleft()
            if isinstance(item, CopyHandle):
                self._land(item)

    def _land_ready_copies(self) -> None:
        if self.land_immediately:
            while self.stream and isinstance(self.stream[0], CopyHandle):
                self._land(self.stream.popleft())

    @staticmethod
    def _land(h: CopyHandle) -> None:
        h.dst.copy_(h.src)
        h.landed = True


# About 1 ms on an H200 (1.98 GHz): longer than the host needs to prepare the next
# microbatch, so a copy delayed by the Schedule is still pending when the host writes its
# source again. One delay holds every later copy of the stream too (stream order).
GPU_COPY_DELAY_CYCLES = 2_000_000


class CudaAsyncCopier(AsyncCopier):
    """Real `non_blocking` copies on CUDA, with the same API as the CPU model.

    Host-to-device staging copies go on the rank's compute stream, as vLLM issues them: they
    are ordered with compute, and the DMA reads the pinned source when the stream reaches
    it, so a host write before then is the real race of
    docs/bug_classes.md#pp_shared_staging_buffer. A host that prepares
    the next microbatch before the current one's kernels are enqueued (`launch` without
    `start_compute` yet) must not let its copies overtake them, as in the CPU model: such
    copies are issued when that compute has been enqueued (`end_compute`). Copies issued inside
    compute (received PP tensors into the persistent buffer) go on a side stream, as a copy
    overlapping compute does; `wait` orders the compute stream after them (no host sync),
    and skipping it is the real race of docs/bug_classes.md#intermediate_copy_unsynced.
    `should_delay` is the
    Schedule's decision, per copy, to put a `torch.cuda._sleep` in front of it.
    """

    def __init__(self, device: str, land_immediately: bool = True) -> None:
        super().__init__(land_immediately)
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)
        self.delay_cycles = GPU_COPY_DELAY_CYCLES
        self.num_delays = 0
        self._unstarted: list[int] = []  # launched microbatches whose kernels are not enqueued
        self._deferred: list[tuple[int, CopyHandle]] = []  # (microbatch it waits behind, copy)

    def _maybe_sleep(self) -> None:
        if not self.land_immediately and self.should_delay is not None and self.should_delay():
            torch.cuda._sleep(self.delay_cycles)
            self.num_delays += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        h = CopyHandle(self._seq, dst, src, event=torch.cuda.Event())
        self._seq += 1
        if self.computing is not None and src.is_cuda:
            compute = torch.cuda.current_stream(self.device)
            self.side.wait_stream(compute)  # the source is produced by compute so far
            with torch.cuda.stream(self.side):
                self._maybe_sleep()
                dst.copy_(src, non_blocking=True)
                h.event.record(self.side)
            src.record_stream(self.side)  # the allocator must not reuse it while pending
            self.in_compute.append(h)
        elif self._unstarted:
            self._deferred.append((self._unstarted[-1], h))
        else:
            self._issue(h)
        return h

    def _issue(self, h: CopyHandle) -> None:
        self._maybe_sleep()
        h.dst.copy_(h.src, non_blocking=True)
        h.event.record()

    def launch(self, microbatch: int) -> None:
        # Copies issued before now are ahead of this compute on the stream already.
        self._unstarted.append(microbatch)

    def start_compute(self, microbatch: int) -> None:
        if microbatch in self._unstarted:
            self._unstarted.remove(microbatch)
        self.computing = microbatch

    def end_compute(self, microbatch: int) -> None:
        compute = torch.cuda.current_stream(self.device)
        for h in self.in_compute:  # nothing issued by a compute outlives it
            compute.wait_event(h.event)
        self.in_compute.clear()
        self.computing = None
        # This compute is enqueued: the copies held behind it may go, in order.
        while self._deferred and self._deferred[0][0] not in self._unstarted:
            self._issue(self._deferred.pop(0)[1])

    def wait(self, h: CopyHandle) -> None:
        for mb, d in self._deferred:
            if d is h:
                raise RuntimeError(f"wait on copy {h.seq} queued behind microbatch {mb}")
        if h in self.in_compute:
            torch.cuda.current_stream(self.device).wait_event(h.event)
        else:
            h.event.synchronize()
        h.landed = True

    def land_head(self) -> bool:
        return False  # the hardware lands copies; nothing is held back on the host

    def synchronize(self) -> None:
        for _, h in self._deferred:  # nothing is left behind a compute that will never run
            self._issue(h)
        self._deferred.clear()
        self._unstarted.clear()
        self.side.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
        self.in_compute.clear()


def make_copier(device: str) -> AsyncCopier:
    return CudaAsyncCopier(device) if device.startswith("cuda") else AsyncCopier()
