"""Scheduler: continuous batching with chunked prefill and recompute preemption (vLLM v1 shape).

`schedule()` spends a token budget on running requests first, then waiting ones; a prompt
longer than the budget is prefilled in chunks. `num_computed_tokens` advances at schedule
time, so with PP several microbatches can be in flight; a request is never scheduled again
while one of its microbatches is in flight, except under async scheduling: a decode whose
step in flight samples one token runs ahead, scheduled again with a placeholder for that token
(engine/async_sched.py). When the KV pool is short the newest running request that is not in
flight is preempted (blocks freed, recomputed later). A request
aborted from outside (`finish_requests`) leaves its queue at once but keeps its blocks
until its microbatch in flight, if any, returns.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable

from engine.async_sched import PLACEHOLDER_TOKEN_ID
from engine.config import EngineConfig
from engine.faults import (ABORT_FREES_BLOCKS_IN_FLIGHT, SCHED_DRAFTS_OVER_BUDGET, SCHED_MAX_NUM_SEQS_OFF_BY_ONE,
                           SPEC_ROLLBACK_MISSING, FaultSet)
from engine.kv_cache import KVAccountingError, KVCacheManager
from engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sample.requests import check_stop
from engine.sample.sampling_params import DEFAULT, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"  # max_tokens reached
    FINISHED_STOPPED = "finished_stopped"  # a stop token id or stop sequence
    FINISHED_ABORTED = "finished_aborted"

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status in (RequestStatus.FINISHED, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED)


class Request:
    """Driver-side state of one request."""

    def __init__(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                 forced_token_ids: list[int] | None = None, cache_salt: str | None = None,
                 sampling_params: SamplingParams | None = None) -> None:
        self.req_id = req_id
        self.sampling_params = sampling_params or DEFAULT
        self.stop_reason: int | tuple[int, ...] | None = None  # what stopped it (FINISHED_STOPPED)
        self.prompt_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.forced_token_ids = forced_token_ids  # teacher forcing: appended instead of samples
        self.cache_salt = cache_salt  # prefix caching: blocks are shared only under an equal salt
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0  # tokens the ranks already know (drives new_token_ids)
        self.status = RequestStatus.WAITING
        self.num_in_flight = 0  # microbatches in flight that schedule it (2: one ran ahead)
        self.samples_in_flight = False  # its newest step in flight samples one token, no drafts
        self.num_output_placeholders = 0  # ahead steps in flight: tokens the ranks know as placeholders
        self.resend = False  # its ahead step was dropped: the ranks get its tokens again (NewRequestData)
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # drafts to verify at the next decode
        self.drafting = False  # the proposer had drafts for it last time: it waits, not runs ahead
        self.drop_next_output = False  # the output of its ahead step in flight is dropped

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens


class Scheduler:
    def __init__(self, cfg: EngineConfig, faults: FaultSet | None = None) -> None:
        self.cfg = cfg
        self.faults = faults or FaultSet()
        self.kv = KVCacheManager(cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching, self.faults,
                                 use_eagle=cfg.speculative_method == "eagle")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last: set[str] = set()
        self._preempted_since_last: set[str] = set()
        # Per microbatch in flight: the blocks of each of its requests, which its steps read
        # and write until it returns (check_accounting holds the requests to them).
        self._step_blocks: dict[int, dict[str, tuple[int, ...]]] = {}
        self._next_microbatch = 0
        self.num_preemptions = 0
        self.num_async_steps = 0  # microbatches in which a request ran ahead (async scheduling)
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

    def schedule(self, ahead: bool = False) -> SchedulerOutput | None:
        """Next microbatch, or None when nothing can be scheduled now. `ahead` (async
        scheduling): requests with a step in flight may run ahead of it."""
        num_sched: dict[str, int] = {}
        cached = CachedRequestData()
        spec: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        ran_ahead: set[str] = set()
        budget = self._schedule_running(self.cfg.max_num_batched_tokens, num_sched, cached, spec,
                                        new_reqs, ran_ahead if ahead and self.cfg.async_scheduling else None)
        new_reqs += self._schedule_waiting(budget, num_sched)
        if not num_sched:
            return None
        self._advance_scheduled(num_sched, spec, ran_ahead)
        self.num_async_steps += bool(ran_ahead)
        return self._emit(num_sched, new_reqs, cached, spec)

    def _may_run_ahead(self, req: Request) -> bool:
        """A request with a step in flight is scheduled again before that step returns when
        the step samples one token and nothing about the next step depends on which: one step
        in flight (no placeholder pending), no drafts (they would follow an unknown token),
        room for one more token under max_tokens (a stop token is only seen later: then the
        step is dropped), no output of its pending a drop, greedy without penalties
        (penalties count the unknown token; a random request's generator would draw for a
        step that teacher forcing may drop)."""
        p = req.sampling_params
        return (req.num_in_flight == 1 and req.samples_in_flight and not req.drafting and not req.drop_next_output
                and len(req.output_token_ids) + 2 <= req.max_tokens and p.is_greedy and not p.has_penalties)

    def _schedule_ahead(self, req: Request, budget: int, num_sched: dict[str, int],
                        cached: CachedRequestData, ran_ahead: set[str]) -> int:
        """The decode of the token req's step in flight samples, sent as a placeholder."""
        new_blocks = self._allocate_or_preempt(req, self._with_lookahead(req.num_computed_tokens + 1), num_sched)
        if new_blocks is None:
            return budget
        assert req.num_tokens_sent == req.num_tokens, (req.req_id, req.num_tokens_sent, req.num_tokens)
        num_sched[req.req_id] = 1
        ran_ahead.add(req.req_id)
        cached.req_ids.append(req.req_id)
        cached.new_token_ids.append([PLACEHOLDER_TOKEN_ID])
        cached.new_block_ids.append(new_blocks)
        cached.num_computed_tokens.append(req.num_computed_tokens)
        return budget - 1

    def _schedule_running(self, budget: int, num_sched: dict[str, int], cached: CachedRequestData,
                          spec: dict[str, list[int]], new_reqs: list[NewRequestData],
                          ran_ahead: set[str] | None) -> int:
        """Spend the budget on running requests first (decodes, prefill chunks, drafts to
        verify, steps ahead); return what is left of it."""
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:
                continue
            if req.in_flight:
                if ran_ahead is not None and self._may_run_ahead(req):
                    budget = self._schedule_ahead(req, budget, num_sched, cached, ran_ahead)
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            drafts = self._drafts_in_budget(req, budget) if n == req.num_tokens - req.num_computed_tokens == 1 else []
            n += len(drafts)
            new_blocks = self._allocate_or_preempt(req, self._with_lookahead(req.num_computed_tokens + n), num_sched)
            if new_blocks is None:
                continue
            num_sched[req.req_id] = n
            budget -= n
            req.spec_token_ids = []
            if drafts:
                spec[req.req_id] = drafts
            if req.resend:  # its ahead step was dropped: the ranks hold a placeholder it replaces
                new_reqs.append(NewRequestData(req.req_id, req.all_token_ids, list(self.kv.req_blocks[req.req_id]),
                                               req.num_computed_tokens, req.sampling_params))
                continue
            cached.req_ids.append(req.req_id)
            cached.new_token_ids.append(req.all_token_ids[req.num_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        return budget

    def _schedule_waiting(self, budget: int, num_sched: dict[str, int]) -> list[NewRequestData]:
        """Then admit waiting requests, in order, while the budget, max_num_seqs and the KV
        pool allow (a prompt over the budget only with chunked prefill)."""
        new_reqs: list[NewRequestData] = []
        while self.waiting and budget > 0 and self._room_to_admit():
            req = self.waiting[0]
            # A waiting request has computed nothing; a prefix-cache hit (never with caching
            # off) covers its first num_hit tokens, and chunking continues from there.
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if num_hit + n < req.num_tokens and not self.cfg.enable_chunked_prefill:
                break
            blocks = self.kv.allocate_slots(req.req_id, self._with_lookahead(num_hit + n), hit_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            num_sched[req.req_id] = n
            budget -= n
            new_reqs.append(NewRequestData(req.req_id, req.all_token_ids,
                                           list(self.kv.req_blocks[req.req_id]), num_hit, req.sampling_params))
        return new_reqs

    def _drafts_in_budget(self, req: Request, budget: int) -> list[int]:
        """The drafts a decode verifies: as many as the budget holds after its own token."""
        room = budget - 1 + (1 if self.faults.on(SCHED_DRAFTS_OVER_BUDGET) else 0)
        return req.spec_token_ids[:room]

    def _room_to_admit(self) -> bool:
        """max_num_seqs bounds the requests running at once, in this microbatch or any other
        in flight: the ranks hold each of them (a persistent-batch row apiece)."""
        limit = self.cfg.max_num_seqs + (1 if self.faults.on(SCHED_MAX_NUM_SEQS_OFF_BY_ONE) else 0)
        return len(self.running) < limit

    def _advance_scheduled(self, num_sched: dict[str, int], spec: dict[str, list[int]],
                           ran_ahead: set[str]) -> None:
        """num_computed_tokens advances at schedule time; the request is in flight until
        update_from_output. The blocks this microbatch fills with real tokens are cached now
        (drafts lie past num_tokens and never are): after this microbatch's admissions, so
        none of its own requests reads a block it writes (the FA contract's rule), while a
        later microbatch may hit them with this one still in flight on later PP stages. That
        is safe because every rank executes microbatches in submission order
        (engine/worker.py), so on each stage the writer's layers run before the reader's."""
        for rid in num_sched:
            req = self.requests[rid]
            req.num_computed_tokens += num_sched[rid]
            req.num_tokens_sent = req.num_tokens + (rid in ran_ahead)  # + the placeholder
            req.num_output_placeholders += rid in ran_ahead
            req.num_in_flight += 1
            req.samples_in_flight = req.num_computed_tokens >= req.num_tokens_sent and rid not in spec
            req.resend = False
            # Real tokens only: a placeholder's position is cached once its token is known.
            self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))

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
        self._step_blocks[out.microbatch] = {rid: tuple(self.kv.req_blocks[rid]) for rid in num_sched}
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

    def update_from_output(self, sched: SchedulerOutput, appended: dict[str, list[int]],
                           assumed: dict[str, int] | None = None) -> list[str]:
        """Append each sampled request's verified tokens, roll back rejected drafts (their
        positions were counted as computed at schedule time), return the ids that finished.
        `assumed`: the token the ranks sampled first per request, which a step run ahead of
        this one took for its placeholder."""
        finished = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests[rid]
            req.num_in_flight -= 1
            if RequestStatus.is_finished(req.status):
                if not req.in_flight:  # finished while in flight: held for its microbatches (_free_request)
                    self.kv.free(rid)
                continue
            if rid not in appended or req.status is not RequestStatus.RUNNING:
                continue
            toks, req.stop_reason = check_stop(req, appended[rid])
            self._rollback_rejected_drafts(req, sched.scheduled_spec_decode_tokens.get(rid, []), appended[rid])
            req.output_token_ids.extend(toks)
            if req.stop_reason is not None or req.is_finished:
                req.status = RequestStatus.FINISHED if req.stop_reason is None else RequestStatus.FINISHED_STOPPED
                self.running.remove(req)
                self._free_request(req)  # a step run ahead of this one is dropped when it returns
                finished.append(rid)
            elif req.in_flight:
                self._resolve_placeholder(req, toks[0], (assumed or {}).get(rid))
        self._step_blocks.pop(sched.microbatch, None)
        return finished

    def _resolve_placeholder(self, req: Request, token: int, assumed: int | None) -> None:
        """The token of req's step run ahead is known now. The ranks filled it with the token
        they sampled; where teacher forcing appended another, that step computed a sequence
        the request does not have: its output is dropped, its position recomputed, and the
        ranks get the request's tokens anew (NewRequestData), as after a rejected draft."""
        req.num_output_placeholders -= 1
        if token == assumed:
            return
        req.drop_next_output = True
        req.resend = True
        req.num_computed_tokens -= 1

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> list[str]:
        """Finish requests from outside the step loop (vLLM's finish_requests; an abort passes
        FINISHED_ABORTED): each leaves its queue at once, drops its pending drafts and samples
        no more. Unknown and already finished ids are ignored, as vLLM ignores them; returns
        the ids this call finished."""
        assert RequestStatus.is_finished(finished_status), finished_status
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None or RequestStatus.is_finished(req.status):
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:  # waiting: never admitted, or preempted and waiting to be recomputed
                self.waiting.remove(req)
            req.status = finished_status
            req.spec_token_ids = []
            self._free_request(req)
            done.append(rid)
        return done

    def _free_request(self, req: Request) -> None:
        """Tell the ranks to drop a finished request (next microbatch) and release its blocks,
        unless a microbatch in flight still holds it: with PP that step's later stages still
        read and write the blocks, so update_from_output releases them when it returns. Handed
        to another request before then, a block is written by two requests' steps at once
        (docs/bug_classes.md#abort_frees_blocks_in_flight)."""
        self._finished_since_last.add(req.req_id)
        if req.in_flight and not self.faults.on(ABORT_FREES_BLOCKS_IN_FLIGHT):
            return
        self.kv.free(req.req_id)

    def check_accounting(self) -> None:
        """The KV books balance (KVCacheManager.check_accounting), and each microbatch in
        flight finds the blocks it was scheduled with still held by their requests: a block
        released under it may be handed to another request while the step still runs."""
        self.kv.check_accounting()
        for req in self.running:  # a placeholder stands for the output of a step still in flight
            if not 0 <= req.num_output_placeholders <= max(0, req.num_in_flight - 1):
                raise KVAccountingError(f"request {req.req_id}: {req.num_output_placeholders} placeholder(s) "
                                        f"with {req.num_in_flight} step(s) in flight")
        for mb, held in self._step_blocks.items():
            for rid, blocks in held.items():
                now = self.kv.req_blocks.get(rid, [])
                for i, b in enumerate(blocks):
                    if i >= len(now) or now[i] != b:
                        raise KVAccountingError(f"block {b} of request {rid} was released while microbatch "
                                                f"{mb}, which reads and writes it, is still in flight")

    def _rollback_rejected_drafts(self, req: Request, drafts: list[int], appended: list[int]) -> None:
        """Positions computed at schedule time: the last token and every draft. Valid: the
        last token and the accepted drafts (all appended tokens but the bonus one)."""
        if not drafts or self.faults.on(SPEC_ROLLBACK_MISSING):
            return
        req.num_computed_tokens -= len(drafts) + 1 - len(appended)
