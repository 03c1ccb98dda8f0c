"""The scheduler's promised limits, checked on every SchedulerOutput before the ranks see it.

A scheduler that admits one request too many, spends one token past the budget or drafts
past a request's room usually computes the very same tokens: outputs stay bit-identical and
no output oracle can see it, yet the ranks were sized for the limits it broke (the persistent
batch has max_num_seqs rows, the staging buffers max_num_batched_tokens). So the driver holds
each SchedulerOutput to the limits itself.

`ScheduleLimits` shares no code or counters with the scheduler: it rebuilds what the ranks
know from the stream of SchedulerOutputs alone (which requests they hold, how many tokens
each has) plus each request's prompt length and max_tokens as it was added, and checks:
  - the requests the ranks hold at once (admitted, not yet finished or preempted, in any
    microbatch in flight) are at most max_num_seqs; every cached request scheduled is one of
    them;
  - the tokens of a microbatch, drafts included (as vLLM counts them), are at most
    max_num_batched_tokens, and total_num_scheduled_tokens is their sum;
  - no request is scheduled past max_model_len, nor past its own tokens but for drafts;
  - drafts follow a request's last token (a one-token decode), are at most
    num_speculative_tokens and leave room for the bonus token within max_tokens;
  - a decode verifies the drafts the proposer gave for its tokens (`propose`, from the
    driver), cut to the budget left after its own token: as many as fit, no fewer. Dropped
    or cut drafts compute the same tokens (greedy verification only accepts fewer), so no
    output oracle sees a scheduler that never verifies what was proposed. The budget left at
    a request is what the requests before it in the microbatch (the scheduler's order, which
    num_scheduled_tokens keeps) did not take: a request already scheduled is never preempted;
  - a request holds no more KV blocks than the furthest position it was scheduled to needs
    (with EAGLE's lookahead); an over-allocation computes the same tokens with fewer blocks
    left for the others;
  - the pipeline is kept full (`check_depth`, once the driver has filled its batch queue):
    a microbatch in flight per PP stage, and two at pp1 on a step scheduled ahead under
    async scheduling, unless the scheduler had nothing more to schedule. A shallower queue
    computes the same tokens in more steps (async scheduling that never overlaps);
  - the budget is not left idle: a microbatch with tokens to spare schedules every held
    request that has no step in flight, each for every token the ranks know of it, unless the
    KV pool turned an allocation down meanwhile (the driver says so, from the KV manager). A
    scheduler that wastes budget computes the same tokens in more steps, which no output
    oracle sees.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.outputs import SchedulerOutput


class ScheduleLimits:
    """Checks each SchedulerOutput against the scheduler config; `check` returns the first
    broken limit in words, or None."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.added: dict[str, tuple[int, int]] = {}  # request -> (prompt length, max_tokens)
        self.held: set[str] = set()  # requests the ranks hold now
        self.known: dict[str, int] = {}  # tokens the ranks know of each held request
        self.proposed: dict[str, tuple[int, list[int]]] = {}  # request -> (tokens seen, drafts)
        self.blocks: dict[str, int] = {}  # KV blocks the ranks know each held request has
        self.reached: dict[str, int] = {}  # the furthest position each was scheduled to
        # EAGLE's draft steps write KV past the scheduled tokens (the scheduler's lookahead).
        self.lookahead = cfg.num_speculative_tokens if cfg.speculative_method == "eagle" else 0

    def add_request(self, req_id: str, prompt_len: int, max_tokens: int) -> None:
        self.added[req_id] = (prompt_len, max_tokens)

    def propose(self, req_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The drafts proposed for the request's first `num_tokens` tokens, for its next decode."""
        self.proposed[req_id] = (num_tokens, list(drafts))

    def check(self, so: SchedulerOutput, in_flight: frozenset[str] | set[str] = frozenset(),
              pool_short: bool = False) -> str | None:
        """`in_flight`: the requests of the microbatches still in flight besides this one;
        `pool_short`: the KV pool turned an allocation down while this microbatch was planned."""
        mb = f"microbatch {so.microbatch}"
        starts = self._update_held(so)
        if isinstance(starts, str):
            return f"{mb}: {starts}"
        if len(self.held) > self.cfg.max_num_seqs:
            return (f"{mb}: the ranks hold {len(self.held)} requests ({', '.join(sorted(self.held))}), "
                    f"more than max_num_seqs={self.cfg.max_num_seqs}")
        counts = so.num_scheduled_tokens
        if set(counts) != set(starts):
            return f"{mb}: scheduled {sorted(counts)} but shipped {sorted(starts)}"
        total = sum(counts.values())
        if total != so.total_num_scheduled_tokens:
            return f"{mb}: total_num_scheduled_tokens={so.total_num_scheduled_tokens}, its requests sum to {total}"
        if total > self.cfg.max_num_batched_tokens:
            return f"{mb}: {total} tokens scheduled, more than max_num_batched_tokens={self.cfg.max_num_batched_tokens}"
        used = 0
        for rid, n in counts.items():
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            problem = (self._check_request(rid, starts[rid], n, drafts)
                       or self._check_proposal(rid, starts[rid], n, drafts, self.cfg.max_num_batched_tokens - used))
            if problem:
                return f"{mb}: request {rid}: {problem}"
            used += n
            problem = self._check_blocks(rid, starts[rid] + n)
            if problem:
                return f"{mb}: request {rid}: {problem}"
        idle = None if pool_short else self._check_work_conserving(so, starts, in_flight)
        return f"{mb}: {idle}" if idle else None

    def check_depth(self, in_flight: int, ahead: bool, drained: bool) -> str | None:
        """`in_flight`: microbatches in flight once the driver filled its queue; `ahead`: this
        step schedules ahead (async scheduling); `drained`: the scheduler's last answer was
        that nothing more can be scheduled now."""
        depth = max(self.cfg.pipeline_parallel_size, 2 if ahead else 1)
        if in_flight < depth and not drained:
            why = " (async scheduling, a step scheduled ahead)" if ahead else ""
            return (f"{in_flight} microbatch(es) in flight, the pipeline holds {depth}{why}, "
                    f"and the scheduler was not asked for more")
        return None

    def _check_work_conserving(self, so: SchedulerOutput, starts: dict[str, int], in_flight) -> str | None:
        """Running requests come first and the budget goes to them until it runs out: a held
        request with no step in flight always has a token to compute (its last sampled one, or
        the rest of its prompt), so with budget left over it is scheduled, and for all the
        tokens the ranks know of it. A step in flight is the only excuse (a short KV pool is
        excused by the caller, `check`'s pool_short)."""
        left = self.cfg.max_num_batched_tokens - so.total_num_scheduled_tokens
        if left <= 0:
            return None
        for rid, n in so.num_scheduled_tokens.items():
            want = self.known[rid] - starts[rid]
            if n - len(so.scheduled_spec_decode_tokens.get(rid, ())) < want:
                return (f"request {rid} was scheduled {n} of its {want} tokens to compute, with {left} tokens of "
                        f"max_num_batched_tokens={self.cfg.max_num_batched_tokens} left over")
        idle = sorted(self.held - set(so.num_scheduled_tokens) - set(in_flight) - so.preempted_req_ids)
        if idle:
            return (f"request {idle[0]} has no step in flight and was not scheduled, with {left} tokens of "
                    f"max_num_batched_tokens={self.cfg.max_num_batched_tokens} left over")
        return None

    def _check_proposal(self, rid: str, start: int, n: int, drafts: list[int], left: int) -> str | None:
        seen, proposed = self.proposed.pop(rid, (-1, []))
        if not proposed or seen != self.known[rid] or start + 1 != seen or n - len(drafts) != 1:
            return None  # nothing proposed for this decode (or not a decode: a recompute after preemption)
        want = proposed[:max(0, left - 1)]
        if list(drafts) != want:
            return (f"verifies drafts {list(drafts)} at its decode; the proposer gave {proposed} and {left} tokens "
                    f"of the budget were left, so {want}")
        return None

    def _check_blocks(self, rid: str, end: int) -> str | None:
        """No more KV blocks than the furthest position scheduled needs (its lookahead
        included, within max_model_len): a block past it is taken from every other request.
        Rejected drafts keep their blocks, so the furthest position ever, not the current one."""
        cfg = self.cfg
        self.reached[rid] = max(self.reached.get(rid, 0), end)
        need = -(-min(self.reached[rid] + self.lookahead, cfg.max_model_len) // cfg.block_size)
        if self.blocks[rid] > need:
            return (f"holds {self.blocks[rid]} KV blocks; position {self.reached[rid]} (+{self.lookahead} "
                    f"lookahead) needs {need} of {cfg.block_size} tokens")
        return None

    def _update_held(self, so: SchedulerOutput) -> dict[str, int] | str:
        """Apply the microbatch to the ranks' view (drops first: a request finished or
        preempted may be readmitted in the same microbatch); return each scheduled request's
        computed tokens before this step."""
        self.held -= so.finished_req_ids | so.preempted_req_ids
        # A proposal is for a running request's next decode. Preempted, a request is readmitted
        # as a new one, which verifies no drafts (as in vLLM): a prefix-cache hit up to its
        # last token makes that readmission look like the decode the proposal was for.
        for rid in so.preempted_req_ids:
            self.proposed.pop(rid, None)
        starts: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:  # (re)admitted: its whole block list, from scratch
            self.held.add(nr.req_id)
            self.known[nr.req_id] = len(nr.token_ids)
            starts[nr.req_id] = nr.num_computed_tokens
            self.blocks[nr.req_id], self.reached[nr.req_id] = len(nr.block_ids), 0
        c = so.scheduled_cached_reqs
        for rid, new_ids, new_blocks, start in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            if rid not in self.held or rid in starts:
                return f"request {rid} is scheduled as cached but the ranks do not hold it"
            self.known[rid] += len(new_ids)
            self.blocks[rid] += len(new_blocks)
            starts[rid] = start
        return starts

    def _check_request(self, rid: str, start: int, n: int, drafts: list[int]) -> str | None:
        cfg, known = self.cfg, self.known[rid]
        if n < 1:
            return f"{n} tokens scheduled"
        if start + n > cfg.max_model_len:
            return f"computed {start} + scheduled {n} > max_model_len={cfg.max_model_len}"
        if start + n - len(drafts) > known:
            return f"scheduled up to position {start + n - len(drafts)} of its {known} tokens (drafts aside)"
        if not drafts:
            return None
        if n - len(drafts) != 1 or start + 1 != known:
            return f"{len(drafts)} drafts on a step that is not a one-token decode at the end (computed {start}, " \
                   f"{n} scheduled, {known} tokens)"
        prompt_len, max_tokens = self.added[rid]
        room = min(cfg.num_speculative_tokens, max_tokens - (known - prompt_len) - 1)
        if len(drafts) > room:
            return f"{len(drafts)} drafts, room for {room} (num_speculative_tokens={cfg.num_speculative_tokens}, " \
                   f"{known - prompt_len} of max_tokens={max_tokens} generated)"
        return None
