"""DistExecutor: the driver of the torch.distributed world (one process per rank).

Ranks run `engine.dist_worker_main.worker_main`: the same `Worker.run_loop` as the
in-process world over gloo (CPU) or NCCL (GPU) groups. Starting ranks is expensive, so they
live across Cases and `reset` ships each Case's schedule and faults as data. Liveness is the
driver's job: it waits on every rank's pipe and process sentinel at once, so a rank that
raises, dies or stalls becomes a `RankFailure` naming it within the step bound; after any
failure every rank is killed and the next `reset` starts a fresh set. Each rank has its own
pipe: a SIGKILLed rank can break only that pipe, never a queue lock the others need.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.executor import ExecutorMessages
from engine.dist_worker_main import STARTUP_TIMEOUT_S, recv_msg, send_msg, worker_main
from engine.outputs import RankFailure
from engine.schedule import Schedule

STOP_TIMEOUT_S = 5.0
# Ranks fork from a server that imported torch, torch._dynamo and the engine once, instead of
# importing them afresh as under "spawn". Measured on 2 busy cores: 4 gloo ranks ready in
# 5.6 s for the first executor of a process and 0.9-1.0 s after, 8 ranks in 1.9-2.2 s; spawn
# took 20-28 s (4 ranks) and 55-74 s (8 ranks). The server has started no thread and touched
# no CUDA, so forking it is safe; forked ranks also share the imported pages.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _reap(procs: list, conns: list) -> None:
    """Kill and join every worker (used on failure, at exit and when garbage-collected)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    for c in conns:
        c.close()
    procs.clear()
    conns.clear()


