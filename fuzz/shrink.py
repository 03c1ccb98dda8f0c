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
    if len(reqs) >= 4:
        # Halves first: a late finding at 8 requests on a big layout costs a check per dropped
        # request otherwise, each as dear as the Case (bisection, as in delta debugging).
        half = len(reqs) // 2
        yield _with_requests(case, reqs[:half])
        yield _with_requests(case, reqs[half:])
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
    if case.poison != "nan":  # the default: a stale-memory bug shows as non-finite logits then
        yield replace(case, poison="nan")
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
    small, checks, _ = minimize_to_fixpoint(case, still_fails, max_checks, deadline, simpler)
    return small, checks


def minimize_to_fixpoint(case: Case, still_fails: Callable[[Case], bool], max_checks: int = 400,
                         deadline: float | None = None,
                         simpler: Callable[[Case], Iterable[Case | None]] = candidates) -> tuple[Case, int, bool]:
    """`minimize`, also saying whether the result is minimal as far as the minimizer can tell:
    one whole pass over its candidates ran and none failed (no request, token, rank, chunk or
    schedule event of `simpler`'s could go). False when the check budget or the deadline cut
    the last pass short. Calling it again on the result continues where it stopped.

    After a candidate is taken, the search resumes at the same place in the new Case's
    candidates, not at the top: restarting cost a failing check per earlier candidate for
    every token a prompt lost (a 27-token prompt shortened one token at a time took 294
    checks). Only a pass from the top that takes nothing makes the result minimal."""
    checks, start = 0, 0

    def out_of_time() -> bool:
        return deadline is not None and time.monotonic() > deadline

    while True:
        cands, taken = list(simpler(case)), None
        for j in range(start, len(cands)):
            cand = cands[j]
            if cand is None or cand == case:
                continue
            try:
                cand.validate()
            except CaseFormatError:
                continue
            if out_of_time() or checks >= max_checks:
                return case, checks, False
            checks += 1
            if still_fails(cand):
                taken = j
                break
        if taken is not None:
            case, start = cands[taken], taken
        elif start == 0:
            return case, checks, True  # a whole pass from the top, and nothing could go
        else:
            start = 0  # the candidates before where it resumed: once more from the top


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
        self.checks = 0  # cases checked (a stop mid-search still knows how many)

    def still_fails(self, case: Case) -> bool:
        from fuzz.properties import Violation

        if self.before is not None:
            self.before()
        self.checks += 1
        try:
            self.check(case)
        except Violation as w:
            if self.same(w, self.first):
                self.best = w
                return True
        return False
