"""Executors: build the ranks of a layout in a world and move messages to and from them.

`InProcExecutor` runs every rank as a thread of this process (the default for fuzzing);
`engine.dist_executor.DistExecutor` runs them as torch.distributed processes. Both speak
the same messages to the same `Worker.run_loop`.
"""
from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.inproc_world import InProcGroup, InProcWorld
from engine.parallel_state import make_groups
from engine.schedule import Schedule
from engine.weights import load_state_dict
from engine.worker import Channel, Worker


class _InProcChannel(Channel):
    def __init__(self, ex: "InProcExecutor", rank: int) -> None:
        self.ex, self.rank = ex, rank
        self.inbox: deque = deque()

    def get(self):
        self.ex.world.wait_for(self.rank, lambda: len(self.inbox) > 0, "next message from driver")
        return self.inbox.popleft()

    def has_message(self) -> bool:
        return len(self.inbox) > 0

    def peek_kind(self) -> str:
        return self.inbox[0][0]

    def put(self, key, value) -> None:
        self.ex.results.setdefault(key, {})[self.rank] = value

    def run_ahead(self) -> bool:
        return self.ex.world.sched.run_ahead()


class ExecutorMessages:
    """The driver's side of the worker protocol, shared by both worlds: a world supplies
    `_broadcast(msg)` (to every rank) and `_wait(key, what)` (every rank's result)."""

    def submit(self, so) -> None:
        self._broadcast(("step", so))

    def collect(self, microbatch: int) -> dict[int, object]:
        return self._wait(("step", microbatch), f"microbatch {microbatch}")

    def fa_records(self) -> list:
        self._broadcast(("records",))
        per_rank = self._wait(("records",), "FA records")
        return [r for rank in sorted(per_rank) for r in per_rank[rank]]


class InProcExecutor(ExecutorMessages):
    def __init__(self, cfg: EngineConfig, record_fa: bool = False) -> None:
        self.cfg = cfg
        if cfg.device == "cpu":
            # Rank threads share the process: OpenMP pools per calling thread oversubscribe a
            # small machine and spin at barriers (measured: a 32 ms graph replay took 2.9 s
            # with 2 intra-op threads beside other busy processes). Tiny models gain nothing
            # from intra-op parallelism.
            import torch

            torch.set_num_threads(1)
        self.world = InProcWorld(cfg.world_size, cfg.step_timeout_s)
        self.results: dict[tuple, dict[int, object]] = {}
        self.channels = [_InProcChannel(self, r) for r in range(cfg.world_size)]
        sd = load_state_dict(cfg)
        self.workers: list[Worker | None] = [None] * cfg.world_size

        def factory(ranks, rank, name):
            return InProcGroup(self.world, ranks, rank, name)

        for rank in range(cfg.world_size):
            def main(rank=rank) -> None:
                # Weights are sharded on the rank's own thread, as each process would.
                w = Worker(cfg, make_groups(cfg, rank, factory), sd, record_fa)
                self.workers[rank] = w
                self.world.copiers[rank] = w.copier
                # GPU copies land when the hardware says; the Schedule only delays them.
                w.copier.should_delay = lambda: not self.world.sched.land_now()
                self.channels[rank].put(("ready",), True)
                w.run_loop(self.channels[rank])
            self.world.start(rank, main)
        self._wait(("ready",), "start-up")

    def _wait(self, key: tuple, what: str) -> dict[int, object]:
        n = self.cfg.world_size
        self.world.run_until(lambda: len(self.results.get(key, ())) == n, what)
        return self.results.pop(key)

    def _broadcast(self, msg: tuple) -> None:
        for ch in self.channels:
            ch.inbox.append(msg)

    def reset(self, schedule: Schedule, faults: tuple[str, ...], poison: str = "nan") -> None:
        self.world.set_schedule(schedule)
        self._broadcast(("reset", tuple(faults), schedule.copy_delay == 0.0, poison))
        self._wait(("reset",), "reset")
        # A Case that ended early (a violation, an abort of the run) may have left microbatches
        # in flight: the ranks finished them before the reset, and their results must not be
        # collected as the next Case's (its microbatch ids start again at 0).
        self.results.clear()

    def shutdown(self) -> None:
        # Graceful stop only when every rank is parked; a rank caught mid-step (Ctrl-C while
        # the driver waited on it) is released and unwinds at its next wait instead.
        parked = all(r.state in ("blocked", "done", "new", "ready") for r in self.world.ranks)
        if self.world.broken is None and parked:
            self._broadcast(("stop",))
            # Parked ranks stop in milliseconds; after an interrupt the world may be mid-step,
            # and a full step timeout per engine would hold the exit for minutes.
            self.world.timeout_s = min(self.world.timeout_s, 5.0)
            try:
                self.world.run_until(lambda: all(r.state == "done" for r in self.world.ranks), "stop")
            except Exception:
                pass  # a rank failing on the way out is already reported by the step that broke it
        self.world.shutdown()
