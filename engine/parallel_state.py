"""GroupCoordinator: the collectives and point-to-point transfers a rank may use.

Model and runner code talk only to this interface. Each world (in-process threads,
torch.distributed processes) provides four primitives; everything else, including vLLM's
all_gather optimisation for PP transfers, is written once here, so no code path exists only
in one world. Reductions sum the gathered pieces in rank order, so results never depend on
timing and both worlds give bitwise the same numbers.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.faults import ALLREDUCE_ARRIVAL_ORDER, FaultSet


@dataclass(slots=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: bool  # sent as 1/tp pieces, to be all-gathered by the receiving TP group


class GroupCoordinator(abc.ABC):
    """One process group seen from one rank (vLLM's name). `ranks` are global ranks."""

    def __init__(self, ranks: list[int], rank: int, name: str) -> None:
        self.ranks = list(ranks)
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.name = name
        self.faults = FaultSet()  # the runner's, set with each Case's (GPUModelRunner.faults)
        self.out_dtype: torch.dtype | None = None  # the activations' dtype (the runner's)
        from engine.custom_ops import register_group

        self.op_key = register_group(self)  # how graph-capturable custom ops find this group

    # -- primitives a world implements -------------------------------------------------
    @abc.abstractmethod
    def _gather_list(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor, in group rank order."""

    def _arrival_order(self) -> list[int]:
        """The group ranks in the order their tensors reached the last gather. A world that
        cannot tell (torch.distributed) answers rank order."""
        return list(range(self.world_size))

    @abc.abstractmethod
    def _send_obj(self, obj, dst_in_group: int) -> None:
        ...

    @abc.abstractmethod
    def _recv_obj(self, src_in_group: int):
        ...

    @abc.abstractmethod
    def _broadcast_obj(self, obj, src_in_group: int):
        ...

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t
        return self._sum_partials(self._gather_list(t))

    def _sum_partials(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The partials summed in group rank order: the order is the data's, never the
        timing's, so every run of a Case gives the same bits."""
        if self.faults.on(ALLREDUCE_ARRIVAL_ORDER):  # atomicAdd into the output, as partials land
            # The output is in the activations' dtype, as an atomicAdd into a float or bfloat16
            # tensor rounds every add to it: summed wider (a float32 accumulator of bfloat16
            # activations' partials) the rounding at the end would hide the order.
            order, acc_dtype = self._arrival_order(), self.out_dtype or torch.float32
            acc = parts[order[0]].to(acc_dtype, copy=True)  # the parts are shared by the ranks
            for i in order[1:]:
                acc += parts[i].to(acc_dtype)
            return acc.to(parts[0].dtype)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return t
        return torch.cat(self._gather_list(t), dim=dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/world_size slice along `dim`."""
        if self.world_size == 1:
            return t
        total = self.all_reduce(t)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def broadcast_tensor_dict(self, d: dict | None, src: int = 0) -> dict:
        if self.world_size == 1:
            return d
        return self._broadcast_obj(d if self.rank_in_group == src else None, src)

    # -- point to point (PP) ------------------------------------------------------------
    def send_tensor_dict(self, d: dict, dst: int | None = None,
                         all_gather_group: "GroupCoordinator | None" = None,
                         scattered: tuple[str, ...] = ()) -> None:
        """Send to the next stage. With `all_gather_group`, a tensor identical on every TP
        rank and whose numel divides by tp is sent as this rank's 1/tp piece only; keys in
        `scattered` differ per TP rank (sequence parallel residual) and always go whole."""
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        ag = all_gather_group if all_gather_group is not None and all_gather_group.world_size > 1 else None
        payload = {}
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                split = ag is not None and k not in scattered and v.numel() % ag.world_size == 0
                piece = v.reshape(-1).chunk(ag.world_size)[ag.rank_in_group] if split else v
                payload[k] = (_TensorMeta(tuple(v.shape), v.dtype, split), piece.clone())
            else:
                payload[k] = v
        self._send_obj(payload, dst)

    def recv_tensor_dict(self, src: int | None = None,
                         all_gather_group: "GroupCoordinator | None" = None) -> dict:
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        payload = self._recv_obj(src)
        out = {}
        for k, v in payload.items():
            if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], _TensorMeta):
                meta, t = v
                if meta.split:
                    # Every TP rank of this stage must take part, or the gather never completes.
                    t = all_gather_group.all_gather(t, dim=0)
                out[k] = t.reshape(meta.shape)
            else:
                out[k] = v
        return out


class SoloGroup(GroupCoordinator):
    """A group of one rank: every collective is the identity."""

    def __init__(self, rank: int, name: str) -> None:
        super().__init__([rank], rank, name)

    def _gather_list(self, t):
        return [t]

    def _broadcast_obj(self, obj, src_in_group):
        return obj

    def _send_obj(self, obj, dst_in_group):
        raise RuntimeError(f"{self.name}: point-to-point send in a group of one")

    def _recv_obj(self, src_in_group):
        raise RuntimeError(f"{self.name}: point-to-point recv in a group of one")


@dataclass(slots=True)
class RankGroups:
    """The groups of one rank in a tp x pp layout (global rank = pp_rank * tp + tp_rank)."""

    rank: int
    tp_rank: int
    pp_rank: int
    tp: GroupCoordinator
    pp: GroupCoordinator
    world: GroupCoordinator


def rank_coords(rank: int, tp_size: int) -> tuple[int, int]:
    return rank % tp_size, rank // tp_size


def tp_group_ranks(pp_rank: int, tp_size: int) -> list[int]:
    return [pp_rank * tp_size + i for i in range(tp_size)]


def pp_group_ranks(tp_rank: int, tp_size: int, pp_size: int) -> list[int]:
    return [s * tp_size + tp_rank for s in range(pp_size)]


def make_groups(cfg: EngineConfig, rank: int, group_factory) -> RankGroups:
    """The tp, pp and world groups of `rank`; group_factory(ranks, rank, name) -> group."""
    tp_rank, pp_rank = rank_coords(rank, cfg.tp)

    def grp(ranks: list[int], name: str):
        return SoloGroup(rank, name) if len(ranks) == 1 else group_factory(ranks, rank, name)

    return RankGroups(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank,
                      tp=grp(tp_group_ranks(pp_rank, cfg.tp), "tp"),
                      pp=grp(pp_group_ranks(tp_rank, cfg.tp, cfg.pp), "pp"),
                      world=grp(list(range(cfg.world_size)), "world"))
