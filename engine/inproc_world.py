"""In-process world: every rank of a layout as a thread of one process, run one at a time.

Ranks are threads that hand a baton to the driver whenever they would block (a collective,
a PP receive, an empty inbox). The driver picks the next runnable rank as the Schedule
says and lands pending async copies at those decision points, so a Case's interleaving is
a pure function of the Case: races replay exactly, and reductions happen in rank order.
A rank that raises, a step in which no rank can move (deadlock), and a rank that does not
hand the baton back within the time bound become errors naming the ranks; the harness
never hangs.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import torch

from engine.outputs import RankFailure
from engine.parallel_state import GroupCoordinator
from engine.schedule import Schedule, ScheduleDriver


def land_scheduled_copies(copiers, sched: ScheduleDriver) -> None:
    """A decision point: each rank's pending copies land, head first, while the Schedule says
    so (engine.inline_executor makes the same decisions at the same points)."""
    for c in copiers:
        if c is not None and not c.land_immediately:
            while c.stream and sched.land_now() and c.land_head():
                pass


class _Shutdown(BaseException):
    """Unwinds an abandoned rank thread."""


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.go = threading.Event()
        self.state = "new"  # new | ready | blocked | running | done | error
        self.cond: Callable[[], bool] | None = None
        self.desc = ""
        self.exc: BaseException | None = None
        self.thread: threading.Thread | None = None


class InProcWorld:
    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.ranks = [_Rank(r) for r in range(world_size)]
        self.yielded = threading.Event()
        self.stopping = False
        self.broken: RankFailure | None = None
        self._pred: Callable[[], bool] | None = None  # what the driver waits for (run_until)
        self.handoffs = 0  # baton hand-offs so far: progress, for the hang check
        self.sched = ScheduleDriver(Schedule())
        self.copiers: list = [None] * world_size  # per-rank AsyncCopier, landed at decision points
        # Shared state of the groups (touched only by the one running thread).
        self.slots: dict[tuple, dict[int, object]] = {}
        self.reads: dict[tuple, int] = {}
        self.mailboxes: dict[tuple, deque] = {}

    def set_schedule(self, schedule: Schedule) -> None:
        self.sched = ScheduleDriver(schedule)

    # -- rank side ---------------------------------------------------------------------------
    def start(self, rank: int, main: Callable[[], None]) -> None:
        r = self.ranks[rank]

        def body() -> None:
            r.go.wait()
            r.go.clear()
            try:
                if not self.stopping:
                    main()
                r.state = "done"
            except _Shutdown:
                r.state = "done"
            except BaseException as e:  # reported to the driver, never swallowed
                r.exc, r.state = e, "error"
            finally:
                self.yielded.set()

        r.state = "ready"
        r.thread = threading.Thread(target=body, name=f"rank{rank}", daemon=True)
        r.thread.start()

    def wait_for(self, rank: int, cond: Callable[[], bool], desc: str) -> None:
        """Block this rank until cond() holds. The rank makes the driver's next decision
        itself (`_decide`) and hands the baton straight to the rank it picks: one thread
        switch instead of two (rank -> driver -> rank), the same decisions in the same order."""
        if cond() and self.sched.s.rank_order == "natural":
            return
        r = self.ranks[rank]
        r.cond, r.desc, r.state = cond, desc, "blocked"
        nxt = self._decide()
        self.handoffs += 1
        if nxt is r:
            r.state = "running"
        else:
            if nxt is None:
                self.yielded.set()  # the driver's wait is over, or it must see the deadlock
            else:
                nxt.state = "running"
                nxt.go.set()
            r.go.wait()
            r.go.clear()
        if self.stopping:
            raise _Shutdown()

    def _decide(self) -> "_Rank | None":
        """One iteration of `run_until`'s loop, on whichever thread holds the baton: None when
        the driver's condition holds or no rank can move, else the rank to run next."""
        if self._pred is None or self._pred():
            return None
        self._land_copies()
        runnable = [r.rank for r in self.ranks if r.state == "ready" or (r.state == "blocked" and r.cond())]
        return self.ranks[self.sched.pick(runnable)] if runnable else None

    # -- driver side -------------------------------------------------------------------------
    def run_until(self, pred: Callable[[], bool], what: str) -> None:
        if self.broken is not None:
            raise self.broken
        self._pred = pred
        try:
            while not pred():
                r = self._decide()
                if r is None:
                    stuck = [r for r in self.ranks if r.state == "blocked"]
                    self._fail(RankFailure("deadlock", [r.rank for r in stuck], f"waiting for {what}; "
                                           + "; ".join(f"rank {r.rank}: {r.desc}" for r in stuck)))
                r.state = "running"
                self.yielded.clear()
                r.go.set()
                self._await(what)
        finally:
            self._pred = None

    def _await(self, what: str) -> None:
        """Until a rank hands the baton back to the driver. Ranks hand it to each other in
        between; only a stretch of `timeout_s` without any hand-off is a hang (of the rank
        running then)."""
        seen = self.handoffs
        while not self.yielded.wait(self.timeout_s):
            if self.handoffs == seen:
                running = [r.rank for r in self.ranks if r.state == "running"]
                self._fail(RankFailure("timeout", running, f"no progress for {self.timeout_s:.0f}s while {what}"))
            seen = self.handoffs
        failed = [r for r in self.ranks if r.state == "error"]
        if failed:
            exc = failed[0].exc
            self._fail(RankFailure("exception", [failed[0].rank], f"{type(exc).__name__}: {exc}"), exc)

    def _land_copies(self) -> None:
        land_scheduled_copies(self.copiers, self.sched)

    def _fail(self, err: RankFailure, cause: BaseException | None = None) -> None:
        self.broken = err
        self.shutdown()
        raise err from cause

    def shutdown(self) -> None:
        """Release every parked rank thread so it unwinds; the world is unusable after."""
        self.stopping = True
        for r in self.ranks:
            r.go.set()
        deadline = time.monotonic() + 2.0  # a hung rank stays behind as a daemon thread
        for r in self.ranks:
            if r.thread is not None and r.thread is not threading.current_thread():
                r.thread.join(timeout=max(0.0, deadline - time.monotonic()))


