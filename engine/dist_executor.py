"""torch.distributed world: every rank of a layout as a real process (gloo on CPU, NCCL on GPU).

The ranks run the same `Worker.run_loop` as the in-process world; only the four
GroupCoordinator primitives and the driver channel differ. Spawning is expensive (about 9 s
for 8 gloo ranks on 2 cores), so workers live across Cases: `reset` ships the next Case's
schedule and faults as data. Liveness is the driver's job: it waits on every worker's pipe
and process sentinel at once, so a rank that raises, dies or stalls becomes a `RankFailure`
naming it within the step bound, and every process is killed after any failure (the next
`reset` spawns a fresh set). Results travel as plain pickles over one pipe per rank: a
SIGKILLed worker can break only its own pipe, never a lock the other ranks need.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.executor import make_groups
from engine.inproc_world import RankFailure
from engine.parallel_state import GroupCoordinator, pp_group_ranks, tp_group_ranks
from engine.schedule import Schedule, ScheduleDriver
from engine.worker import Channel

_STARTUP_TIMEOUT_S = 120.0  # spawning imports torch in every rank; 8 ranks on 2 cores take ~10 s
_STOP_TIMEOUT_S = 5.0
# Workers fork from a server that imported torch and the engine once, instead of each
# importing them afresh as under "spawn": measured on 2 busy cores, 4 workers started in
# 2.3 s the first time and 0.13 s after (spawn: 10-14 s every time). Nothing in the server
# has started a thread or touched CUDA, so forking it is safe.
_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


# -- the four primitives over torch.distributed --------------------------------------------------
class _TensorSlot:
    """Stands in for a tensor in a pickled payload; the tensor itself travels as a tensor."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype

    def __getstate__(self):
        return self.index, self.shape, self.dtype

    def __setstate__(self, s) -> None:
        self.index, self.shape, self.dtype = s


