"""Worker: one rank's loop, identical in every world.

The loop receives messages from the driver through a channel (in-process deque or a
process queue), prepares and executes microbatches, and posts one result per microbatch
per rank. When the Schedule says so, the host prepares the next microbatch before
executing the current one, as a real engine's CPU runs ahead of its GPU.
"""
from __future__ import annotations

import abc
from collections import deque

from engine.async_copy import make_copier
from engine.config import EngineConfig
from engine.faults import FaultSet
from engine.model_runner import GPUModelRunner
from engine.parallel_state import RankGroups


class Channel(abc.ABC):
    """How a rank talks to its driver; each world implements it."""

    @abc.abstractmethod
    def get(self):
        """Next message (blocks)."""

    @abc.abstractmethod
    def has_message(self) -> bool:
        """A message is waiting (never blocks)."""

    @abc.abstractmethod
    def peek_kind(self) -> str:
        """Kind of the waiting message."""

    @abc.abstractmethod
    def put(self, key, value) -> None:
        """Post a result for the driver."""

    @abc.abstractmethod
    def run_ahead(self) -> bool:
        """The Schedule's decision: prepare the next microbatch before executing."""

    def yields(self) -> bool:
        """Whether the loop hands control back before its next `get` (a channel whose
        `get` blocks never needs to)."""
        return False


class Worker:
    def __init__(self, cfg: EngineConfig, groups: RankGroups, state_dict: dict,
                 record_fa: bool = False) -> None:
        self.cfg, self.groups = cfg, groups
        self.copier = make_copier(cfg.device)
        self.runner = GPUModelRunner(cfg, groups, state_dict, FaultSet(), self.copier, record_fa)

    def run_loop(self, chan: Channel) -> None:
        """A rank thread's or process's loop: `chan.get()` blocks for the next message."""
        for _ in self.loop(chan):  # a blocking channel never asks to yield
            pass

    def loop(self, chan: Channel):
        """The loop as a generator: it yields where the rank would hand control back to the
        driver and wait for its next message (`chan.yields()`), so a world of one rank can
        run it on the driver's own thread (engine/inline_executor.py)."""
        pending: deque = deque()  # prepared, not yet executed
        while True:
            if pending:
                ahead = (len(pending) == 1 and chan.has_message() and chan.peek_kind() == "step"
                         and chan.run_ahead())
                if not ahead:
                    pb = pending.popleft()
                    chan.put(("step", pb.microbatch), self.runner.execute(pb))
                    continue
            if chan.yields():
                yield
            msg = chan.get()
            kind = msg[0]
            if kind == "step":
                pending.append(self.runner.prepare(msg[1]))
            elif kind == "reset":
                _, faults, land_immediately, poison = msg
                self.runner.faults = FaultSet(faults)
                self.copier.land_immediately = land_immediately
                self.runner.reset(poison)
                chan.put(("reset",), True)
            elif kind == "records":
                # Drained, not copied: an engine idle in the harness's pool would otherwise
                # keep its last Case's records (tens of MB) until its next reset.
                recs = self.runner.fa_records or []  # None: the engine does not record
                out = recs[:]
                recs.clear()
                chan.put(("records",), out)
            elif kind == "stop":
                return
            else:
                raise ValueError(f"worker: unknown message {kind!r}")
