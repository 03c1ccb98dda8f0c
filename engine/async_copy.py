"""AsyncCopier: the only way engine code makes `non_blocking` copies.

A rank's copies and compute launches form one ordered stream, as on a GPU stream. On CPU
nothing runs asynchronously, so the copier models the stream: each copy stays pending until
the Schedule lands it, a host `wait` forces it, or the compute launched after it starts
(stream order). A pending copy reads its source when it lands, as DMA from pinned memory
does, so a host write to the source before the copy landed is visible, deterministically,
in the result. On CUDA the same API issues real `non_blocking` copies on a side stream with
events, and the Schedule's delays become `torch.cuda._sleep` before each copy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

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
        self.num_copies = 0
        self.num_late_landings = 0  # copies that landed after later host work (races possible)
        self.computing: int | None = None  # microbatch whose compute is running now
        self.in_compute: list[CopyHandle] = []  # copies issued by the running compute

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        h = CopyHandle(self._seq, dst, src)
        self._seq += 1
        self.num_copies += 1
        if self.computing is not None:
            # Issued by the running compute: ordered inside it, lands at a wait or at its end.
            self.in_compute.append(h)
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
            self.num_late_landings += 1
            return True
        return False

    def pending(self) -> int:
        return sum(isinstance(i, CopyHandle) for i in self.stream)

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
