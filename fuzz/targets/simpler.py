"""How a Case gets simpler: the candidates a minimizer tries, most aggressive first (prefix
caching off, salts gone, prefixes unshared, aborts dropped, sampling params to default; drop
requests, simplify the layout, default the schedule, switch options off, sampling params
field by field, shorten prompts). A target's `simpler()` defaults to these."""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Iterator

from engine.config import ConfigError
from engine.sample.sampling_params import DEFAULT as DEFAULT_SAMPLING
from engine.schedule import Schedule
from fuzz.cases.case import Case, RequestSpec, Workload


def _with_requests(case: Case, reqs: list[RequestSpec]) -> Case:
    return replace(case, workload=Workload(tuple(reqs)))


def _cfg(case: Case, **changes) -> Case | None:
    try:
        return replace(case, config=case.config.replace(**changes))
    except ConfigError:
        return None


def _first_block(case: Case, r: RequestSpec) -> tuple[int, ...] | None:
    """What decides whether a request's KV can be shared at all: its first full block."""
    bs = case.config.block_size
    return r.prompt_token_ids[:bs] if len(r.prompt_token_ids) >= bs else None


def _shares(case: Case, reqs: list[RequestSpec], i: int) -> bool:
    """Request i's first full block is also an earlier request's (the salt aside)."""
    b = _first_block(case, reqs[i])
    return b is not None and any(_first_block(case, r) == b for r in reqs[:i])


def _unshared(case: Case, reqs: list[RequestSpec], which: list[int]) -> Case | None:
    """Requests `which` that share a prefix with an earlier one start with a token no request
    starts with: they share no block any more (the rest of the prompt, and its length, stay)."""
    reqs, changed = list(reqs), False
    for i in which:
        if not _shares(case, reqs, i):
            continue
        used = {r.prompt_token_ids[0] for r in reqs}
        fresh = next((t for t in range(case.config.vocab_size) if t not in used), None)
        if fresh is None:
            return None
        reqs[i] = replace(reqs[i], prompt_token_ids=(fresh,) + reqs[i].prompt_token_ids[1:])
        changed = True
    return _with_requests(case, reqs) if changed else None


def _sharing_pairs(case: Case, reqs: list[RequestSpec]) -> int:
    blocks = [_first_block(case, r) for r in reqs]
    return sum(1 for i, b in enumerate(blocks) if b is not None for c in blocks[:i] if c == b)


def _adds_sharing(case: Case, reqs: list[RequestSpec], i: int, prompt: tuple[int, ...]) -> bool:
    """With caching on, whether request i's prompt replaced by `prompt` shares more blocks: a
    candidate never adds sharing (zeroing prompts would undo unsharing them, round and round)."""
    if not case.config.enable_prefix_caching:
        return False
    after = reqs[:i] + [replace(reqs[i], prompt_token_ids=prompt)] + reqs[i + 1:]
    return _sharing_pairs(case, after) > _sharing_pairs(case, reqs)


def _each(case: Case, reqs: list[RequestSpec], which: list[int], **change) -> Iterator[Case]:
    """`change` on all of `which` at once, then (if several) on each alone."""
    if which:
        yield _with_requests(case, [replace(r, **change) if i in which else r for i, r in enumerate(reqs)])
    for i in which if len(which) > 1 else ():
        yield _with_requests(case, reqs[:i] + [replace(reqs[i], **change)] + reqs[i + 1:])


def _simpler_params(case: Case, reqs: list[RequestSpec], i: int) -> Iterator[Case | None]:
    """Request i's sampling params with one field back at its default (n to 1 first: fewer
    children; temperature to 0 only once n is 1, greedy children being refused)."""
    p = reqs[i].sampling
    names = sorted((f.name for f in fields(p) if getattr(p, f.name) != getattr(DEFAULT_SAMPLING, f.name)),
                   key=lambda n: n != "n")
    for name in names:
        try:
            q = replace(p, **{name: getattr(DEFAULT_SAMPLING, name)})
        except ConfigError:  # SamplingParamsError: this field cannot go alone
            yield None
            continue
        yield _with_requests(case, reqs[:i] + [replace(reqs[i], sampling=q)] + reqs[i + 1:])


def candidates(case: Case) -> Iterator[Case | None]:
    """Simpler variants of `case`, most aggressive first."""
    reqs = list(case.workload.requests)
    salted = [i for i, r in enumerate(reqs) if r.cache_salt is not None]
    sharing = [i for i in range(len(reqs)) if case.config.enable_prefix_caching and _shares(case, reqs, i)]
    aborted = [i for i, r in enumerate(reqs) if r.abort_step is not None]
    sampled = [i for i, r in enumerate(reqs) if r.sampling is not None]
    yield from _without_features(case, reqs, salted, sharing, aborted, sampled)
    yield from _fewer_requests(case, reqs)
    yield from _smaller_layouts(case)
    yield from _simpler_schedule(case)
    yield from _simpler_config(case)
    yield from _features_one_by_one(case, reqs, salted, sharing, aborted, sampled)
    for i in range(len(reqs)):
        yield from _simpler_request(case, reqs, i)


