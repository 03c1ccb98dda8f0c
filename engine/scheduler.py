"""Scheduler: continuous batching with chunked prefill and recompute preemption (vLLM v1 shape).

`schedule()` spends a token budget on running requests first, then waiting ones; a prompt
longer than the budget is prefilled in chunks. `num_computed_tokens` advances at schedule
time, so with PP several microbatches can be in flight; a request is never scheduled again
while one of its microbatches is in flight. When the KV pool is short the newest running
request that is not in flight is preempted (blocks freed, recomputed later).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.faults import SPEC_ROLLBACK_MISSING, FaultSet
from engine.kv_cache import KVCacheManager


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Driver-side state of one request."""

    def __init__(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                 forced_token_ids: list[int] | None = None) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.forced_token_ids = forced_token_ids  # teacher forcing: appended instead of samples
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # tokens the ranks already know (drives new_token_ids)
        self.status = RequestStatus.WAITING
        self.in_flight = False
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # drafts to verify at the next decode

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt (plus outputs so far, after a preemption)
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One microbatch, as shipped to every rank."""

    microbatch: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, cfg: EngineConfig, faults: FaultSet | None = None) -> None:
        self.cfg = cfg
        self.faults = faults or FaultSet()
        self.kv = KVCacheManager(cfg.num_gpu_blocks, cfg.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last: set[str] = set()
        self._preempted_since_last: set[str] = set()
        self._next_microbatch = 0
        self.num_preemptions = 0
        # EAGLE's draft steps write KV up to k positions past the scheduled tokens: allocate
        # those lookahead slots with the request's blocks (vLLM's num_lookahead_tokens).
        self.num_lookahead_tokens = cfg.num_speculative_tokens if cfg.speculative_method == "eagle" else 0

    def _with_lookahead(self, num_tokens: int) -> int:
        return min(num_tokens + self.num_lookahead_tokens, self.cfg.max_model_len)

    def add_request(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """Next microbatch, or None when nothing can be scheduled now."""
        num_sched: dict[str, int] = {}
        cached = CachedRequestData()
        spec: dict[str, list[int]] = {}
        budget = self._schedule_running(self.cfg.max_num_batched_tokens, num_sched, cached, spec)
        new_reqs = self._schedule_waiting(budget, num_sched)
        if not num_sched:
            return None
        self._advance_scheduled(num_sched)
        return self._emit(num_sched, new_reqs, cached, spec)

    def _schedule_running(self, budget: int, num_sched: dict[str, int], cached: CachedRequestData,
                          spec: dict[str, list[int]]) -> int:
        """Spend the budget on running requests first (decodes, prefill chunks, drafts to
        verify); return what is left of it."""
        for req in list(self.running):
            if budget == 0:
                break
            if req.in_flight or req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            drafts = req.spec_token_ids[:budget - 1] if n == req.num_tokens - req.num_computed_tokens == 1 else []
            n += len(drafts)
            new_blocks = self._allocate_or_preempt(req, self._with_lookahead(req.num_computed_tokens + n), num_sched)
            if new_blocks is None:
                continue
            num_sched[req.req_id] = n
            budget -= n
            req.spec_token_ids = []
            if drafts:
                spec[req.req_id] = drafts
            cached.req_ids.append(req.req_id)
            cached.new_token_ids.append(req.all_token_ids[req.num_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        return budget

    def _schedule_waiting(self, budget: int, num_sched: dict[str, int]) -> list[NewRequestData]:
        """Then admit waiting requests, in order, while the budget, max_num_seqs and the KV
        pool allow (a prompt over the budget only with chunked prefill)."""
        new_reqs: list[NewRequestData] = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n < req.num_tokens and not self.cfg.enable_chunked_prefill:
                break
            blocks = self.kv.allocate_slots(req.req_id, self._with_lookahead(n))
            if blocks is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_sched[req.req_id] = n
            budget -= n
            new_reqs.append(NewRequestData(req.req_id, req.all_token_ids,
                                           list(self.kv.req_blocks[req.req_id]), 0))
        return new_reqs

    def _advance_scheduled(self, num_sched: dict[str, int]) -> None:
        """num_computed_tokens advances at schedule time; the request is in flight until
        update_from_output."""
        for rid in num_sched:
            req = self.requests[rid]
            req.num_computed_tokens += num_sched[rid]
            req.num_tokens_sent = req.num_tokens
            req.in_flight = True

    def _emit(self, num_sched: dict[str, int], new_reqs: list[NewRequestData], cached: CachedRequestData,
              spec: dict[str, list[int]]) -> SchedulerOutput:
        """The microbatch, carrying the finished/preempted ids gathered since the last one."""
        out = SchedulerOutput(
            microbatch=self._next_microbatch, scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached, num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=self._finished_since_last, preempted_req_ids=self._preempted_since_last,
            scheduled_spec_decode_tokens=spec)
        self._finished_since_last, self._preempted_since_last = set(), set()
        self._next_microbatch += 1
        return out

    def _allocate_or_preempt(self, req: Request, total_tokens: int,
                             scheduled: dict[str, int]) -> list[int] | None:
        while True:
            blocks = self.kv.allocate_slots(req.req_id, total_tokens)
            if blocks is not None:
                return blocks
            # Never preempt a request already in this microbatch or in flight in another.
            victims = [r for r in self.running
                       if not r.in_flight and r is not req and r.req_id not in scheduled]
            if not victims:
                return None
            self._preempt(victims[-1])

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_since_last.add(req.req_id)
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, appended: dict[str, list[int]]) -> list[str]:
        """Append each sampled request's verified tokens, roll back rejected drafts (their
        positions were counted as computed at schedule time), return the ids that finished."""
        finished = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests[rid]
            req.in_flight = False
            if rid not in appended or req.status is not RequestStatus.RUNNING:
                continue
            toks = appended[rid][:req.max_tokens - len(req.output_token_ids)]
            self._rollback_rejected_drafts(req, sched.scheduled_spec_decode_tokens.get(rid, []), appended[rid])
            req.output_token_ids.extend(toks)
            if req.is_finished:
                req.status = RequestStatus.FINISHED
                self.running.remove(req)
                self.kv.free(rid)
                self._finished_since_last.add(rid)
                finished.append(rid)
        return finished

    def _rollback_rejected_drafts(self, req: Request, drafts: list[int], appended: list[int]) -> None:
        """Positions computed at schedule time: the last token and every draft. Valid: the
        last token and the accepted drafts (all appended tokens but the bonus one)."""
        if not drafts or self.faults.on(SPEC_ROLLBACK_MISSING):
            return
        req.num_computed_tokens -= len(drafts) + 1 - len(appended)
