"""LLMEngine: the driver loop (scheduler, batch queue of in-flight microbatches, outputs).

With pp stages up to pp microbatches are in flight, as in vLLM's batch queue. Every
generated position leaves a `TokenRecord` (the logits row it was sampled from, the sampled
token and the token appended, which differs under teacher forcing), keyed by request and
output index: layouts batch differently, so positions, not steps, are what compare.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.config import ConfigError, EngineConfig
from engine.faults import FaultSet
from engine.poison import check_mode
from engine.schedule import Schedule
from engine.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from engine.spec_decode import NgramProposer, verify_greedy


class EngineInvariantError(AssertionError):
    """Ranks disagree, a request sampled when it should not have, or KV accounting broke."""


@dataclass(slots=True)
class TokenRecord:
    step: int
    microbatch: int
    logits: torch.Tensor  # fp32 [vocab]
    sampled: int
    token: int  # appended (== sampled unless teacher-forced)


@dataclass
class Trace:
    tokens: dict[str, list[TokenRecord]] = field(default_factory=dict)
    fa_records: list = field(default_factory=list)
    num_steps: int = 0
    num_preemptions: int = 0
    max_in_flight: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def output_token_ids(self) -> dict[str, list[int]]:
        return {rid: [t.token for t in recs] for rid, recs in self.tokens.items()}


class LLMEngine:
    def __init__(self, cfg: EngineConfig, record_fa: bool = False) -> None:
        self.cfg = cfg
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
        may lower the token budget and the KV block count below what the ranks were built
        for (so one engine serves Cases that differ only in scheduling limits)."""
        sc = scheduler_config or self.cfg
        if sc.max_num_batched_tokens > self.cfg.max_num_batched_tokens or sc.num_gpu_blocks > self.cfg.num_gpu_blocks:
            raise ConfigError("scheduler_config: budget or KV blocks exceed what the engine was built with")
        built, wanted = self.cfg.speculative_method, sc.speculative_method
        k_built, k_wanted = self.cfg.num_speculative_tokens, sc.num_speculative_tokens
        if "eagle" in (built, wanted) and (built != wanted or k_wanted > k_built):
            raise ConfigError(f"scheduler_config: speculative_method={wanted} on an engine built with {built}: "
                              f"the EAGLE head lives on the ranks, so it is chosen when the engine is built")
        self.scheduler = Scheduler(sc, FaultSet(faults))
        self.faults = tuple(faults)
        # N-gram drafting is driver-side, so the Case's config decides it, whatever the ranks
        # were built with; EAGLE drafts come from the last rank's runner (ModelRunnerOutput).
        self.spec_cfg = sc
        self.proposer = NgramProposer(sc.num_speculative_tokens) if sc.speculative_method == "ngram" else None
        self.in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()
        self.trace = Trace()
        self.step_count = 0
        self.executor.reset(schedule or Schedule(), tuple(faults), check_mode(poison))

    def add_request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                    forced_token_ids: list[int] | None = None) -> None:
        cfg = self.cfg
        if not prompt_token_ids:
            raise ConfigError(f"request {req_id}: empty prompt")
        if len(prompt_token_ids) + max_tokens > cfg.max_model_len:
            raise ConfigError(f"request {req_id}: prompt {len(prompt_token_ids)} + max_tokens "
                              f"{max_tokens} > max_model_len={cfg.max_model_len}")
        if max(prompt_token_ids) >= cfg.vocab_size or min(prompt_token_ids) < 0:
            raise ConfigError(f"request {req_id}: token id outside vocab_size={cfg.vocab_size}")
        if req_id in self.scheduler.requests:
            raise ConfigError(f"request {req_id}: duplicate id")
        self.scheduler.add_request(Request(req_id, prompt_token_ids, max_tokens, forced_token_ids))
        self.trace.tokens[req_id] = []

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def step(self) -> list[str]:
        """Fill the batch queue, finish the oldest microbatch; return finished request ids."""
        self.step_count += 1
        while len(self.in_flight) < self.cfg.pp:
            so = self.scheduler.schedule()
            if so is None:
                break
            expect = {rid for rid in so.num_scheduled_tokens
                      if self.scheduler.requests[rid].num_computed_tokens >= self.scheduler.requests[rid].num_tokens}
            self.executor.submit(so)
            self.in_flight.append((so, expect))
        self.trace.max_in_flight = max(self.trace.max_in_flight, len(self.in_flight))
        if not self.in_flight:
            if self.scheduler.has_unfinished():
                raise EngineInvariantError("scheduler stalled: unfinished requests but nothing schedulable")
            return []
        so, expect = self.in_flight.popleft()
        outs = self.executor.collect(so.microbatch)
        out = self._agreed_output(outs, so.microbatch)
        if set(out.req_ids) != expect:
            raise EngineInvariantError(f"microbatch {so.microbatch}: rank sampled {sorted(out.req_ids)}, "
                                       f"scheduler expected {sorted(expect)}")
        tokens, row = {}, 0
        for i, rid in enumerate(out.req_ids):
            req = self.scheduler.requests[rid]
            if out.num_tokens[rid] != req.num_tokens:
                raise EngineInvariantError(f"request {rid}: output rank knew {out.num_tokens[rid]} "
                                           f"tokens, driver {req.num_tokens}")
            argmax = out.sampled_token_ids[i]
            idx, forced = len(req.output_token_ids), req.forced_token_ids
            targets = [forced[idx + j] if forced is not None and idx + j < len(forced) else argmax[j]
                       for j in range(len(argmax))]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            tokens[rid] = verify_greedy(drafts, targets) if drafts else targets[:1]
            self.trace.num_draft_tokens += len(drafts)
            self.trace.num_accepted_tokens += len(tokens[rid]) - 1
            for j, tok in enumerate(tokens[rid][:req.max_tokens - idx]):
                self.trace.tokens[rid].append(TokenRecord(self.step_count, so.microbatch, out.logits[row + j],
                                                          argmax[j], tok))
            row += len(argmax)
        finished = self.scheduler.update_from_output(so, tokens)
        self.take_draft_token_ids(tokens, so, out)
        self.scheduler.kv.check_accounting()
        self.trace.num_steps = self.step_count
        self.trace.num_preemptions = self.scheduler.num_preemptions
        return finished

    def take_draft_token_ids(self, sampled: dict[str, list[int]], so: SchedulerOutput, out) -> None:
        """Drafts for the next decode of each request that just sampled. N-gram: looked up here
        over the verified tokens (it needs token ids only, and here they include teacher
        forcing, so every layout sees the same drafts). EAGLE: proposed by the last rank's
        runner from its hidden states (`GPUModelRunner.propose_draft_token_ids`) assuming its
        own greedy tokens; where teacher forcing appended other tokens they continue a
        different sequence, so they are dropped and that request decodes plainly once."""
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
                req.spec_token_ids = self.proposer.propose(req.all_token_ids, max_k=room)
                continue
            argmax, drafts = out.sampled_token_ids[i], so.scheduled_spec_decode_tokens.get(rid, [])
            assumed = verify_greedy(drafts, argmax) if drafts else argmax[:1]
            proposed = out.draft_token_ids.get(rid, []) if sampled[rid] == assumed else []
            req.spec_token_ids = proposed[:max(room, 0)]

    def _agreed_output(self, outs: dict, microbatch: int):
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
