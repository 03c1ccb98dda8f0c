"""Schedule: the harness-controlled part of time, as a serialisable value.

Real engines have two sources of nondeterminism: the order in which ranks advance their
in-flight microbatches, and when each asynchronous copy completes. Both are inputs here.
Every field shrinks toward the default (natural order, copies land at once, no running
ahead), under which a correct and a racy engine behave the same.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Schedule:
    seed: int = 0
    rank_order: str = "natural"  # "natural": lowest runnable rank first; "random": seeded choice
    copy_delay: float = 0.0  # chance a pending copy stays pending at each decision point
    prepare_ahead: float = 0.0  # chance a rank prepares its next microbatch before executing the current

    def __post_init__(self) -> None:
        if self.rank_order not in ("natural", "random"):
            raise ValueError(f"schedule.rank_order: {self.rank_order!r} is not natural or random")
        for name in ("copy_delay", "prepare_ahead"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"schedule.{name}: {v} is not within [0, 1]")

    @property
    def is_default(self) -> bool:
        return self == Schedule(seed=self.seed)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        return cls(**d)


class ScheduleDriver:
    """The decisions of one run, drawn from the Schedule's seed in a fixed order."""

    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.rng = random.Random(schedule.seed)

    def pick(self, runnable: list[int]) -> int:
        if self.s.rank_order == "natural" or len(runnable) == 1:
            return runnable[0]
        return runnable[self.rng.randrange(len(runnable))]

    def land_now(self) -> bool:
        return self.s.copy_delay == 0.0 or self.rng.random() >= self.s.copy_delay

    def run_ahead(self) -> bool:
        return self.s.prepare_ahead > 0.0 and self.rng.random() < self.s.prepare_ahead
