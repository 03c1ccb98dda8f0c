"""Helpers of the sampling tests: requests with SamplingParams, a driver with staggered
arrivals, and the trace comparisons they share."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from engine import LLMEngine, Trace
from engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SReq:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    params: SamplingParams | None = None
    at_step: int = 0
    forced: tuple[int, ...] | None = None


def prompt_of(seed: str, n: int, vocab: int = 128) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(n))


def run(e: LLMEngine, reqs: list[SReq], faults: tuple[str, ...] = (), scheduler_config=None,
        max_steps: int = 3000) -> Trace:
    """Reset `e` and drive the requests to completion, each added before its step."""
    e.reset(faults=faults, scheduler_config=scheduler_config)
    pending = sorted(reqs, key=lambda r: r.at_step)
    step = 0
    while pending or e.has_unfinished_requests():
        while pending and pending[0].at_step <= step:
            r = pending.pop(0)
            e.add_request(r.req_id, list(r.prompt), r.max_tokens, None if r.forced is None else list(r.forced),
                          sampling_params=r.params)
        if e.has_unfinished_requests():
            e.step()
        step += 1
        assert step < max_steps, "engine did not finish the workload"
    return e.trace


def tokens(trace: Trace, rid: str) -> list[int]:
    return [t.token for t in trace.tokens[rid]]


def noise(trace: Trace, rid: str) -> list[torch.Tensor]:
    return [t.noise for t in trace.tokens[rid]]


def forced_like(reqs: list[SReq], trace: Trace) -> list[SReq]:
    """The same requests, teacher-forced with the tokens `trace` appended."""
    return [replace(r, forced=tuple(tokens(trace, r.req_id))) for r in reqs]


def others(seed: int, n: int, vocab: int = 128, at_step: int = 0, params=None) -> list[SReq]:
    """n requests of assorted prompt lengths around the block size and the token budget."""
    rng = random.Random(seed)
    return [SReq(f"o{seed}_{i}", prompt_of(f"{seed}/{i}", rng.choice([1, 3, 6, 13, 21]), vocab),
                 rng.randint(2, 6), params, at_step + rng.randint(0, 3)) for i in range(n)]


def assert_same_draws(a: Trace, b: Trace, rid: str) -> None:
    """Same seed, same draw at every output index (whatever the tokens)."""
    na, nb = noise(a, rid), noise(b, rid)
    assert len(na) == len(nb) and all(x is not None for x in na), rid
    for i, (x, y) in enumerate(zip(na, nb)):
        assert torch.equal(x, y), f"{rid}: draw {i} differs"


def assert_same_tokens_where_logits_equal(a: Trace, b: Trace, rid: str) -> int:
    """Tokens agree at every position up to the first whose raw logits differ at all (there a
    near-tie in the race may legitimately flip); returns the positions compared."""
    n = 0
    for x, y in zip(a.tokens[rid], b.tokens[rid]):
        if not torch.equal(x.logits, y.logits):
            break
        assert x.sampled == y.sampled, f"{rid}: output {n} sampled {x.sampled} vs {y.sampled} on equal logits"
        n += 1
        if x.token != y.token:
            break
    return n