class DistExecutor(ExecutorMessages):
    """Same API as InProcExecutor: reset, submit, collect, fa_records, shutdown."""

    def __init__(self, cfg: EngineConfig, record_fa: bool = False,
                 num_threads: int | None = None) -> None:
        self.cfg, self.record_fa = cfg, record_fa
        # One intra-op thread per rank: more oversubscribes small machines (measured: tp2pp2
        # on 2 cores at 2 threads per rank runs 25x slower). CPU GEMMs round differently with
        # other thread counts, so bitwise equality with the in-process world needs a driver
        # pinned to the same count.
        self.num_threads = 1 if num_threads is None else num_threads
        if cfg.device == "cpu" and torch.get_num_threads() != self.num_threads:
            warnings.warn(f"DistExecutor: the driver computes with {torch.get_num_threads()} "
                          f"intra-op threads, ranks with {self.num_threads}; logits may differ "
                          f"from the in-process world in the last bits (torch.set_num_threads("
                          f"{self.num_threads}) in the driver makes them equal)", stacklevel=3)
        self.n = cfg.world_size
        self.procs: list = []
        self.conns: list = []
        self.results: dict[tuple, dict[int, object]] = {}
        self.broken: RankFailure | None = None
        self.generation = 0
        self.spawn_s = 0.0
        self._store = None
        # Read end for every worker; the write end stays here, unwritten, until shutdown.
        self._lifeline = mp.Pipe(duplex=False)
        self._closed = False
        # Runs at interpreter exit too: no orphan survives the driver.
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.conns)
        self._start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- processes ------------------------------------------------------------------------------
    def _start(self) -> None:
        t0 = time.perf_counter()
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            # Takes effect when the fork server starts (first DistExecutor of this process).
            ctx.set_forkserver_preload(["engine.dist_worker_main", "torch._dynamo"])
        if self._store is None:
            # The driver hosts the rendezvous store: its port is bound before any rank starts,
            # and it outlives worker generations (each uses its own key prefix).
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        self.generation += 1
        self.results.clear()
        self.broken = None
        for rank in range(self.n):
            ours, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, name=f"llmfuzz-rank{rank}", daemon=True,
                            args=(rank, self.cfg.to_dict(), self._store.port,
                                  f"llmfuzz/{os.getpid()}/{self.generation}/", theirs,
                                  self._lifeline[0], self.record_fa, self.num_threads))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._wait(("ready",), "start-up", max(STARTUP_TIMEOUT_S, self.cfg.step_timeout_s))
        self.spawn_s = time.perf_counter() - t0

    def _fail(self, err: RankFailure):
        self.broken = err
        _reap(self.procs, self.conns)
        raise err

    def _crash(self, ranks: list[int]):
        codes = []
        for r in ranks:
            self.procs[r].join(timeout=1)
            codes.append(self.procs[r].exitcode)
        detail = "; ".join(f"rank {r}: exit code {c}" for r, c in zip(ranks, codes))
        if len(ranks) == 1:
            detail = f"exit code {codes[0]}"
        self._fail(RankFailure("crash", ranks, detail))

    def _dead(self, timeout: float = 0.0) -> list[int]:
        ready = set(mp_wait([p.sentinel for p in self.procs], timeout)) if self.procs else set()
        return [r for r, p in enumerate(self.procs) if p.sentinel in ready]

    def _pump(self, timeout: float) -> None:
        """Wait up to `timeout` for any message or death; file the messages, raise on failure."""
        waitables = {c: r for r, c in enumerate(self.conns)}
        ready = mp_wait(list(waitables) + [p.sentinel for p in self.procs], timeout)
        errors: list[tuple[int, str]] = []
        for obj in ready:
            r = waitables.get(obj)
            if r is None:
                continue
            try:
                while self.conns[r].poll():
                    key, rank, value = recv_msg(self.conns[r])
                    if key == "error":
                        errors.append((rank, value))
                    else:
                        self._file(key, rank, value)
            except (EOFError, OSError):
                pass  # the process is gone; its sentinel says so below
        if errors:
            # A killed rank makes its peers' collectives fail: the death is the root cause.
            dead = self._dead(0.2)
            if dead:
                self._crash(dead)
            rank, tb = errors[0]
            last = tb.strip().splitlines()[-1] if tb.strip() else "?"
            self._fail(RankFailure("exception", [rank], f"{last}\n{tb}"))
        dead = self._dead()
        if dead:
            self._crash(dead)

    def _file(self, key, rank: int, value) -> None:
        if key == ("reset",):
            # Anything this rank sent before its reset ack belongs to the previous Case (a Case
            # abandoned with microbatches in flight); microbatch numbers restart, so drop it.
            for k in list(self.results):
                if k != key:
                    self.results[k].pop(rank, None)
                    if not self.results[k]:
                        del self.results[k]
        self.results.setdefault(key, {})[rank] = value

    def _wait(self, key: tuple, what: str, timeout: float | None = None) -> dict[int, object]:
        if self.broken is not None:
            raise self.broken
        bound = self.cfg.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + bound
        while len(self.results.get(key, ())) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(self.n) if r not in self.results.get(key, {})]
                self._fail(RankFailure("timeout", missing,
                                       f"no answer within {bound:.0f}s while waiting for {what}"))
            self._pump(min(left, 1.0))
        return self.results.pop(key)

    def _broadcast(self, msg: tuple) -> None:
        if self.broken is not None:
            raise self.broken
        for conn in self.conns:
            try:
                send_msg(conn, msg)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._pump(0.5)  # a dead worker: report it as a crash
                self._crash(self._dead(1.0) or [self.conns.index(conn)])

    # -- the executor API -----------------------------------------------------------------------
    def reset(self, schedule: Schedule, faults: tuple[str, ...], poison: str = "nan") -> None:
        if self._closed:
            raise RuntimeError("DistExecutor: reset after shutdown")
        if self.broken is not None or not self.procs:
            _reap(self.procs, self.conns)
            self._start()  # a failed Case cost its processes; the next one gets fresh ranks
        self._broadcast(("reset", tuple(faults), schedule.copy_delay == 0.0, poison, schedule))
        self._wait(("reset",), "reset")
        # A Case that ended early (a violation, an abort of the run) may have left microbatches
        # in flight: the ranks finished them before the reset, and their results must not be
        # collected as the next Case's (its microbatch ids start again at 0).
        self.results.clear()

    def shutdown(self) -> None:
        """Stop the workers, join them within a bound, kill stragglers. Idempotent."""
        self._closed = True
        if self.broken is None:
            for conn in self.conns:
                try:
                    send_msg(conn, ("stop",))
                except OSError:
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        _reap(self.procs, self.conns)
        self._finalizer.detach()
        for end in self._lifeline:
            end.close()
        self._store = None
