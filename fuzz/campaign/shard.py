"""`llmfuzz run --shard K/N`: shard K of a campaign that N machines run between them.

A shard is what worker K-1 of `run --jobs N` would run (fuzz.campaign.jobs.partition deals
it: its layouts, or its stream of a layout's chunks when there are more shards than layouts),
with the whole campaign's cell count (fuzz.campaign.jobs_worker.Share): chunk sizes, the first
round and every chunk's seed are the campaign's, so the N shards together draw the Cases one
machine would, each chunk in one shard only. A shard's own `--jobs M` deals its part again:
worker t of M on stream s of S runs stream s + S*t of S*M (`within`).

The vLLM target visits its configs one after another: a shard takes every N-th config of a
plan made for N times the budget (N machines afford N times the configs), each at its
place in the whole plan (its chunk seeds are the plan's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fuzz.errors import BadInput


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based, as written on the command line
    count: int
    part: dict | None = field(default=None, compare=False)  # what it runs (shard_part), once known

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str | None) -> Shard | None:
    """--shard K/N (None: not given), checked before anything starts."""
    if text is None:
        return None
    k, sep, n = str(text).strip().partition("/")
    try:
        if not sep:
            raise ValueError
        shard = Shard(int(k), int(n))
    except ValueError:
        raise BadInput(f"--shard: {text!r} is not K/N (shard K of N, e.g. 1/4)") from None
    if shard.count < 1 or not 1 <= shard.index <= shard.count:
        raise BadInput(f"--shard: {text!r}: K must be 1 to N and N at least 1 (e.g. 1/4 to 4/4)")
    return shard


def shard_part(shard: Shard, names: list[str], cost=None) -> Shard:
    """The shard with its part of the campaign's cells `names` as `partition` deals worker
    K-1 of N ({"layouts", "stream", "streams"}); `cost`: a cell's relative cost (default:
    layout_cost)."""
    from fuzz.campaign.jobs import partition

    return Shard(shard.index, shard.count, partition(names, shard.count, cost)[shard.index - 1])
