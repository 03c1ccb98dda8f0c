"""Rank-process side of the torch.distributed world: DistGroup, the driver pipe, rank main.

Each rank process joins one torch.distributed job (gloo on CPU, NCCL on GPU), builds its
groups and runs the same `Worker.run_loop` as an in-process rank. Only the four
GroupCoordinator primitives and the Channel differ from the in-process world; the
reductions are the base class's rank-ordered sums, so both worlds agree bitwise.
`engine.dist_executor.DistExecutor` is the driver that starts these processes.
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel_state import GroupCoordinator, make_groups, pp_group_ranks, tp_group_ranks
from engine.schedule import Schedule, ScheduleDriver
from engine.worker import Channel, Worker

STARTUP_TIMEOUT_S = 120.0  # rendezvous and first import; 8 ranks on 2 busy cores need ~10 s


# -- the four primitives ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _TensorSlot:
    """Stands in for a tensor in a pickled payload; the tensor itself travels as a tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _map_leaves(obj, is_leaf, fn):
    """obj with every leaf (`is_leaf`) inside dicts, lists and tuples replaced by fn(leaf),
    visited in one traversal order, the one both ends of a message share."""
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_leaves(v, is_leaf, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_map_leaves(v, is_leaf, fn) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _split(obj, tensors: list[torch.Tensor]):
    """obj with every tensor replaced by a _TensorSlot; the tensors are appended to `tensors`
    in traversal order."""
    def slot(t: torch.Tensor) -> _TensorSlot:
        tensors.append(t.contiguous())
        return _TensorSlot(tuple(t.shape), t.dtype)
    return _map_leaves(obj, lambda x: isinstance(x, torch.Tensor), slot)


def _join(skel, fill):
    """Inverse of _split: fill(slot) yields each tensor, called in the same traversal order."""
    return _map_leaves(skel, lambda x: isinstance(x, _TensorSlot), fill)


class DistGroup(GroupCoordinator):
    """A GroupCoordinator over one torch.distributed process group.

    Objects travel as a small pickled skeleton (send/broadcast_object_list) followed by their
    tensors as tensors, so on NCCL tensors stay on the device and never go through pickle.
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
        dist.send_object_list([_split(obj, tensors)], dst=dst, group=self.pg, device=self.device)
        for t in tensors:
            dist.send(t, dst=dst, group=self.pg)

    def _recv_obj(self, src_in_group: int):
        src = self.ranks[src_in_group]
        box = [None]
        dist.recv_object_list(box, src=src, group=self.pg, device=self.device)
        return self._fill(box[0], dist.recv, src)

    def _broadcast_obj(self, obj, src_in_group: int):
        src = self.ranks[src_in_group]
        if self.rank_in_group == src_in_group:
            tensors: list[torch.Tensor] = []
            dist.broadcast_object_list([_split(obj, tensors)], src=src, group=self.pg, device=self.device)
            for t in tensors:
                dist.broadcast(t, src=src, group=self.pg)
            return obj
        box = [None]
        dist.broadcast_object_list(box, src=src, group=self.pg, device=self.device)
        return self._fill(box[0], dist.broadcast, src)

    def _fill(self, skeleton, op, src: int):
        """The object whose tensors `skeleton` left as slots, each slot received by `op`
        (dist.recv or dist.broadcast) from global rank `src`, in the order they were sent."""
        def fill(s: _TensorSlot) -> torch.Tensor:
            t = torch.empty(s.shape, dtype=s.dtype, device=self.device)
            op(t, src=src, group=self.pg)
            return t
        return _join(skeleton, fill)


def new_process_groups(cfg: EngineConfig) -> dict[tuple, object]:
    """Every tp, pp and world group of the layout, keyed (name, ranks). Every process must
    create every group, in the same order, even those it is not a member of."""
    specs = [("tp", tp_group_ranks(p, cfg.tp)) for p in range(cfg.pp)]
    specs += [("pp", pp_group_ranks(t, cfg.tp, cfg.pp)) for t in range(cfg.tp)]
    specs.append(("world", list(range(cfg.world_size))))
    return {(name, tuple(ranks)): dist.new_group(ranks) for name, ranks in specs if len(ranks) > 1}


def _device_for(cfg: EngineConfig, rank: int) -> EngineConfig:
    """On CUDA each process owns one device (NCCL refuses two ranks on one GPU)."""
    if cfg.device == "cpu":
        return cfg
    idx = int(cfg.device.split(":")[1]) if ":" in cfg.device else 0
    dev = (idx + rank) % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    return cfg.replace(device=f"cuda:{dev}")


def init_rank(cfg: EngineConfig, rank: int, record_fa: bool = False, num_threads: int = 1,
              store=None, init_method: str | None = None) -> Worker:
    """Join the process group and build this rank's Worker.

    `num_threads` must equal the in-process world's intra-op thread count for bitwise
    equality with it: CPU GEMMs round differently with 1 and 2 threads (measured: a
    [7,64]x[64,128] mm differs by 6e-7)."""
    from engine.weights import load_state_dict

    # The first custom-op call imports torch._dynamo (measured 4 s on 2 cores): pay it before
    # reporting ready, not inside the first step's time bound.
    import torch._dynamo  # noqa: F401

    torch.set_num_threads(num_threads)
    cfg = _device_for(cfg, rank)
    backend = "gloo" if cfg.device == "cpu" else "nccl"
    dist.init_process_group(backend, store=store, init_method=init_method, rank=rank,
                            world_size=cfg.world_size,
                            timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, 2 * cfg.step_timeout_s)))
    pgs = new_process_groups(cfg)
    device = torch.device(cfg.device)

    def factory(ranks, r, name):
        return DistGroup(pgs[(name, tuple(ranks))], ranks, r, name, device)

    return Worker(cfg, make_groups(cfg, rank, factory), load_state_dict(cfg), record_fa)


# -- the driver pipe -----------------------------------------------------------------------------
def send_msg(conn, msg) -> None:
    # Plain pickle, not the Connection's ForkingPickler: torch registers reductions there that
    # would move every tensor into shared memory and hand over file descriptors.
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv_msg(conn):
    return pickle.loads(conn.recv_bytes())


class PipeChannel(Channel):
    """A rank's end of its pipe to the driver. The driver's reset message carries the Case's
    Schedule as a last element; it is applied here and stripped, so the Worker sees the
    same ("reset", faults, land_immediately, poison) as in the in-process world."""

    def __init__(self, conn, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self.inbox: deque = deque()
        self.sched = ScheduleDriver(Schedule())
        self.copier = None  # the Worker's AsyncCopier, landed at this rank's decision points

    def _land_copies(self) -> None:
        # The in-process world lands delayed copies at its decision points; a process has only
        # these: the moments it talks to its driver.
        c = self.copier
        if c is not None and not c.land_immediately:
            while c.stream and self.sched.land_now() and c.land_head():
                pass

    def get(self):
        self._land_copies()
        while not self.inbox or self.conn.poll():
            self.inbox.append(recv_msg(self.conn))
        msg = self.inbox.popleft()
        if msg[0] == "reset":
            _, faults, land_immediately, poison, schedule = msg
            # Each process draws its own decisions, reproducibly per Case seed and rank.
            self.sched = ScheduleDriver(Schedule.from_dict(
                {**schedule.to_dict(), "seed": schedule.seed * 1000 + self.rank}))
            msg = ("reset", faults, land_immediately, poison)
        return msg

    def has_message(self) -> bool:
        self._land_copies()
        while self.conn.poll():
            self.inbox.append(recv_msg(self.conn))
        return len(self.inbox) > 0

    def peek_kind(self) -> str:
        return self.inbox[0][0]

    def put(self, key, value) -> None:
        send_msg(self.conn, (key, self.rank, value))

    def run_ahead(self) -> bool:
        return self.sched.run_ahead()


def _watch_driver(lifeline) -> None:
    """Exit when the driver dies without stopping us (SIGKILL, a crash): no orphans, even
    while this rank is stuck in a collective and never reads its pipe again. The driver holds
    the only write end of `lifeline` and never writes, so it turns readable (EOF) exactly when
    the driver is gone. (Under forkserver our parent is the fork server, not the driver.)"""
    def loop() -> None:
        mp_wait([lifeline])
        os._exit(3)
    threading.Thread(target=loop, name="driver-watch", daemon=True).start()


def worker_main(rank: int, cfg_dict: dict, store_port: int, prefix: str, conn, lifeline,
                record_fa: bool, num_threads: int) -> None:
    """Target of each rank process started by DistExecutor."""
    # Ctrl-C reaches the whole process group; only the driver should act on it (it kills us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_driver(lifeline)
    chan = PipeChannel(conn, rank)
    try:
        cfg = EngineConfig.from_dict(cfg_dict)
        store = dist.PrefixStore(prefix, dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
        worker = init_rank(cfg, rank, record_fa, num_threads, store=store)
        chan.copier = worker.copier
        worker.copier.should_delay = lambda: not chan.sched.land_now()
        chan.put(("ready",), True)
        worker.run_loop(chan)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the driver went away: nobody to report to
    except BaseException:
        try:
            send_msg(conn, ("error", rank, traceback.format_exc()))
            # Stay alive until stopped or killed: exiting would break the peers' collectives
            # and bury this root cause under their connection errors.
            while recv_msg(conn)[0] != "stop":
                pass
        except BaseException:
            pass
        os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown (gloo threads); the driver joins us


if __name__ == "__main__":
    raise SystemExit("engine.dist_worker_main: no torchrun entry point yet; ranks are started "
                     "by engine.dist_executor.DistExecutor (EngineConfig(world='torch'))")