def _split(obj, tensors: list[torch.Tensor]):
    """obj with every tensor (inside dicts, lists, tuples) replaced by a _TensorSlot."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.contiguous())
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_split(v, tensors) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _slots(skel, found: list[_TensorSlot]) -> list[_TensorSlot]:
    if isinstance(skel, _TensorSlot):
        found.append(skel)
    elif isinstance(skel, dict):
        for v in skel.values():
            _slots(v, found)
    elif isinstance(skel, (list, tuple)):
        for v in skel:
            _slots(v, found)
    return found


def _join(skel, tensors: list[torch.Tensor]):
    if isinstance(skel, _TensorSlot):
        return tensors[skel.index]
    if isinstance(skel, dict):
        return {k: _join(v, tensors) for k, v in skel.items()}
    if isinstance(skel, (list, tuple)):
        out = [_join(v, tensors) for v in skel]
        return out if isinstance(skel, list) else tuple(out)
    return skel


class DistGroup(GroupCoordinator):
    """A GroupCoordinator over one torch.distributed process group.

    Objects travel as a small pickled skeleton (send/broadcast_object_list) followed by their
    tensors as tensors, so on NCCL the tensors stay on the device. The reduction itself is the
    base class's rank-ordered sum over `_gather_list`, which keeps every result bitwise equal
    to the in-process world's.
    """

    def __init__(self, pg, ranks: list[int], rank: int, name: str, device: torch.device) -> None:
        super().__init__(ranks, rank, name)
        self.pg, self.device = pg, device

    def _gather_list(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self.pg)
        return out

    def _send_obj(self, obj, dst_in_group: int) -> None:
        dst = self.ranks[dst_in_group]
        tensors: list[torch.Tensor] = []
        skel = _split(obj, tensors)
        dist.send_object_list([skel], dst=dst, group=self.pg, device=self.device)
        for t in tensors:
            dist.send(t, dst=dst, group=self.pg)

    def _recv_obj(self, src_in_group: int):
        src = self.ranks[src_in_group]
        box = [None]
        dist.recv_object_list(box, src=src, group=self.pg, device=self.device)
        tensors = []
        for s in sorted(_slots(box[0], []), key=lambda s: s.index):
            t = torch.empty(s.shape, dtype=s.dtype, device=self.device)
            dist.recv(t, src=src, group=self.pg)
            tensors.append(t)
        return _join(box[0], tensors)

    def _broadcast_obj(self, obj, src_in_group: int):
        src = self.ranks[src_in_group]
        is_src = self.rank_in_group == src_in_group
        tensors: list[torch.Tensor] = []
        box = [_split(obj, tensors) if is_src else None]
        dist.broadcast_object_list(box, src=src, group=self.pg, device=self.device)
        if not is_src:
            tensors = [torch.empty(s.shape, dtype=s.dtype, device=self.device)
                       for s in sorted(_slots(box[0], []), key=lambda s: s.index)]
        for t in tensors:
            dist.broadcast(t, src=src, group=self.pg)
        return obj if is_src else _join(box[0], tensors)


def new_process_groups(cfg: EngineConfig) -> dict[tuple, object]:
    """Every tp, pp and world group of the layout, keyed (name, ranks). Every process must
    create every group, in the same order, even those it is not a member of."""
    pgs: dict[tuple, object] = {}
    specs = [("tp", tp_group_ranks(p, cfg.tp)) for p in range(cfg.pp)]
    specs += [("pp", pp_group_ranks(t, cfg.tp, cfg.pp)) for t in range(cfg.tp)]
    specs.append(("world", list(range(cfg.world_size))))
    for name, ranks in specs:
        if len(ranks) > 1:
            pgs[(name, tuple(ranks))] = dist.new_group(ranks)
    return pgs


# -- worker process --------------------------------------------------------------------------
def _send(conn, msg) -> None:
    # Plain pickle, not the Connection's ForkingPickler: torch registers reductions there that
    # would move every tensor into shared memory and hand over file descriptors.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


class _PipeChannel(Channel):
    """A worker's end of its pipe to the driver. The driver's reset message carries the
    Case's Schedule as a fourth element; it is applied here and stripped, so the Worker sees
    the same ("reset", faults, land_immediately) as in the in-process world."""

    def __init__(self, conn, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self.inbox: deque = deque()
        self.sched = ScheduleDriver(Schedule())
        self.copier = None  # the worker's AsyncCopier, landed at this rank's decision points

    def _pull(self, block: bool) -> None:
        while (block and not self.inbox) or self.conn.poll():
            self.inbox.append(_recv(self.conn))

    def _land_copies(self) -> None:
        # The in-process world lands delayed copies at its decision points; a process has only
        # these, the moments it talks to its driver.
        c = self.copier
        if c is not None and not c.land_immediately:
            while c.stream and self.sched.land_now() and c.land_head():
                pass

    def get(self):
        self._land_copies()
        self._pull(block=True)
        msg = self.inbox.popleft()
        if msg[0] == "reset":
            _, faults, land_immediately, schedule = msg
            # Per-rank stream of decisions: each process draws its own, reproducibly per seed.
            self.sched = ScheduleDriver(Schedule(**{**schedule.to_dict(),
                                                    "seed": schedule.seed * 1000 + self.rank}))
            msg = ("reset", faults, land_immediately)
        return msg

    def has_message(self) -> bool:
        self._land_copies()
        self._pull(block=False)
        return len(self.inbox) > 0

    def peek_kind(self) -> str:
        return self.inbox[0][0]

    def put(self, key, value) -> None:
        _send(self.conn, (key, self.rank, value))

    def run_ahead(self) -> bool:
        return self.sched.run_ahead()


def _watch_driver(lifeline) -> None:
    """Exit when the driver dies without stopping us (SIGKILL, a crash): no orphans, even
    while this rank is stuck in a collective and never reads its pipe again. The driver
    holds the only write end of `lifeline` and never writes, so it turns readable (EOF)
    exactly when the driver is gone. (Under forkserver our parent is the fork server, so
    the parent pid says nothing about the driver.)"""
    def loop() -> None:
        mp_wait([lifeline])
        os._exit(3)
    threading.Thread(target=loop, name="driver-watch", daemon=True).start()


def _device_for(cfg: EngineConfig, rank: int) -> EngineConfig:
    """On CUDA each process owns one device (NCCL refuses two ranks on one GPU)."""
    if cfg.device == "cpu":
        return cfg
    n = torch.cuda.device_count()
    idx = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
    dev = (idx + rank) % n
    torch.cuda.set_device(dev)
    return cfg.replace(device=f"cuda:{dev}")


def init_rank(cfg: EngineConfig, rank: int, record_fa: bool = False, num_threads: int = 1,
              store=None, init_method: str | None = None):
    """Join the process group and build this rank's Worker (shared with dist_worker_main).

    `num_threads` must equal the in-process world's intra-op thread count for bitwise
    equality with it: CPU GEMMs round differently with 1 and 2 threads (measured: a
    [7,64]x[64,128] mm differs by 6e-7)."""
    from engine.weights import load_state_dict
    from engine.worker import Worker

    # The first custom-op call imports torch._dynamo (measured 4 s on 2 cores): pay it before
    # reporting ready, not inside the first step's time bound.
    import torch._dynamo  # noqa: F401

    torch.set_num_threads(num_threads)
    cfg = _device_for(cfg, rank)
    backend = "gloo" if cfg.device == "cpu" else "nccl"
    timeout = timedelta(seconds=max(_STARTUP_TIMEOUT_S, 2 * cfg.step_timeout_s))
    dist.init_process_group(backend, store=store, init_method=init_method, rank=rank,
                            world_size=cfg.world_size, timeout=timeout)
    pgs = new_process_groups(cfg)
    device = torch.device(cfg.device)

    def factory(ranks, r, name):
        return DistGroup(pgs[(name, tuple(ranks))], ranks, r, name, device)

    return cfg, Worker(cfg, make_groups(cfg, rank, factory), load_state_dict(cfg), record_fa)


def _worker_main(rank: int, cfg_dict: dict, store_port: int, prefix: str, conn,
                 record_fa: bool, num_threads: int, lifeline) -> None:
    _watch_driver(lifeline)
    chan = _PipeChannel(conn, rank)
    try:
        cfg = EngineConfig.from_dict(cfg_dict)
        store = dist.PrefixStore(prefix, dist.TCPStore(
            "127.0.0.1", store_port, is_master=False,
            timeout=timedelta(seconds=_STARTUP_TIMEOUT_S)))
        cfg, worker = init_rank(cfg, rank, record_fa, num_threads, store=store)
        chan.copier = worker.copier
        chan.put(("ready",), True)
        worker.run_loop(chan)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the driver went away: nobody to report to
    except BaseException:
        try:
            _send(conn, ("error", rank, traceback.format_exc()))
            # Stay alive until stopped or killed: exiting would break the peers' collectives
            # and bury this root cause under their connection errors.
            while _recv(conn)[0] != "stop":
                pass
        except BaseException:
            pass
        os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown (gloo threads); the driver joins us


# -- driver side ----------------------------------------------------------------------------------
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


class DistExecutor:
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
        ctx = mp.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            # Takes effect when the fork server starts (first DistExecutor of this process).
            ctx.set_forkserver_preload(["engine.dist_executor", "torch._dynamo"])
        if self._store is None:
            # The driver hosts the rendezvous store: its port is bound before any rank starts,
            # and it outlives worker generations (each uses its own key prefix).
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
        self.generation += 1
        self.results.clear()
        self.broken = None
        for rank in range(self.n):
            ours, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, name=f"llmfuzz-rank{rank}", daemon=True,
                            args=(rank, self.cfg.to_dict(), self._store.port,
                                  f"llmfuzz/{os.getpid()}/{self.generation}/", theirs,
                                  self.record_fa, self.num_threads, self._lifeline[0]))
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._wait(("ready",), "start-up", max(_STARTUP_TIMEOUT_S, self.cfg.step_timeout_s))
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
                    key, rank, value = _recv(self.conns[r])
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
                _send(conn, msg)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._pump(0.5)  # a dead worker: report it as a crash
                self._crash(self._dead(1.0) or [self.conns.index(conn)])

    # -- the executor API -----------------------------------------------------------------------
    def reset(self, schedule: Schedule, faults: tuple[str, ...]) -> None:
        if self._closed:
            raise RuntimeError("DistExecutor: reset after shutdown")
        if self.broken is not None or not self.procs:
            _reap(self.procs, self.conns)
            self._start()  # a failed Case cost its processes; the next one gets fresh ranks
        self._broadcast(("reset", tuple(faults), schedule.copy_delay == 0.0, schedule))
        self._wait(("reset",), "reset")

    def submit(self, so) -> None:
        self._broadcast(("step", so))

    def collect(self, microbatch: int) -> dict[int, object]:
        return self._wait(("step", microbatch), f"microbatch {microbatch}")

    def fa_records(self) -> list:
        self._broadcast(("records",))
        per_rank = self._wait(("records",), "FA records")
        return [r for rank in sorted(per_rank) for r in per_rank[rank]]

    def shutdown(self) -> None:
        """Stop the workers, join them within a bound, kill stragglers. Idempotent."""
        self._closed = True
        if self.broken is None:
            for conn in self.conns:
                try:
                    _send(conn, ("stop",))
                except OSError:
                    pass
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        _reap(self.procs, self.conns)
        self._finalizer.detach()
        for end in self._lifeline:
            end.close()
        self._store = None
