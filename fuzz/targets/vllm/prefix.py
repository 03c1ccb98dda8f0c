"""What one vLLM engine's prefix cache can hold, from the requests it served (`EngineCache`),
and the rule each request's reported hit (`num_cached_tokens`) is judged by: the
`vllm_prefix_cache` property (fuzz.targets.vllm.checker).

The model is the harness's own (fuzz.verdict.prefix_cache: full blocks named by chained
hashes with the cache salt), fed every run the engine served since it started (batch runs,
solo runs; the worker's warm-up prompts are shorter than any block). Per request:

- upper bound `hi`: the hit the model allows over every block any earlier run's requests,
  or this run's OTHER requests, may have computed (an aborted request's unseen output as
  anything, `unknown`). vLLM caches a block when it schedules it, so a request may hit blocks
  of a request in its own run; eviction can only lower a hit. A reported hit above `hi` is a
  hit on KV of other tokens or another salt: always a finding. 0 where prefix caching is off
  or the run asked for prompt logprobs (vLLM does not read the cache for such a request).
- lower bound `lo`: the hit over the blocks earlier runs' FINISHED requests certainly
  computed: the prompt and all but the last 1 + k output tokens (the last step's tokens are
  computed but cached only at a next step that never comes; k: n-gram draft tokens). Judged
  only while the engine cannot have evicted: vLLM's free-block queue hands out never-used
  blocks before any freed (cached) one, so while the blocks every request served could
  have taken (`allocated`, an upper bound) stay within the pool's free blocks at rest
  (`capacity`, the worker's count before a run), nothing was evicted, and a request must
  find at least what earlier runs left. Below `lo` is a lost hit. Where `lo` == `hi` (no
  request of the same run shares its blocks) the rule is equality.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fuzz.verdict.prefix_cache import PrefixCacheModel


@dataclass
class Judged:
    """One run's judgement: per request (reported, lo or None, hi), and those outside."""

    requests: dict[str, tuple[int, int | None, int]] = field(default_factory=dict)
    above: list[str] = field(default_factory=list)  # reported > hi
    below: list[str] = field(default_factory=list)  # reported < lo

    def message(self) -> str:
        def one(rid: str) -> str:
            rep, lo, hi = self.requests[rid]
            return f"{rid}: reported {rep} cached tokens, model allows {'' if lo is None else f'{lo}..'}{hi}"
        return "; ".join(one(r) for r in (self.above + self.below)[:4])


class EngineCache:
    """The ledger of one engine (one vLLM worker process): `judge` a run, which also adds it."""

    def __init__(self, block_size: int, enabled: bool, spec_k: int = 0) -> None:
        self.block_size, self.enabled, self.spec_k = block_size, enabled, spec_k
        self.possible = PrefixCacheModel(block_size)  # every block served, unseen output as anything
        self.certain = PrefixCacheModel(block_size)  # blocks earlier runs' finished requests cached
        self.allocated = 0  # blocks the requests served could have taken from the pool, at most
        self.capacity: int | None = None  # the pool's free blocks at rest (before a run)

    def _blocks(self, r) -> int:
        """The most blocks a request can take: all its tokens, drafts and one more."""
        return -(-(len(r.prompt_token_ids) + r.max_tokens + self.spec_k + 1) // self.block_size) + 1

    def judge(self, items: list, run, prompt_logprobs: bool = False) -> Judged:
        """Judge each request of `run` (items: (request id, RequestSpec) as sent) and add the
        run to the ledger."""
        before = run.free_blocks[0] if run.free_blocks else None
        if before is not None:
            self.capacity = max(self.capacity or 0, int(before))
        self.allocated += sum(self._blocks(r) for _, r in items)
        reads = self.enabled and not prompt_logprobs
        no_eviction = self.capacity is not None and self.allocated <= self.capacity
        own = {}
        for rid, r in items:
            m = PrefixCacheModel(self.block_size)
            res = run.results.get(rid)
            seen = tuple(r.prompt_token_ids) + (tuple(res.token_ids) if res is not None else ())
            if res is None or rid in run.aborted:
                # Aborted (or never answered): what it computed past what was seen is unknown
                # (with the core in its own process an abort lands mid-step).
                m.add(seen, r.cache_salt, unknown=r.max_tokens + self.spec_k)
            else:
                m.add(seen, r.cache_salt)
            own[rid] = m
        out = Judged()
        for rid, r in items:
            res = run.results.get(rid)
            if res is None:
                continue
            others = [m for k, m in own.items() if k != rid]
            hi = self.possible.hit(r.prompt_token_ids, r.cache_salt, within=others) if reads else 0
            lo = (min(hi, self.certain.hit(r.prompt_token_ids, r.cache_salt)) if reads else 0) if no_eviction \
                else None
            rep = int(res.num_cached_tokens)
            out.requests[rid] = (rep, lo, hi)
            if rep > hi:
                out.above.append(rid)
            elif lo is not None and rep < lo:
                out.below.append(rid)
        for rid, r in items:
            self.possible.names |= own[rid].names
            for k, v in own[rid].open_tails.items():
                self.possible.open_tails.setdefault(k, []).extend(v)
            res = run.results.get(rid)
            if res is not None and rid not in run.aborted:
                keep = max(0, len(res.token_ids) - 1 - self.spec_k)
                self.certain.add(tuple(r.prompt_token_ids) + tuple(res.token_ids[:keep]), r.cache_salt)
        return out