def _without_features(case: Case, reqs: list, salted: list, sharing: list, aborted: list,
                      sampled: list) -> Iterator[Case | None]:
    # Prefix caching, salts and shared prefixes go before requests: a finding that does not
    # need them then shrinks as an ordinary one, and one that does says so in what remains.
    if case.config.enable_prefix_caching:
        yield _cfg(case, enable_prefix_caching=False)
    if case.config.async_scheduling:  # likewise async scheduling: a finding without it is plainer
        yield _cfg(case, async_scheduling=False)
    if salted:
        yield _with_requests(case, [replace(r, cache_salt=None) for r in reqs])
    if sharing:
        yield _unshared(case, reqs, sharing)
    # Aborts and sampling params likewise: a finding that needs neither loses them first.
    yield from _each(case, reqs, aborted, abort_step=None, abort_in_step=False)
    yield from _each(case, reqs, sampled, sampling=None)


def _fewer_requests(case: Case, reqs: list) -> Iterator[Case | None]:
    if len(reqs) >= 4:
        # Halves first: a late finding at 8 requests on a big layout costs a check per dropped
        # request otherwise, each as dear as the Case (bisection, as in delta debugging).
        half = len(reqs) // 2
        yield _with_requests(case, reqs[:half])
        yield _with_requests(case, reqs[half:])
    for i in range(len(reqs)):
        if len(reqs) > 1:
            yield _with_requests(case, reqs[:i] + reqs[i + 1:])


def _smaller_layouts(case: Case) -> Iterator[Case | None]:
    cfg = case.config
    tp, pp = cfg.tp, cfg.pp
    for t, p in ((1, 1), (1, pp), (tp, 1), (max(1, tp // 2), pp), (tp, max(1, pp // 2)), (tp, pp - 1)):
        if (t, p) != (tp, pp) and t * p >= 1:
            yield _cfg(case, tensor_parallel_size=t, pipeline_parallel_size=p,
                       sequence_parallel=cfg.sequence_parallel and t > 1,
                       broadcast_pp_output=cfg.broadcast_pp_output and p > 1)


def _simpler_schedule(case: Case) -> Iterator[Case | None]:
    if not case.schedule.is_default or case.schedule.seed:
        yield replace(case, schedule=Schedule())
        s = case.schedule
        for field, simple in (("rank_order", "natural"), ("copy_delay", 0.0), ("prepare_ahead", 0.0),
                              ("async_wait", 0.0), ("seed", 0)):
            if getattr(s, field) != simple:
                yield replace(case, schedule=replace(s, **{field: simple}))
    if case.poison != "nan":  # the default: a stale-memory bug shows as non-finite logits then
        yield replace(case, poison="nan")


def _simpler_config(case: Case) -> Iterator[Case | None]:
    cfg = case.config
    if cfg.speculative_method != "none":
        yield _cfg(case, speculative_method="none", num_speculative_tokens=0)
        if cfg.num_speculative_tokens > 1:
            yield _cfg(case, num_speculative_tokens=1)
    for field, simple in (("sequence_parallel", False), ("broadcast_pp_output", False),
                          ("max_num_batched_tokens", 64), ("num_gpu_blocks", 96)):
        if getattr(cfg, field) != simple:
            yield _cfg(case, **{field: simple})


def _features_one_by_one(case: Case, reqs: list, salted: list, sharing: list, aborted: list,
                         sampled: list) -> Iterator[Case | None]:
    for i in salted if len(salted) > 1 else ():  # one at a time (all at once came first)
        yield _with_requests(case, reqs[:i] + [replace(reqs[i], cache_salt=None)] + reqs[i + 1:])
    for i in sharing if len(sharing) > 1 else ():
        yield _unshared(case, reqs, [i])
    for i in sampled:
        yield from _simpler_params(case, reqs, i)
    for i in aborted:  # between steps, then the abort at arrival (before the request runs at all), then a step earlier
        r = reqs[i]
        if r.abort_in_step:
            yield _with_requests(case, reqs[:i] + [replace(r, abort_in_step=False)] + reqs[i + 1:])
        for step in sorted({r.arrival_step, r.abort_step - 1} - {r.abort_step}):
            if step >= r.arrival_step:
                yield _with_requests(case, reqs[:i] + [replace(r, abort_step=step)] + reqs[i + 1:])


def _simpler_request(case: Case, reqs: list, i: int) -> Iterator[Case | None]:
    r = reqs[i]
    n = len(r.prompt_token_ids)
    for m in sorted({1, n // 2, n - 1} - {0, n}):
        yield _with_requests(case, reqs[:i] + [replace(r, prompt_token_ids=r.prompt_token_ids[:m])] + reqs[i + 1:])
    if r.max_tokens > 1:
        yield _with_requests(case, reqs[:i] + [replace(r, max_tokens=1)] + reqs[i + 1:])
        yield _with_requests(case, reqs[:i] + [replace(r, max_tokens=r.max_tokens - 1)] + reqs[i + 1:])
    if r.arrival_step:
        yield _with_requests(case, reqs[:i] + [replace(r, arrival_step=0)] + reqs[i + 1:])
    if any(r.prompt_token_ids) and not _adds_sharing(case, reqs, i, (0,) * n):
        yield _with_requests(case, reqs[:i] + [replace(r, prompt_token_ids=(0,) * n)] + reqs[i + 1:])
