"""Schedule: the harness-controlled part of time, as a serialisable value.

Real engines have two sources of nondeterminism: the order in which ranks advance their
in-flight microbatches, and when each asynchronous copy completes. Both are inputs here.
With async scheduling a third: whether the engine schedules a step before the one in
flight returns. Every field shrinks toward the default (natural order, copies land at once,
no preparing ahead, always scheduling ahead), under which a correct and a racy engine behave the same.
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
    # Async scheduling only: chance the engine waits for its step in flight instead of
    # scheduling the next one ahead of it (0: always ahead, as vLLM). Written only when set.
    async_wait: float = 0.0

    def __post_init__(self) -> None:
        if self.rank_order not in ("natural", "random"):
            raise ValueError(f"schedule.rank_order: {self.rank_order!r} is not natural or random")
        for name in ("copy_delay", "prepare_ahead", "async_wait"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"schedule.{name}: {v} is not within [0, 1]")

    @property
    def is_default(self) -> bool:
        return self == Schedule(seed=self.seed)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["async_wait"] == 0.0:  # a Schedule from before async scheduling keeps its JSON
            del d["async_wait"]
        return d

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

    def schedule_ahead(self) -> bool:
        """Async scheduling: schedule the next step before the one in flight returns. The
        engine's own driver (seeded like the ranks') makes these draws and no others."""
        return self.s.async_wait == 0.0 or self.rng.random() >= self.s.async_wait
