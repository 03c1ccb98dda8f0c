"""Hypothesis strategies for Cases. Every toggle shrinks open: tp1pp1, eager, no chunking,
one request, short prompts, no arrivals, natural schedule, no preemption pressure, prefix
caching off, no shared prefixes, no cache salts, default sampling params, no aborts.

Model shapes are few and fixed (`FUZZ_MODEL`) so engines are reused across examples.
Prompt tokens come from a drawn seed: the length is what matters for batching bugs and it
shrinks directly; the reproducer still stores every token id.
"""
from __future__ import annotations

import random

from dataclasses import replace

from hypothesis import event, strategies as st

from engine.config import EngineConfig, parse_layout
from engine.poison import POISON_MODES
from engine.sample.sampling_params import SamplingParams
from engine.schedule import Schedule
from fuzz.cases import drafting
from fuzz.cases.case import Case, RequestSpec, Workload, steps_to_finish
from fuzz.cases.limits import (AT_END, AT_END_MAX_LEN, DRAFT_EDGE, FULL_BATCH, KV_POOL, MAX_SPEC_TOKENS, SAMPLED_CHUNKED,
                          SPEC_K, TILE_ROWS, TINY_BUDGETS, draft_edge, full_batch, kv_pool, limits_reached,
                          mid_block_plan, mid_block_prefix_class, sampled_chunked, spec_tokens, tiny_budget)

# 8 layers (pp8, uneven pp3), 8 query heads and 2 kv heads (tp8 replicates kv heads).
FUZZ_MODEL = EngineConfig(
    vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=2, head_dim=8, intermediate_size=128, block_size=4,
    num_gpu_blocks=96, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)

# Simplest first: Hypothesis shrinks sampled_from toward the front.
DEFAULT_LAYOUTS = ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp1pp4", "tp2pp4", "tp1pp8",
                   "tp4pp2", "tp8pp1", "tp1pp3", "tp2pp3", "tp4pp1")
# Campaigns visit layouts round robin in this order: the field's trouble spots come early.
# (uneven splits and tp x pp mixes come before the plain ones).
CAMPAIGN_ORDER = ("tp1pp1", "tp2pp4", "tp1pp8", "tp1pp3", "tp2pp2", "tp1pp2", "tp4pp2", "tp8pp1",
                  "tp2pp1", "tp2pp3", "tp1pp4", "tp4pp1")
MODES = ("eager", "graph")
IMPLEMENTED_MODES = ("eager", "graph")
# One Case in eight runs long prompts (up to 256 tokens, chunks up to 256): past the 64- and
# 128-row tiles of FlashAttention's launch, so an understated max_seqlen_q changes logits
# there, as on a GPU, instead of only tripping the invariant check.
LONG = dict(max_model_len=512, budgets=(256, 64, 16), blocks=(192, 129), capture_sizes=(4, 8, 16, 32, 128, 256))


