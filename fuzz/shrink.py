"""Case-level minimizer for reproducers (`llmfuzz minimize FILE`).

Hypothesis shrinks what it generated; a reproducer from a nightly run, a user or another
llmfuzz version is a plain Case, so this greedy pass shrinks Cases directly: drop requests,
simplify the layout, default the schedule, switch options off, shorten prompts. A
candidate is kept only when it fails with the same property.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator

from engine.config import ConfigError
from engine.schedule import Schedule
from fuzz.case import Case, CaseFormatError, RequestSpec, Workload


def _with_requests(case: Case, reqs: list[RequestSpec]) -> Case:
    return replace(case, workload=Workload(tuple(reqs)))


def _cfg(case: Case, **changes) -> Case | None:
    try:
        return replace(case, config=case.config.replace(**changes))
    except ConfigError:
        return None


def candidates(case: Case) -> Iterator[Case | None]:
    """Simpler variants of `case`, most aggressive first."""
    reqs = list(case.workload.requests)
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield _with_requests(case, reqs[:i] + reqs[i + 1:])
    cfg = case.config
    tp, pp = cfg.tp, cfg.pp
    for t, p in ((1, 1), (1, pp), (tp, 1), (max(1, tp // 2), pp), (tp, max(1, pp // 2)), (tp, pp - 1)):
        if (t, p) != (tp, pp) and t * p >= 1:
            yield _cfg(case, tensor_parallel_size=t, pipeline_parallel_size=p,
                       sequence_parallel=cfg.sequence_parallel and t > 1,
                       broadcast_pp_output=cfg.broadcast_pp_output and p > 1)
    if not case.schedule.is_default or case.schedule.seed:
        yield replace(case, schedule=Schedule())
        s = case.schedule
        for field, simple in (("rank_order", "natural"), ("copy_delay", 0.0), ("prepare_ahead", 0.0), ("seed", 0)):
            if getattr(s, field) != simple:
                yield replace(case, schedule=replace(s, **{field: simple}))
    if cfg.speculative_method != "none":
        yield _cfg(case, speculative_method="none", num_speculative_tokens=0)
        if cfg.num_speculative_tokens > 1:
            yield _cfg(case, num_speculative_tokens=1)
    for field, simple in (("sequence_parallel", False), ("broadcast_pp_output", False),
                          ("max_num_batched_tokens", 64), ("num_gpu_blocks", 96)):
        if getattr(cfg, field) != simple:
            yield _cfg(case, **{field: simple})
    for i, r in enumerate(reqs):
        n = len(r.prompt_token_ids)
        shorter = sorted({1, n // 2, n - 1} - {0, n})
        for m in shorter:
            yield _with_requests(case, reqs[:i] + [replace(r, prompt_token_ids=r.prompt_token_ids[:m])] + reqs[i + 1:])
        if r.max_tokens > 1:
            yield _with_requests(case, reqs[:i] + [replace(r, max_tokens=1)] + reqs[i + 1:])
            yield _with_requests(case, reqs[:i] + [replace(r, max_tokens=r.max_tokens - 1)] + reqs[i + 1:])
        if r.arrival_step:
            yield _with_requests(case, reqs[:i] + [replace(r, arrival_step=0)] + reqs[i + 1:])
        if any(r.prompt_token_ids):
            yield _with_requests(case, reqs[:i] + [replace(r, prompt_token_ids=(0,) * n)] + reqs[i + 1:])


def minimize(case: Case, still_fails: Callable[[Case], bool], max_checks: int = 400,
             deadline: float | None = None,
             simpler: Callable[[Case], Iterable[Case | None]] = candidates) -> tuple[Case, int]:
    """Greedy fixpoint: take the first simpler candidate that still fails, repeat. Stops after
    `max_checks` checks or at `deadline` (time.monotonic()), keeping the smallest so far.
    `simpler` gives the candidates (a target's own: fuzz.target.Target.simpler)."""
    checks = 0
    progress = True

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() > deadline

    while progress and checks < max_checks and not out_of_time():
        progress = False
        for cand in simpler(case):
            if cand is None or cand == case:
                continue
            if out_of_time():
                break
            try:
                cand.validate()
            except CaseFormatError:
                continue
            checks += 1
            if still_fails(cand):
                case, progress = cand, True
                break
            if checks >= max_checks:
                break
    return case, checks


class Shrinker:
    """The predicate a minimizer runs for a failure `first`: `still_fails(case)` checks `case`
    (`check`: a target's, fuzz.target) and is True when it fails the same way (`same`,
    default fuzz.properties.same_failure); `best` is the smallest such Violation seen, kept when
    a stop or a deadline cuts the search short. `before` runs ahead of every check (the
    campaign's stop flag)."""

    def __init__(self, first, check: Callable, same: Callable | None = None,
                 before: Callable[[], None] | None = None) -> None:
        from fuzz.properties import same_failure

        self.first, self.best, self.check = first, first, check
        self.same, self.before = same or same_failure, before

    def still_fails(self, case: Case) -> bool:
        from fuzz.properties import Violation

        if self.before is not None:
            self.before()
        try:
            self.check(case)
        except Violation as w:
            if self.same(w, self.first):
                self.best = w
                return True
        return False
