"""LLMEngine: the driver loop (scheduler, batch queue of in-flight microbatches, outputs).

With pp stages up to pp microbatches are in flight, as in vLLM's batch queue. Every
generated position leaves a `TokenRecord` (the logits row it was sampled from, the sampled
token and the token appended, which differs under teacher forcing), keyed by request and
output index: layouts batch differently, so positions, not steps, are what compare.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from engine.attention.selector import get_attn_backend
from engine.config import ConfigError, EngineConfig
from engine.faults import ASYNC_QUEUE_DEPTH_IGNORED, FaultSet
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.poison import check_mode
from engine.sample.requests import (check_request_params, check_stop, fan_out, merge_prompt_logprobs,
                                    resolve_params, token_record_fields)
from engine.sample.sampling_params import DEFAULT, SamplingParams
from engine.sched_invariants import ScheduleLimits
from engine.schedule import Schedule, ScheduleDriver
from engine.scheduler import Request, RequestStatus, Scheduler
from engine.spec_decode import NgramProposer, verify_greedy


class EngineInvariantError(AssertionError):
    """Ranks disagree, a request sampled when it should not have, KV accounting broke, or a
    microbatch broke a scheduler limit (engine/sched_invariants.py)."""


@dataclass(slots=True)
class TokenRecord:
    step: int
    microbatch: int
    logits: torch.Tensor  # fp32 [vocab]
    sampled: int
    token: int  # appended (== sampled unless teacher-forced)
    # Requests with sampling params that record (SamplingParams.records_distribution):
    logprobs: torch.Tensor | None = None  # fp32 [vocab] processed distribution, -inf where masked
    noise: torch.Tensor | None = None  # fp32 [vocab] Exp(1) draw of a random sample (argmax p / noise)
    top_logprobs: dict[int, float] | None = None  # SamplingParams.logprobs asked for, sampled token included


@dataclass
class Trace:
    tokens: dict[str, list[TokenRecord]] = field(default_factory=dict)
    fa_records: list = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    max_in_flight: int = 0
    num_async_steps: int = 0  # microbatches in which a request ran ahead (async scheduling)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    aborted: dict[str, int] = field(default_factory=dict)  # request -> driver steps taken before its abort
    sampling_params: dict[str, SamplingParams] = field(default_factory=dict)  # requests with non-default ones
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)  # by prompt index
    stop_reasons: dict[str, int | tuple[int, ...]] = field(default_factory=dict)  # stop token id or sequence
    # N-gram drafts the proposer gave, as (request, tokens it looked at, draft): the harness
    # checks each against the rule (fuzz/verdict/oracles/drafts.py); a wrong draft is only
    # rejected, so the output tokens never show it.
    ngram_drafts: list[tuple[str, int, list[int]]] = field(default_factory=list)

    def output_token_ids(self) -> dict[str, list[int]]:
        return {rid: [t.token for t in recs] for rid, recs in self.tokens.items()}


class LLMEngine:
    def __init__(self, cfg: EngineConfig, record_fa: bool = False) -> None:
        self.cfg = cfg
        # Every rank's runner resolves the attention backend; resolving it here first makes a
        # backend this process cannot run (flash-attn not installed) a one-line ConfigError
        # before any rank starts.
        get_attn_backend(cfg)
        if cfg.world == "torch":
            from engine.dist_executor import DistExecutor
            self.executor = DistExecutor(cfg, record_fa)
        else:
            from engine.inline_executor import InlineExecutor, inline_possible
            if cfg.world_size == 1 and inline_possible():
                self.executor = InlineExecutor(cfg, record_fa)
            else:
                from engine.executor import InProcExecutor
                self.executor = InProcExecutor(cfg, record_fa)
        self.output_rank = (cfg.pp - 1) * cfg.tp  # last stage, tp rank 0
        self.reset()

    def reset(self, schedule: Schedule | None = None, faults: tuple[str, ...] = (),
              scheduler_config: EngineConfig | None = None, poison: str = "nan") -> None:
        """Forget every request; ranks poison their buffers and KV cache (`poison`: NaN or
        stale finite values, engine/poison.py). A scheduler_config
        may lower the token budget, the KV block count and max_num_seqs below what the ranks
        were built for (so one engine serves Cases that differ only in scheduling limits)."""
        sc = scheduler_config or self.cfg
        if (sc.max_num_batched_tokens > self.cfg.max_num_batched_tokens or sc.num_gpu_blocks > self.cfg.num_gpu_blocks
                or sc.max_num_seqs > self.cfg.max_num_seqs):
            raise ConfigError("scheduler_config: budget, KV blocks or max_num_seqs exceed what the engine was built with")
        built, wanted = self.cfg.speculative_method, sc.speculative_method
        k_built, k_wanted = self.cfg.num_speculative_tokens, sc.num_speculative_tokens
        if "eagle" in (built, wanted) and (built != wanted or k_wanted > k_built):
            raise ConfigError(f"scheduler_config: speculative_method={wanted} on an engine built with {built}: "
                              f"the EAGLE head lives on the ranks, so it is chosen when the engine is built")
        if sc.async_scheduling and not self.cfg.async_scheduling:
            raise ConfigError("scheduler_config: async_scheduling on an engine built without it "
                              "(its ranks keep sampled tokens for placeholders only when built with it)")
        self.fault_set = FaultSet(faults)
        self.scheduler = Scheduler(sc, self.fault_set)
        # The engine's own draws (run ahead or wait), seeded by the Schedule like the ranks'.
        self.async_driver = ScheduleDriver(schedule or Schedule())
        self.limits = ScheduleLimits(sc)  # the scheduler's limits, rechecked from its outputs alone
        self.faults = tuple(faults)
        # N-gram drafting is driver-side, so the Case's config decides it, whatever the ranks
        # were built with; EAGLE drafts come from the last rank's runner (ModelRunnerOutput).
        self.spec_cfg = sc
        self.proposer = NgramProposer(sc.num_speculative_tokens) if sc.speculative_method == "ngram" else None
        self.in_flight: deque[tuple[SchedulerOutput, dict[str, int]]] = deque()
        self.trace = Trace()
        self.step_count = 0
        self.executor.reset(schedule or Schedule(), tuple(faults), check_mode(poison))

    def add_request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                    forced_token_ids: list[int] | None = None, cache_salt: str | None = None,
                    sampling_params: SamplingParams | None = None) -> None:
        """`sampling_params` with n > 1 adds n child requests, f"{i}_{req_id}" (vLLM's parallel
        sampling); each is driven, forced and traced on its own."""
        cfg = self.cfg
        params, max_tokens = resolve_params(req_id, sampling_params, max_tokens)
        if not prompt_token_ids:
            raise ConfigError(f"request {req_id}: empty prompt")
        if len(prompt_token_ids) + max_tokens > cfg.max_model_len:
            raise ConfigError(f"request {req_id}: prompt {len(prompt_token_ids)} + max_tokens "
                              f"{max_tokens} > max_model_len={cfg.max_model_len}")
        if max(prompt_token_ids) >= cfg.vocab_size or min(prompt_token_ids) < 0:
            raise ConfigError(f"request {req_id}: token id outside vocab_size={cfg.vocab_size}")
        if req_id in self.scheduler.requests:
            raise ConfigError(f"request {req_id}: duplicate id")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ConfigError(f"request {req_id}: cache_salt must be a str or None, got {cache_salt!r}")
        check_request_params(cfg, self.spec_cfg, req_id, params)
        children = fan_out(req_id, params)
        dup = [rid for rid, _ in children if rid in self.scheduler.requests]
        if dup:
            raise ConfigError(f"request {req_id}: child id {dup[0]} is taken")
        for rid, p in children:
            self.scheduler.add_request(Request(rid, prompt_token_ids, max_tokens, forced_token_ids, cache_salt, p))
            self.limits.add_request(rid, len(prompt_token_ids), max_tokens)
            self.trace.tokens[rid] = []
            if p != DEFAULT:
                self.trace.sampling_params[rid] = p

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests between steps (vLLM's abort_request: finish_requests with
        FINISHED_ABORTED). Each samples no more tokens and leaves the scheduler now; its KV
        blocks return to the pool once no microbatch in flight uses them. Unknown and finished
        ids are ignored."""
        for rid in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self.trace.aborted[rid] = self.step_count
        self.scheduler.check_accounting()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def step(self, between: Callable[[], None] | None = None) -> list[str]:
        """Fill the batch queue, finish the oldest microbatch; return finished request ids.
        The queue holds a microbatch per PP stage; with async scheduling at least two, so that
        at pp1 the next step is scheduled, its decodes ahead of the one in flight, first.
        `between` runs once the queue is filled, before the oldest microbatch returns: what a
        client sends while the step runs (an abort of a request in flight)."""
        self.step_count += 1
        ahead = self.spec_cfg.async_scheduling and self.async_driver.schedule_ahead()
        depth, drained = self._queue_depth(ahead), False
        while len(self.in_flight) < depth:
            short = self.scheduler.kv.num_short_allocations
            so = self.scheduler.schedule(ahead=ahead)
            if so is None:
                drained = True
                break
            broken = self.limits.check(so, {r for s, _ in self.in_flight for r in s.num_scheduled_tokens},
                                       pool_short=self.scheduler.kv.num_short_allocations != short)
            if broken is not None:
                raise EngineInvariantError(f"scheduler limit: {broken}")
            # Requests that sample, and the tokens (placeholders included) the ranks know of each.
            expect = {rid: self.scheduler.requests[rid].num_tokens_sent for rid in so.num_scheduled_tokens
                      if self.scheduler.requests[rid].num_computed_tokens >= self.scheduler.requests[rid].num_tokens}
            self.executor.submit(so)
            self.in_flight.append((so, expect))
        shallow = self.limits.check_depth(len(self.in_flight), ahead, drained)
        if shallow is not None:
            raise EngineInvariantError(f"pipeline depth: {shallow}")
        self.trace.max_in_flight = max(self.trace.max_in_flight, len(self.in_flight))
        if between is not None:  # what arrives while the step runs (a client's abort)
            between()
        if not self.in_flight:
            if self.scheduler.has_unfinished():
                raise EngineInvariantError("scheduler stalled: unfinished requests but nothing schedulable")
            return []
        so, expect = self.in_flight.popleft()
        outs = self.executor.collect(so.microbatch)
        out = self._agreed_output(outs, so.microbatch)
        if set(out.req_ids) != set(expect):
            raise EngineInvariantError(f"microbatch {so.microbatch}: rank sampled {sorted(out.req_ids)}, "
                                       f"scheduler expected {sorted(expect)}")
        tokens, assumed = self._take_tokens(so, out, expect)
        merge_prompt_logprobs(self.trace.prompt_logprobs, out.prompt_logprobs)
        finished = self.scheduler.update_from_output(so, tokens, assumed)
        for rid in finished:
            if self.scheduler.requests[rid].stop_reason is not None:
                self.trace.stop_reasons[rid] = self.scheduler.requests[rid].stop_reason
        self.take_draft_token_ids(tokens, so, out)
        self.scheduler.check_accounting()
        self.trace.num_steps = self.step_count
        self.trace.num_preemptions = self.scheduler.num_preemptions
        self.trace.num_async_steps = self.scheduler.num_async_steps
        return finished

    def _queue_depth(self, ahead: bool) -> int:
        """Microbatches kept in flight: one per PP stage, and two at pp1 when a step is
        scheduled ahead (vLLM's max_concurrent_batches), so async scheduling overlaps."""
        if ahead and not self.fault_set.on(ASYNC_QUEUE_DEPTH_IGNORED):
            return max(self.cfg.pp, 2)
        return self.cfg.pp

    def _take_tokens(self, so: SchedulerOutput, out: ModelRunnerOutput,
                     expect: dict[str, int]) -> tuple[dict[str, list[int]], dict[str, int]]:
        """Each sampled request's appended tokens (traced), and the token its ranks sampled first."""
        tokens, assumed, row = {}, {}, 0
        for i, rid in enumerate(out.req_ids):
            req = self.scheduler.requests[rid]
            if out.num_tokens[rid] != expect[rid]:
                raise EngineInvariantError(f"request {rid}: output rank knew {out.num_tokens[rid]} "
                                           f"tokens, driver sent {expect[rid]}")
            argmax = out.sampled_token_ids[i]
            # Aborted or finished while in flight, or a step run ahead on a token teacher
            # forcing replaced (Scheduler._resolve_placeholder): its samples are dropped.
            if RequestStatus.is_finished(req.status) or req.drop_next_output:
                req.drop_next_output = False
                row += len(argmax)
                continue
            # Teacher forcing appends the forced token instead of the sample; the rank sampled
            # all the same (its generator advanced), so a forced run and the run it is forced
            # to follow consume randomness identically.
            idx, forced = len(req.output_token_ids), req.forced_token_ids
            targets = [forced[idx + j] if forced is not None and idx + j < len(forced) else argmax[j]
                       for j in range(len(argmax))]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens[rid] = verify_greedy(drafts, targets) if drafts else targets[:1]
            assumed[rid] = argmax[0]
            self.trace.num_draft_tokens += len(drafts)
            self.trace.num_accepted_tokens += len(tokens[rid]) - 1
            for j, tok in enumerate(check_stop(req, tokens[rid])[0]):
                self.trace.tokens[rid].append(TokenRecord(
                    self.step_count, so.microbatch, out.logits[row + j], argmax[j], tok,
                    **token_record_fields(out, row + j, argmax[j], req.sampling_params)))
            row += len(argmax)
        return tokens, assumed

    def take_draft_token_ids(self, sampled: dict[str, list[int]], so: SchedulerOutput,
                             out: ModelRunnerOutput) -> None:
        """Drafts for the next decode of each request that just sampled. N-gram: looked up here
        over the verified tokens (it needs token ids only, and here they include teacher
        forcing, so every layout sees the same drafts). EAGLE: proposed by the last rank's
        runner from its hidden states (`GPUModelRunner.propose_draft_token_ids`) assuming its
        own greedy tokens; where teacher forcing appended other tokens they continue a
        different sequence, so they are dropped and that request decodes plainly once. Under
        async scheduling so are the drafts of a request that ran ahead of this step."""
        method = self.spec_cfg.speculative_method
        if method == "none":
            return
        for i, rid in enumerate(out.req_ids):
            req = self.scheduler.requests[rid]
            if rid not in sampled or req.status is not RequestStatus.RUNNING:
                continue
            room = min(req.max_tokens - len(req.output_token_ids) - 1, self.spec_cfg.max_model_len - req.num_tokens,
                       self.spec_cfg.num_speculative_tokens)
            if method == "ngram":
                proposed = self.proposer.propose(req.all_token_ids, max_k=room)
                self.trace.ngram_drafts.append((rid, req.num_tokens, list(proposed)))
            else:
                argmax, drafts = out.sampled_token_ids[i], so.scheduled_spec_decode_tokens.get(rid, [])
                assumed = verify_greedy(drafts, argmax) if drafts else argmax[:1]
                proposed = out.draft_token_ids.get(rid, []) if sampled[rid] == assumed else []
                proposed = proposed[:max(room, 0)]
            # Async scheduling: a request that ran ahead already computes the position these
            # drafts follow, so they are dropped; one the proposer has drafts for waits for
            # its steps from then on (Scheduler._may_run_ahead), so speculation goes on.
            req.drafting = bool(proposed)
            req.spec_token_ids = [] if req.in_flight else proposed
            if not req.in_flight:
                self.limits.propose(rid, req.num_tokens, proposed)

    def _agreed_output(self, outs: dict, microbatch: int) -> ModelRunnerOutput:
        out = outs[self.output_rank]
        for rank, other in outs.items():
            if other is None or rank == self.output_rank:
                continue
            if other.draft_token_ids is not None and other.draft_token_ids != out.draft_token_ids:
                raise EngineInvariantError(f"microbatch {microbatch}: rank {rank} drafted {other.draft_token_ids} "
                                           f"but rank {self.output_rank} drafted {out.draft_token_ids}")
            if other.req_ids != out.req_ids or other.sampled_token_ids != out.sampled_token_ids:
                raise EngineInvariantError(
                    f"microbatch {microbatch}: rank {rank} sampled {dict(zip(other.req_ids, other.sampled_token_ids))} "
                    f"but rank {self.output_rank} sampled {dict(zip(out.req_ids, out.sampled_token_ids))}")
        return out

    def collect_fa_records(self) -> list:
        """Every rank's FA-call records since the last collection (the ranks drop theirs)."""
        return self.executor.fa_records()

    def shutdown(self) -> None:
        self.executor.shutdown()