def prompt_lengths(cfg: EngineConfig) -> st.SearchStrategy[int]:
    """Short lengths, plus lengths on either side of block, budget, attention-tile and (in
    graph mode) CUDA-graph capture-size boundaries."""
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    sizes = cfg.capture_sizes if cfg.cudagraph_mode != "NONE" else ()
    edges = sorted({n for k in (1, 2, 3) for n in (k * bs - 1, k * bs, k * bs + 1)}
                   | {budget - 1, budget, budget + 1, 2 * budget + 1}
                   | {t + d for t in TILE_ROWS for d in (-1, 0, 1)} | {n for s in sizes for n in (s, s + 1)})
    edges = [n for n in edges if 1 <= n <= cfg.max_model_len // 2]
    # No edge fits when a block and the budget are past half of max_model_len (vLLM's block
    # 128 with a 128-token budget and max_model_len): then only the plain ranges.
    edge = (st.sampled_from(edges),) if edges else ()
    return st.one_of(st.integers(1, 12), *edge, st.integers(1, cfg.max_model_len // 2))


def tokens_from_seed(seed: int, length: int, vocab: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(length))


REPETITIVE_ALPHABET = 3  # prompts over a few token ids repeat n-grams: drafts exist


@st.composite
def request_specs(draw, cfg: EngineConfig, sampling: bool = False) -> RequestSpec:
    """One request: prompt around block/budget edges, a few output tokens, maybe late; with
    `sampling`, maybe sampling params (`sampled_requests`; drawn with the request, so a
    shrink that drops the request drops them too)."""
    length = draw(prompt_lengths(cfg))
    seed = draw(st.integers(0, 2 ** 16))
    alphabet = draw(st.sampled_from((cfg.vocab_size, REPETITIVE_ALPHABET)))
    max_tokens = draw(st.integers(1, min(8, cfg.max_model_len - length)))
    arrival = draw(st.one_of(st.just(0), st.integers(1, 6)))
    r = RequestSpec(tokens_from_seed(seed, length, alphabet), max_tokens, arrival)
    return draw(sampled_requests(cfg, r)) if sampling else r


# How a request of a prefix-sharing workload relates to the others; "own" (first: what a
# shrink leaves) shares nothing. "branch": the shared prefix, then the request's own prompt;
# "prefix": the shared prefix alone (a whole-prompt hit when another got there first);
# "twin": the previous request's prompt again, arriving with it (its hits land on blocks
# still being prefilled, chunk by chunk); "repeat": the previous request's prompt again,
# arriving once that one has likely finished, so the hit lands on blocks the pool holds
# free (ref count 0) but still cached; "turn": the next turn of a conversation, the previous
# request's prompt and more of its own, arriving once that one has likely finished (turns of
# turns grow a prefix of many blocks, as chat does).
SHARING = ("own", "branch", "prefix", "twin", "repeat", "turn")
# Blocks of this many tokens or more (vLLM's 16-128, against our engine's 4) hold a shared
# prefix in one to three blocks, and one unrelated ("own") request of a hundred tokens outweighs
# them: drawn one request in six, they held the share a prefix cache could serve in vLLM's
# caching cells at 0.16-0.45 (0.35-0.47 without them). There each sharing kind is drawn twice as
# often, so "own" is one request in eleven; it still shrinks first.
BIG_BLOCK = 16
SHARING_BIG_BLOCKS = SHARING[:1] + SHARING[1:] * 2
# Few salts, so equal prompts under different salts meet often; None (unsalted) shrinks first.
CACHE_SALTS = (None, "a", "b")


def prefix_lengths(cfg: EngineConfig) -> st.SearchStrategy[int]:
    """Shared-prefix lengths on, one under and one over the first block edges (a hit ends on
    a block edge), and around the token budget (a system prompt longer than a chunk: the
    first chunk ends inside a shared block), plus plain lengths; at most half of max_model_len,
    so a branch of it still fits, or a block and a half where that is longer (vLLM's block of
    64 at max_model_len 128), so that a prefix can fill a block and still hit."""
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    cap = max(1, cfg.max_model_len // 2, min(bs + bs // 2, cfg.max_model_len - 8))
    # Each edge on, one over, then one under: Hypothesis draws a list's first entry most often,
    # and one under the first block (ascending order's first) can never hit; it was 21 of 39
    # prefixes drawn for vLLM's blocks of 64.
    edges = [n for e in [k * bs for k in (1, 2, 3)] + [budget + k for k in (0, bs)] for n in (e, e + 1, e - 1)]
    # Shorter than a block less one, a prefix shares nothing (vLLM's budget of 16 with blocks
    # of 64): only the first block's own edges stay under it.
    edges = list(dict.fromkeys(n for n in edges if max(1, bs - 1) <= n <= cap))
    # The plain range starts at a block: a shorter prefix shares no KV.
    return st.one_of(*((st.sampled_from(edges),) if edges else ()), st.integers(min(bs, cap), cap))


def cache_salts(draw, cfg: EngineConfig) -> st.SearchStrategy[str | None]:
    """Each request's salt, with prefix caching on, in two workloads in three (salted requests
    share only with their own salt, so not always); None otherwise."""
    salted = cfg.enable_prefix_caching and draw(st.sampled_from((False, True, True)))
    return st.sampled_from(CACHE_SALTS) if salted else st.just(None)


@st.composite
def shared_workloads(draw, cfg: EngineConfig, max_requests: int = 10, sampling: bool = False) -> Workload:
    """Requests that share prefixes: a system prompt several of them start with (branches,
    and the prompt alone; in a burst, arriving together), exact repeats arriving with the
    first or after it finished, the next turns of a conversation, prompts on and around block
    and chunk edges, and, with prefix caching on, cache salts from a tiny set (equal tokens
    under different salts must not share KV). Every choice shrinks to "own", no burst, two
    requests and an unsalted request, i.e. to the plain workloads."""
    # The class of docs/bug_classes.md#prefix_hit_mid_block_counted_full, in two of these
    # workloads in three where the budget allows (`mid_block_plan`): a system prompt through
    # the block the first prefill chunk ends inside, its requests in a burst at step 0 (after
    # a short request that ends the chunk inside a block, where the budget is a multiple of it).
    plan = mid_block_plan(cfg)
    mid_block = draw(st.sampled_from((False, True, True))) and plan is not None
    plen = draw(prefix_lengths(cfg))  # drawn either way: switching the class off moves no later choice
    plen = plan[1] if mid_block else plen
    prefix = tokens_from_seed(draw(st.integers(0, 2 ** 16)), plen,
                              draw(st.sampled_from((cfg.vocab_size, REPETITIVE_ALPHABET))))
    salts = cache_salts(draw, cfg)
    # A burst: the requests that start with the system prompt arrive together, at the first
    # one's step, so later ones hit blocks whose prefill is still in flight.
    burst = draw(st.booleans()) or mid_block
    # How many: two to eight (or max_requests), uniform, shrinking to two (sharing needs two). A
    # list's own size is mostly one or two, and the first request of a prefix never hits: so few
    # sharers kept the prefix cache's hit rate in vLLM's cells under 0.2 (eight: vLLM's max_num_seqs).
    n = draw(st.integers(min(2, max_requests), min(8, max_requests)))
    sharing = SHARING_BIG_BLOCKS if cfg.block_size >= BIG_BLOCK else SHARING
    drawn = draw(st.lists(st.tuples(request_specs(cfg, sampling), st.sampled_from(sharing), salts),
                          min_size=n, max_size=n))
    reqs: list[RequestSpec] = []
    kinds = [k for _, k, _ in drawn]
    burst_step = 0 if mid_block else None
    for r, kind, salt in drawn:
        params = r.sampling
        if kind in ("twin", "repeat", "turn") and reqs:
            src = reqs[-1]
            later = steps_to_finish(src, cfg) + r.arrival_step if kind != "twin" else 0
            tokens = src.prompt_token_ids + (r.prompt_token_ids if kind == "turn" else ())
            tokens = tokens[:max(len(src.prompt_token_ids), cfg.max_model_len - r.max_tokens)]
            r = RequestSpec(tokens, min(r.max_tokens, cfg.max_model_len - len(tokens)), src.arrival_step + later)
            # The same prompt again: by the same user (its salt) unless another salt is drawn.
            salt = src.cache_salt if salt is None else salt
        elif kind != "own":
            # Unsalted by draw, a user of the system prompt takes its first user's salt: a
            # salt is a tenant, and one tenant's requests share (a different salt drawn is another tenant).
            first = next((q.cache_salt for q, k in zip(reqs, kinds) if k in ("branch", "prefix")), None)
            salt = first if salt is None else salt
            tokens = prefix + (r.prompt_token_ids if kind == "branch" else ())
            if burst:
                burst_step = r.arrival_step if burst_step is None else burst_step
            r = RequestSpec(tokens[:cfg.max_model_len - r.max_tokens], r.max_tokens,
                            r.arrival_step if burst_step is None else burst_step)
        reqs.append(RequestSpec(r.prompt_token_ids, r.max_tokens, r.arrival_step, salt, fit(params, r.max_tokens)))
    if mid_block and sum(k in ("branch", "prefix") for k in kinds) < 2 and len(reqs) + 2 <= max_requests:
        # The class needs two requests of the system prompt: the prompt alone, arriving with them.
        salt = next((q.cache_salt for q, k in zip(reqs, kinds) if k in ("branch", "prefix")), None)
        reqs.append(RequestSpec(prefix, min(2, cfg.max_model_len - plen), 0, salt))
        kinds.append("prefix")
    if sum(k in ("branch", "prefix") for k in kinds) >= 2:
        event("shared prefix")
    if "twin" in kinds[1:]:
        event("concurrent repeat")
    if "repeat" in kinds[1:]:
        event("repeat after finish")
    if "turn" in kinds[1:]:
        event("next turn")
    if len({r.cache_salt for r in reqs}) > 1:
        event("mixed cache salts")
    room = len(reqs) < max_requests  # never more requests than asked for
    lead = (RequestSpec(tokens_from_seed(plen, plan[0], cfg.vocab_size), 1),) if mid_block and plan[0] and room else ()
    return Workload(lead + tuple(reqs))


@st.composite
def workloads(draw, cfg: EngineConfig, max_requests: int = 10, sampling: bool = False) -> Workload:
    """Mixes of prefill, decode and chunked prefill; arrivals while others run. Often, and
    mostly when the config caches prefixes, requests share prefixes (`shared_workloads`).
    `sampling`: requests may have sampling params (`sampled_requests`; our engine's Cases:
    a target without them, vLLM's, draws the workloads it always drew). In one workload in four a
    request ends at max_model_len or one short (`at_end`); two in seven are filled up to
    max_num_seqs requests arriving together, or one more (`full_batch`). With n-gram drafting,
    two workloads in three get one or two requests whose drafts are accepted
    (`drafting.add_requests`)."""
    # Drawn first and always, each shrinks off on its own: a request at max_model_len (which
    # one: an index the workload's length wraps), a full batch, self-drafting requests (which
    # prompts: a pick the stored ones wrap; they join n-gram Cases only, so a config shrunk to
    # plain decoding moves no choice).
    end, which, fill = draw(st.sampled_from(AT_END)), draw(st.integers(0, max_requests - 1)), draw(st.sampled_from(FULL_BATCH))
    drafted, pick = draw(st.sampled_from(drafting.REQUESTS)), draw(st.integers(0, 2 ** 16))
    drafts_full, drafts_short = draw(st.sampled_from(drafting.FULL)), draw(st.integers(1, drafting.MAX_TOKENS))
    if draw(st.sampled_from((False,) + (True,) * 7 if cfg.enable_prefix_caching else (False,) * 3 + (True,))):
        wl = draw(shared_workloads(cfg, max_requests, sampling))
    else:
        reqs = draw(st.lists(request_specs(cfg, sampling), min_size=1, max_size=max_requests))
        if cfg.enable_prefix_caching:
            salts = cache_salts(draw, cfg)
            reqs = [replace(r, cache_salt=draw(salts)) for r in reqs]
        wl = Workload(tuple(reqs))
    # After at_end, which would lengthen or cut a stored prompt (and so change its continuation).
    wl = drafting.add_requests(at_end(wl, cfg, end, which), cfg, drafted, pick, max_requests,
                               drafting.MAX_TOKENS if drafts_full else drafts_short)
    return full_batch(wl, cfg, fill, max_requests)


def at_end(wl: Workload, cfg: EngineConfig, end: str, which: int) -> Workload:
    """`wl` with request `which % len` lengthened (or cut) so that its prompt plus max_tokens
    is max_model_len ("at") or one short of it; as is for "no", or where max_model_len is
    past AT_END_MAX_LEN."""
    if end == "no" or cfg.max_model_len > AT_END_MAX_LEN:
        return wl
    reqs = list(wl.requests)
    i = which % len(reqs)
    p, want = reqs[i].prompt_token_ids, cfg.max_model_len - reqs[i].max_tokens - (end == "one short")
    reqs[i] = replace(reqs[i], prompt_token_ids=(p + tokens_from_seed(len(p), want - len(p), cfg.vocab_size))[:want])
    return Workload(tuple(reqs))


@st.composite
def sampling_params(draw, cfg: EngineConfig, r: RequestSpec) -> SamplingParams | None:
    """None (plain greedy, as before sampling existed) for one request in two; else some of:
    random sampling (temperature, top-k/p, min-p, seed, n > 1; only without speculative
    decoding, whose verification is greedy), penalties (greedy too, so n-gram drafting's
    multi-token rows make reorder_batch swap penalised rows), a logit bias, stops (tokens and
    sequences of the prompt, so they are met; min_tokens), top logprobs, prompt logprobs. Each
    group shrinks off, each value toward the first of its list."""
    # One request in two: the Cases a per-row sampling bug needs take two requests with params
    # batched together, with random sampling and chunked prefill (no speculation) or with
    # penalties behind a drafting row (speculation); at one in three they were a few percent.
    if not draw(st.sampled_from((False, True))):
        return None
    V, kw = cfg.vocab_size, {}
    may_sample_at_random = cfg.speculative_method == "none"
    if may_sample_at_random and draw(st.sampled_from((False, True, True))):
        kw.update(temperature=draw(st.sampled_from((1.0, 0.5, 2.0))), top_k=draw(st.sampled_from((0, 5, 40))),
                  top_p=draw(st.sampled_from((1.0, 0.9, 0.5))), min_p=draw(st.sampled_from((0.0, 0.05))),
                  seed=draw(st.integers(0, 2 ** 16)) if draw(st.sampled_from((False, True, True))) else None,
                  n=draw(st.sampled_from((1, 1, 2, 3))))
    # Penalties for two of three such requests where drafting rows are what reorders the batch.
    if draw(st.sampled_from((False, True) if may_sample_at_random else (False, True, True))):
        kw.update(frequency_penalty=draw(st.sampled_from((0.5, 1.5, -0.5, 0.0))),
                  presence_penalty=draw(st.sampled_from((0.0, 0.4, -1.0))),
                  repetition_penalty=draw(st.sampled_from((1.0, 1.3, 0.8))))
    if draw(st.sampled_from((False, False, True))):
        kw["logit_bias"] = draw(st.dictionaries(st.integers(0, V - 1), st.sampled_from((5.0, -5.0, 100.0, -100.0)),
                                                min_size=1, max_size=3))
    if draw(st.sampled_from((False, False, True))):
        seen = st.sampled_from(r.prompt_token_ids)
        kw["stop_token_ids"] = tuple(draw(st.lists(seen, min_size=1, max_size=2, unique=True)))
        start = draw(st.integers(0, len(r.prompt_token_ids) - 1))
        kw["stop_sequences"] = (r.prompt_token_ids[start:start + draw(st.integers(1, 2))],)
        kw["min_tokens"] = draw(st.integers(0, r.max_tokens))
    if draw(st.sampled_from((False, False, True))):
        kw["logprobs"] = draw(st.integers(0, 5))
    if draw(st.sampled_from((False,) * 5 + (True,))):
        kw["prompt_logprobs"] = draw(st.integers(0, 3))
    return SamplingParams(**kw)


def fit(params: SamplingParams | None, max_tokens: int) -> SamplingParams | None:
    """`params` for a request whose max_tokens a workload lowered: min_tokens no more than it."""
    return replace(params, min_tokens=max_tokens) if params is not None and params.min_tokens > max_tokens else params


@st.composite
def sampled_requests(draw, cfg: EngineConfig, r: RequestSpec) -> RequestSpec:
    """`r`, maybe with sampling params (`sampling_params`); a random-sampling prompt that fits
    the token budget is often lengthened past it, so its prefill is chunked (a step that
    samples nothing for it). Shrinks to `r` as it was."""
    params = draw(sampling_params(cfg, r))
    if params is None:
        return r
    budget, room = cfg.max_num_batched_tokens, cfg.max_model_len - r.max_tokens
    if not params.is_greedy and len(r.prompt_token_ids) <= budget < room and draw(st.sampled_from((False, True, True))):
        extra = min(room, budget + draw(st.integers(1, 8))) - len(r.prompt_token_ids)
        r = replace(r, prompt_token_ids=r.prompt_token_ids + tokens_from_seed(len(r.prompt_token_ids), extra,
                                                                              cfg.vocab_size))
    return replace(r, sampling=params)


@st.composite
def aborts(draw, cfg: EngineConfig, wl: Workload) -> Workload:
    """In three Cases in seven with pp >= 2 (one in seven with pp 1) one request is aborted, a
    few driver steps after its arrival, between steps or while a step runs (`ABORT_TIMES`).
    Shrinks to no abort, else to the first request, one step after its arrival, between steps. (Hypothesis draws the
    early entries of a list more often: with two in seven, 8.5 % of drawn Cases had an abort
    with pp >= 2, too few for docs/bug_classes.md#abort_frees_blocks_in_flight.)"""
    if not draw(st.sampled_from((False,) * 4 + (True,) * 3 if cfg.pipeline_parallel_size > 1 else (False,) * 6 + (True,))):
        return wl
    reqs = list(wl.requests)
    i = draw(st.integers(0, len(reqs) - 1))
    offset, in_step = draw(st.sampled_from(ABORT_TIMES))
    reqs[i] = replace(reqs[i], abort_step=reqs[i].arrival_step + offset, abort_in_step=in_step)
    return Workload(tuple(reqs))


# When an abort lands, as (driver steps after the request's arrival, in step): between steps
# first (what a shrink leaves; step 0: before the request's first step, never in flight), then
# while the step runs (RequestSpec.abort_in_step), when whatever the step scheduled of the
# request is in flight in every layout: between steps only PP microbatches or an async step
# ahead can be, so docs/bug_classes.md#abort_frees_blocks_in_flight was caught in 1.7 % of
# tp1pp2 Cases and never at pp 1 without async scheduling.
ABORT_TIMES = tuple((k, False) for k in (1, 2, 3, 4, 0, 6, 9)) + tuple((k, True) for k in (1, 2, 0, 3))


@st.composite
def schedules(draw) -> Schedule:
    """Rank interleaving and copy landing; shrinks to natural order with copies at once.

    A non-default schedule exists to open race windows, and a host-side race needs both a
    copy still in flight and host work done meanwhile: so its copies are always delayed and
    the host usually runs ahead. (Drawing each at random from 0 up made both non-zero in one
    draw in four, and the staging-buffer race of docs/bug_classes.md#pp_shared_staging_buffer
    rare.)"""
    if not draw(st.booleans()):
        return Schedule()
    return Schedule(seed=draw(st.integers(0, 2 ** 16)),
                    rank_order=draw(st.sampled_from(("natural", "random"))),
                    copy_delay=draw(st.sampled_from((0.5, 0.9, 1.0))),
                    prepare_ahead=draw(st.sampled_from((0.5, 1.0, 0.0))),
                    # With async scheduling: how often the engine waits for its step in flight
                    # instead of scheduling ahead (drawn last: the draws above stay as they were).
                    async_wait=draw(st.sampled_from((0.0, 0.3, 0.7))))


@st.composite
def engine_configs(draw, layouts=DEFAULT_LAYOUTS, modes=("eager",), base: EngineConfig = FUZZ_MODEL) -> EngineConfig:
    """Layout, mode, token budget and KV pressure on a fixed model shape."""
    layout = draw(st.sampled_from(tuple(layouts)))
    tp, pp = parse_layout(layout)
    allowed = tuple(m for m in modes if not (m == "graph" and base.device.startswith("cuda")
                                             and base.world == "inproc" and tp > 1))
    mode = draw(st.sampled_from(allowed or ("eager",)))  # CUDA graphs with tp>1 need NCCL
    long = draw(st.sampled_from((False,) * 7 + (True,)))
    if long:
        budget, blocks = draw(st.sampled_from(LONG["budgets"])), draw(st.sampled_from(LONG["blocks"]))
    else:
        budget = draw(st.sampled_from((64, 16, 9, 5)))  # 64: no chunking for these prompts
        blocks = draw(st.sampled_from((96, 24, 17)))  # 17 blocks of 4 just hold max_model_len 64
    sp = tp > 1 and draw(st.booleans())
    bcast = pp > 1 and draw(st.booleans())
    extra = dict(max_model_len=LONG["max_model_len"]) if long else {}
    if mode == "graph":
        # One size set: every captured (rank, size) pair is paid once per pooled engine.
        extra.update(cudagraph_mode="FULL", capture_sizes=LONG["capture_sizes"] if long else (4, 8, 16, 32))
    # Plain decoding two draws in five (0.54 of drawn Cases, 0.43 at one in four): only there do
    # requests sample at random (verification is greedy), and a per-request generator bug under
    # chunked prefill needs one; at one in four it was found at the 40th example of a 60 s
    # selftest, or missed.
    method, k = draw(st.sampled_from((("none", 0), ("none", 0), ("ngram", 2), ("ngram", 4), ("eagle", 2))))
    k = spec_tokens(method, k, draw(st.sampled_from(SPEC_K)), draw(st.integers(1, MAX_SPEC_TOKENS)), budget) if k else 0
    # Prefix caching and async scheduling, independently, in one draw (so that the draws after
    # it go as they did before async scheduling existed): caching one Case in two as listed (in
    # Hypothesis' draws, measured, 1 in 3 to 2 in 5), async one in three.
    caching, asynchronous = draw(st.sampled_from(tuple((c, a) for a in (False, False, True) for c in (False, True))))
    # max_num_seqs as the model serves (8), or small enough that a few requests fill every seat
    # and the next one waits (the admission limit, docs/bug_classes.md#sched_max_num_seqs_off_by_one:
    # 9 requests running at once under a budget of 5-64 tokens were all but never drawn).
    # Drawn last, so the draws above go as they did.
    seqs = draw(st.sampled_from((base.max_num_seqs, 2, 4)))
    return base.replace(max_num_seqs=seqs, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=budget,
                        num_gpu_blocks=blocks, sequence_parallel=sp, broadcast_pp_output=bcast,
                        speculative_method=method, num_speculative_tokens=k,
                        enable_prefix_caching=caching, async_scheduling=asynchronous, **extra)


@st.composite
def cases(draw, layouts=DEFAULT_LAYOUTS, modes=("eager",), faults: tuple[str, ...] = (),
          base: EngineConfig = FUZZ_MODEL, max_requests: int = 10, poisons: tuple[str, ...] = POISON_MODES) -> Case:
    """A whole Case; labels its class with event() for Hypothesis statistics. `poisons`: what
    resets may leave in memory (engine/poison.py); campaigns alternate NaN and stale."""
    cfg = draw(engine_configs(layouts, modes, base))
    wl = draw(aborts(cfg, draw(workloads(cfg, max_requests, sampling=True))))
    cfg = kv_pool(tiny_budget(cfg, wl, draw(st.sampled_from(TINY_BUDGETS))), wl, draw(st.sampled_from(KV_POOL)))
    schedule, poison = draw(schedules()), draw(st.sampled_from(tuple(poisons)))
    # The budget on a drafting decode's edge, drawn last so the draws above go as they did.
    k = cfg.num_speculative_tokens if cfg.speculative_method != "none" else 0
    if k >= 2 and draw(st.sampled_from(DRAFT_EDGE)):
        cfg = draft_edge(cfg, wl, draw(st.integers(2, k)))
    # A random request's prefill in chunks, drawn last too (random sampling is never drafted).
    if any(not r.params.is_greedy for r in wl.requests):
        cfg = sampled_chunked(cfg, wl, draw(st.sampled_from(SAMPLED_CHUNKED)))
    case = Case(cfg, wl, schedule, tuple(faults), poison=poison)
    for name in limits_reached(cfg, wl.requests):
        event(f"limit: {name}")
    event(f"layout={case.layout}")
    event(f"mode={case.mode}")
    lens = [len(r.prompt_token_ids) for r in wl.requests]
    if max(lens) > cfg.max_num_batched_tokens:
        event("chunked prefill")
    if max(lens) > 64:
        event("prompt past a 64-row tile")
    event(f"poison={case.poison}")
    if any(r.arrival_step for r in wl.requests):
        event("arrivals while running")
    if not case.schedule.is_default:
        event("non-default schedule")
    if cfg.speculative_method != "none":
        event("speculative decoding")
    if any(drafting.self_drafting(cfg, r) for r in wl.requests):
        event("self-drafting request")
    if cfg.enable_prefix_caching:
        event("prefix caching")
    params = [r.sampling for r in wl.requests if r.sampling is not None]
    if params:
        event("sampling")
        if any(not p.is_greedy for p in params):
            event("random sampling")
            if any(not r.params.is_greedy and len(r.prompt_token_ids) > cfg.max_num_batched_tokens
                   for r in wl.requests):
                event("random sampling, prefill chunked")
        if any(p.has_penalties for p in params):
            event("penalties")
        if any(p.n > 1 for p in params):
            event("parallel sampling (n > 1)")
    if any(r.abort_step is not None for r in wl.requests):
        event("abort")
    if mid_block_prefix_class(cfg, wl.requests):
        event("prefix hit on the block a chunk ends in")
    return case