class InProcGroup(GroupCoordinator):
    """A GroupCoordinator whose members are threads of one InProcWorld."""

    def __init__(self, world: InProcWorld, ranks: list[int], rank: int, name: str) -> None:
        super().__init__(ranks, rank, name)
        self.world = world
        self.key = (name, tuple(ranks))
        self.seq = 0
        self.arrived: list[int] = list(range(self.world_size))  # of the last gather (`_arrival_order`)

    def _exchange(self, value, src: int | None) -> list:
        """Deposit `value` (all members, or only `src`), wait, return the list by group rank."""
        w, key = self.world, (self.key, self.seq)
        self.seq += 1
        slot = w.slots.setdefault(key, {})
        if src is None or src == self.rank_in_group:
            slot[self.rank_in_group] = value
        need = self.world_size if src is None else 1
        w.wait_for(self.rank, lambda: len(slot) >= need, f"{self.name} collective #{key[1]}")
        out = [slot[i] for i in sorted(slot)]
        if src is None:
            self.arrived = list(slot)  # deposit order: the order the Schedule ran the ranks in
        w.reads[key] = w.reads.get(key, 0) + 1
        if w.reads[key] == self.world_size:
            del w.slots[key], w.reads[key]
        return out

    def _gather_list(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(t.clone(), None)

    def _arrival_order(self) -> list[int]:
        return self.arrived

    def _broadcast_obj(self, obj, src_in_group: int):
        return self._exchange(obj, src_in_group)[0]

    def _box(self, src: int, dst: int) -> deque:
        return self.world.mailboxes.setdefault((self.key, src, dst), deque())

    def _send_obj(self, obj, dst_in_group: int) -> None:
        self._box(self.rank, self.ranks[dst_in_group]).append(obj)

    def _recv_obj(self, src_in_group: int):
        box = self._box(self.ranks[src_in_group], self.rank)
        self.world.wait_for(self.rank, lambda: len(box) > 0,
                            f"{self.name} recv from rank {self.ranks[src_in_group]}")
        return box.popleft()
