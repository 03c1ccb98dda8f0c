"""InlineExecutor: a world of one rank, run on the driver's own thread.

A rank alone never waits for another rank: its only wait is for the driver's next message.
So its loop (`Worker.loop`, a generator) runs on the driver's thread up to that wait and
yields back, where `InProcExecutor` would hand a baton to a rank thread and back twice per
step. Every world-of-one run goes this way: the tp1pp1 cells, and the reference run of every
Case. The decisions are the ones `InProcWorld` makes, at the same points: pending copies land
as the Schedule says before the rank is resumed, and under a non-natural rank order the rank
hands control back before every message, as its thread would.

A rank that raises becomes a `RankFailure`, as in the threaded world. A rank that never
yields (an endless loop in engine code) cannot be taken back from its own thread, so the
driver arms a SIGALRM timer of the step timeout around each resume; off the main thread,
where that signal cannot be delivered, `LLMEngine` uses the threaded world instead.
"""
from __future__ import annotations

import signal
import threading
from collections import deque

from engine.config import EngineConfig
from engine.executor import ExecutorMessages
from engine.inproc_world import land_scheduled_copies
from engine.outputs import RankFailure
from engine.parallel_state import make_groups
from engine.schedule import Schedule, ScheduleDriver
from engine.weights import load_state_dict
from engine.worker import Channel, Worker


def inline_possible() -> bool:
    """The watchdog needs SIGALRM, which only the main thread receives."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


class _Timeout(BaseException):
    pass


class _InlineChannel(Channel):
    def __init__(self, ex: "InlineExecutor") -> None:
        self.ex = ex
        self.inbox: deque = deque()

    def get(self):
        return self.inbox.popleft()  # the driver resumes the loop only with a message waiting

    def has_message(self) -> bool:
        return len(self.inbox) > 0

    def peek_kind(self) -> str:
        return self.inbox[0][0]

    def put(self, key, value) -> None:
        self.ex.results.setdefault(key, {})[0] = value

    def run_ahead(self) -> bool:
        return self.ex.sched.run_ahead()

    def yields(self) -> bool:
        # InProcWorld.wait_for: a rank goes on without yielding only when its message is
        # there and the order is natural.
        return not self.inbox or self.ex.sched.s.rank_order != "natural"


class InlineExecutor(ExecutorMessages):
    def __init__(self, cfg: EngineConfig, record_fa: bool = False) -> None:
        if cfg.world_size != 1:
            raise ValueError(f"InlineExecutor runs a world of one rank, not {cfg.world_size}")
        self.cfg = cfg
        if cfg.device == "cpu":
            import torch

            torch.set_num_threads(1)  # as InProcExecutor: verdicts identical across machines
        self.sched = ScheduleDriver(Schedule())
        self.results: dict[tuple, dict[int, object]] = {}
        self.broken: RankFailure | None = None
        self.chan = _InlineChannel(self)
        self.worker = Worker(cfg, make_groups(cfg, 0, None), load_state_dict(cfg), record_fa)
        self.workers = [self.worker]  # InProcExecutor's view of its ranks
        self.copier = self.worker.copier
        # GPU copies land when the hardware says; the Schedule only delays them.
        self.copier.should_delay = lambda: not self.sched.land_now()
        self._start()

    def _start(self) -> None:
        """(Re)start the rank's loop and run it up to the wait for its first message."""
        self.chan.inbox.clear()
        self.results.clear()
        self.gen, self.ended = self.worker.loop(self.chan), False
        self._resume("start-up")

    def _resume(self, what: str) -> None:
        """Run the rank up to its next wait, under the step timeout."""
        def expired(signum, frame):
            raise _Timeout()
        # An engine built on the main thread and driven from another has no watchdog there.
        armed = threading.current_thread() is threading.main_thread()
        if armed:
            old = signal.signal(signal.SIGALRM, expired)
            signal.setitimer(signal.ITIMER_REAL, self.cfg.step_timeout_s)
        try:
            next(self.gen)
        except StopIteration:
            self.ended = True
        except _Timeout:
            self._fail(RankFailure("timeout", [0], f"no progress for {self.cfg.step_timeout_s:.0f}s while {what}"))
        except Exception as e:
            self._fail(RankFailure("exception", [0], f"{type(e).__name__}: {e}"), e)
        except BaseException:
            # An interrupt (Ctrl-C, a campaign's stop) landed inside the rank's step: its loop
            # is gone mid-step. The next reset starts a fresh one (a reset poisons every buffer).
            self.ended = True
            raise
        finally:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)

    def _fail(self, err: RankFailure, cause: BaseException | None = None) -> None:
        self.broken = err
        raise err from cause

    def _wait(self, key: tuple, what: str) -> dict[int, object]:
        if self.broken is not None:
            raise self.broken
        while key not in self.results:
            # InProcWorld.run_until's decision point: copies land as the Schedule says, then
            # the rank runs if it can.
            land_scheduled_copies([self.copier], self.sched)
            if self.ended:
                self._fail(RankFailure("exception", [0], f"the rank's loop ended while {what}"))
            if not self.chan.inbox:
                self._fail(RankFailure("deadlock", [0], f"waiting for {what}; rank 0: next message from driver"))
            self._resume(what)
        return self.results.pop(key)

    def _broadcast(self, msg: tuple) -> None:
        self.chan.inbox.append(msg)

    def reset(self, schedule: Schedule, faults: tuple[str, ...], poison: str = "nan") -> None:
        if self.ended and self.broken is None:  # interrupted mid-step, never failed
            self._start()
        self.sched = ScheduleDriver(schedule)
        self._broadcast(("reset", tuple(faults), schedule.copy_delay == 0.0, poison))
        self._wait(("reset",), "reset")
        # A Case that ended early (a violation, an abort of the run) may have left microbatches
        # in flight: the ranks finished them before the reset, and their results must not be
        # collected as the next Case's (its microbatch ids start again at 0).
        self.results.clear()

    def shutdown(self) -> None:
        self.gen.close()
