"""Helpers shared by the engine tests: seeded workloads and a driver that staggers arrivals."""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine import LLMEngine


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request, added to the engine before step number `at_step` (0 = before the first)."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    at_step: int = 0
    forced: tuple[int, ...] | None = None


def random_prompt(rng: random.Random, length: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(length))


def mixed_arrivals(seed: int, lengths: list[int], vocab: int, max_tokens: tuple[int, int],
                   prefix: str = "r", at_step: int = 0) -> list[Arrival]:
    """Requests with the given prompt lengths and seeded token ids and max_tokens."""
    rng = random.Random(seed)
    return [Arrival(f"{prefix}{i}", random_prompt(rng, n, vocab), rng.randint(*max_tokens), at_step)
            for i, n in enumerate(lengths)]


def run_arrivals(e: LLMEngine, arrivals: list[Arrival], max_steps: int = 5000) -> int:
    """Drive `e` until every request finished, adding each arrival before its step; returns
    the number of steps taken."""
    pending = sorted(arrivals, key=lambda a: a.at_step)
    steps = 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0].at_step <= steps:
            a = pending.pop(0)
            e.add_request(a.req_id, list(a.prompt), a.max_tokens,
                          list(a.forced) if a.forced is not None else None)
        if e.has_unfinished_requests():
            e.step()
        steps += 1
        assert steps < max_steps, "engine did not finish the workload"
    return steps


def capture_scheduler_outputs(e: LLMEngine) -> list:
    """Record every SchedulerOutput the driver submits to the ranks (test-side wrapper)."""
    seen: list = []
    submit = e.executor.submit

    def wrapped(so) -> None:
        seen.append(so)
        submit(so)

    e.executor.submit = wrapped
    return seen
