"""Config limits: which a Case reaches, its sampling and abort mix, and the choices the
strategies (fuzz/cases/strategies.py) draw to reach each limit exactly and one off.

Read from the Case alone (no run), so the strategies label what they draw with event() and a
campaign counts it per cell (fuzz.targets.reference.HarnessTarget.record) with the same
function. A limit is named "<limit>" when the workload meets it exactly and "<limit> - 1"
(or "+ 1") one short of (or one past) it: code at a limit sits on either side of it.
"""
from __future__ import annotations

from engine.attention.reference import FA2_PAGED_TILE_Q
from engine.config import EngineConfig
from fuzz.cases.case import RequestSpec, Workload

# engine/config.py accepts num_speculative_tokens within 1..8 (tests/fuzz/test_limits.py
# checks that both ends still hold).
MAX_SPEC_TOKENS = 8
# Query-row tiles of the attention kernels a prompt's first chunk can straddle: FlashAttention-2
# with a paged KV cache (64 rows, engine/attention/reference.py) and PyTorch's FlashAttention
# kernel (128 rows, engine/attention/torch_flash.py).
TILE_ROWS = (FA2_PAGED_TILE_Q, 128)

# Every limit the strategies aim at, in the order a summary lists them.
LIMITS = ("max_model_len", "max_model_len - 1", "max_model_len with drafts",
          "budget 1", "budget 2", "budget = 1 + k", "budget = k", "budget cuts a decode's drafts", "prompt = budget", "prompt = budget + 1",
          "max_num_seqs", "max_num_seqs + 1", "kv blocks exact", "kv blocks + 1",
          "block edge", "block edge +- 1", "tile edge", "tile edge +- 1",
          "spec k 1", f"spec k {MAX_SPEC_TOKENS}", "capture size", "capture size + 1")


def blocks_for(cfg: EngineConfig, num_tokens: int) -> int:
    """KV blocks one sequence of `num_tokens` holds, with EAGLE's lookahead slots (capped at
    max_model_len, as the scheduler's `_with_lookahead`)."""
    k = cfg.num_speculative_tokens if cfg.speculative_method == "eagle" else 0
    return -(-min(num_tokens + k, cfg.max_model_len) // cfg.block_size)


def kv_demand(cfg: EngineConfig, requests) -> int:
    """Blocks the workload's requests hold when all run at once (children of n > 1 each
    their own; no sharing counted)."""
    return sum(blocks_for(cfg, len(r.prompt_token_ids) + r.max_tokens) * r.params.n for r in requests)


def _length_limits(cfg: EngineConfig, requests) -> set[str]:
    out = set()
    ends = {len(r.prompt_token_ids) + r.max_tokens for r in requests}
    lens = {len(r.prompt_token_ids) for r in requests}
    mml, bs, budget = cfg.max_model_len, cfg.block_size, cfg.max_num_batched_tokens
    out |= {"max_model_len"} if mml in ends else set()
    out |= {"max_model_len - 1"} if mml - 1 in ends else set()
    k = cfg.num_speculative_tokens if cfg.speculative_method != "none" else 0
    if k and max(ends) > mml - k:  # the last decodes' drafts would run past the end
        out.add("max_model_len with drafts")
    out |= {"prompt = budget"} if budget in lens else set()
    out |= {"prompt = budget + 1"} if budget + 1 in lens else set()
    out |= {"block edge"} if any(n % bs == 0 for n in lens) else set()
    out |= {"block edge +- 1"} if any(n % bs in (1, bs - 1) for n in lens) else set()
    # A first chunk (the prompt up to the budget) on a query-row tile's edge.
    chunks = {min(n, budget) for n in lens}
    out |= {"tile edge"} if chunks & set(TILE_ROWS) else set()
    out |= {"tile edge +- 1"} if chunks & {t + d for t in TILE_ROWS for d in (-1, 1)} else set()
    if cfg.cudagraph_mode != "NONE":
        # A lone prompt's first step runs its chunk's tokens: the padded graph of that size.
        sizes = set(cfg.capture_sizes)
        out |= {"capture size"} if chunks & sizes else set()
        out |= {"capture size + 1"} if chunks & {s + 1 for s in sizes} else set()
    return out


def limits_reached(cfg: EngineConfig, requests) -> list[str]:
    """The LIMITS the Case of `cfg` and `requests` (RequestSpecs) reaches, in LIMITS' order."""
    out = _length_limits(cfg, requests) if requests else set()
    budget = cfg.max_num_batched_tokens
    out |= {f"budget {budget}"} if budget <= 2 else set()
    if cfg.speculative_method != "none":
        k = cfg.num_speculative_tokens
        out |= {"budget = 1 + k"} if budget == 1 + k else {"budget = k"} if budget == k else set()
        # Fewer than one full decode (1 + k) per running request, and not a whole number of
        # them: if they all decode with every draft, the last one's drafts are cut.
        decodes = sum(r.params.n for r in requests)
        out |= {"budget cuts a decode's drafts"} if budget % (1 + k) and budget < decodes * (1 + k) else set()
        out |= {f"spec k {k}"} if k in (1, MAX_SPEC_TOKENS) else set()
    # Requests arriving together (children of n > 1 each count): max_num_seqs of them run at once.
    first = min((r.arrival_step for r in requests), default=0)
    together = sum(r.params.n for r in requests if r.arrival_step == first)
    out |= {"max_num_seqs"} if together == cfg.max_num_seqs else {"max_num_seqs + 1"} if together == cfg.max_num_seqs + 1 else set()
    usable, demand = cfg.num_gpu_blocks - 1, kv_demand(cfg, requests)
    out |= {"kv blocks exact"} if demand == usable else {"kv blocks + 1"} if demand == usable + 1 else set()
    return [name for name in LIMITS if name in out]


def mid_block_prefix_class(cfg: EngineConfig, requests) -> bool:
    """Whether the Case is of the class a prefix hit on a block that a prefill chunk ends
    inside needs (docs/bug_classes.md#prefix_hit_mid_block_counted_full): prefix caching and
    pp >= 2 (the first chunk still in flight when the next microbatch is scheduled), a first
    chunk (the budget less the prompts admitted before it in its step) that ends inside a
    block, and a later request of the same salt whose prompt holds that whole block,
    arriving before the first one's next chunk."""
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    if not cfg.enable_prefix_caching or cfg.pp < 2 or cfg.speculative_method == "eagle":
        return False
    for i, a in enumerate(requests):
        chunk = budget - sum(len(r.prompt_token_ids) for r in requests[:i] if r.arrival_step == a.arrival_step)
        need = (chunk // bs + 1) * bs  # the prompt through the block the chunk ends inside
        head = a.prompt_token_ids[:need]
        if chunk < 1 or chunk % bs == 0 or len(head) < need:
            continue
        if any(b.cache_salt == a.cache_salt and len(b.prompt_token_ids) > need and b.prompt_token_ids[:need] == head
               and a.arrival_step <= b.arrival_step < a.arrival_step + cfg.pp for b in requests[i + 1:]):
            return True
    return False


def mid_block_plan(cfg: EngineConfig) -> tuple[int, int] | None:
    """How a workload gets a first prefill chunk that ends inside a block of a shared prefix:
    (tokens of a request admitted just before it, in the same step, the prefix's length).
    With a budget that is a multiple of the block size, that request takes half a block of
    it; the prefix runs through the block the chunk ends inside, plus one token (so a
    request of the prefix alone hits that block too). None where it would pass a third of
    max_model_len (the strategies' longest prefix)."""
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    lead = bs // 2 if budget % bs == 0 else 0
    chunk = budget - lead
    plen = (chunk // bs + 1) * bs + 1
    if chunk < 1 or chunk % bs == 0 or plen > cfg.max_model_len // 3:
        return None
    return lead, plen


def mix_counts(requests) -> dict[str, int]:
    """How many of the requests sample with params, at random, with penalties, and are aborted."""
    params = [r.sampling for r in requests]
    return {"requests": len(requests),
            "requests_sampling": sum(p is not None for p in params),
            "requests_random": sum(p is not None and not p.is_greedy for p in params),
            "requests_penalties": sum(p is not None and p.has_penalties for p in params),
            "requests_aborted": sum(r.abort_step is not None for r in requests)}


# -- the choices the strategies draw to reach them (fuzz/cases/strategies.py) ---------------------

# Whether one request of a workload ends at max_model_len (prompt plus max_tokens) or one
# short of it; "no" (the drawn lengths) shrinks first. The share of drawn Cases at each limit:
# bench/draw_limits.py, bench/results/draw_limits_cpu.json.
AT_END = ("no",) * 6 + ("at", "one short")
# Only where max_model_len is short: a request at 512 tokens costs seconds an example on CPU.
AT_END_MAX_LEN = 128


# None (the budget as drawn, what a shrink leaves) in three draws in five; else 1 or 2.
TINY_BUDGETS = (None,) * 3 + (1, 2)
# A tiny budget runs a token or two a step: only for workloads of at most this many tokens
# (prompts and outputs), so an example stays within ~2 s on CPU, and only up to pp2, since a
# deeper pipeline at one token a step would outrun the harness's step bound (max_steps_for).
TINY_BUDGET_MAX_TOKENS, TINY_BUDGET_MAX_PP = 40, 2


def tiny_budget(cfg: EngineConfig, wl: Workload, tiny: int | None) -> EngineConfig:
    """`cfg` with the token budget `tiny` (None: as is) where the workload is small enough."""
    if tiny is None or wl.num_tokens > TINY_BUDGET_MAX_TOKENS or cfg.pp > TINY_BUDGET_MAX_PP:
        return cfg
    return cfg.replace(max_num_batched_tokens=tiny)


# Whether the token budget is cut under a random request's prompt (`sampled_chunked`); False
# shrinks first.
SAMPLED_CHUNKED = (False, True)


def sampled_chunked(cfg: EngineConfig, wl: Workload, on: bool) -> EngineConfig:
    """`cfg` with a token budget one under the longest prompt of a random-sampling request that
    fits the budget as drawn, where the workload is small enough (DRAFT_EDGE_MAX_TOKENS): its
    prefill takes two chunks or more, the first of which samples nothing for it, and its
    generator must not draw there (the class of
    docs/bug_classes.md#sampling_generator_advanced_unsampled). Lengthening a random request's
    prompt past the budget (fuzz.cases.strategies.sampled_requests) cannot where the budget is
    max_model_len, the budget drawn most often; there the Case was found at its 40th example
    of a 60 s selftest, or not at all."""
    lens = [len(r.prompt_token_ids) for r in wl.requests if not r.params.is_greedy]
    longest = max((n for n in lens if 2 <= n <= cfg.max_num_batched_tokens), default=None)
    if not on or longest is None or wl.num_tokens > DRAFT_EDGE_MAX_TOKENS:
        return cfg
    return cfg.replace(max_num_batched_tokens=longest - 1)


# Whether the token budget is put on a drafting decode's edge (`draft_edge`); False shrinks first.
DRAFT_EDGE = (False, True)
# A budget of a few tokens runs a workload in many steps: only for workloads of at most this
# many tokens (prompts and outputs), so an example stays within ~2 s on CPU.
DRAFT_EDGE_MAX_TOKENS = 256


def draft_edge(cfg: EngineConfig, wl: Workload, kept: int) -> EngineConfig:
    """`cfg` with a token budget of `kept` (2..k) where speculation drafts k >= 2 tokens and the
    workload is small enough: a decode that comes first in its microbatch with `kept` or more
    drafts is left room for kept - 1 of them, so its drafts are cut (the class of
    docs/bug_classes.md#sched_drafts_over_budget). EAGLE drafts k at every decode, and a
    self-drafting n-gram request drafts at most of its decodes, so the cut is met at once; a
    budget that needs several full decodes at once to run out was all but never met."""
    k = cfg.num_speculative_tokens if cfg.speculative_method != "none" else 0
    if not 2 <= kept <= k or kept >= cfg.max_num_batched_tokens or wl.num_tokens > DRAFT_EDGE_MAX_TOKENS:
        return cfg
    return cfg.replace(max_num_batched_tokens=kept)


# How k is chosen: as drawn above (shrinks first), the ends of the engine's range, any k,
# and k on the token budget (budget = 1 + k: a decode and all its drafts fill the step
# exactly; budget = k: the drafts are cut by one).
SPEC_K = ("as drawn", "one", "max", "any", "fills budget", "one past budget")


# EAGLE's draft head is built with the engine (one engine per k): its k stays at the ends
# and the one drawn before, so a campaign's engine pool does not fill with EAGLE engines.
EAGLE_K = (1, 2, MAX_SPEC_TOKENS)


def spec_tokens(method: str, k: int, how: str, any_k: int, budget: int) -> int:
    """The number of speculative tokens `how` picks for `method` (`any_k`: a drawn one); one
    past the engine's range (or, for EAGLE, outside EAGLE_K) falls back to `k`."""
    picked = {"as drawn": k, "one": 1, "max": MAX_SPEC_TOKENS, "any": any_k,
              "fills budget": budget - 1, "one past budget": budget}[how]
    ok = picked in EAGLE_K if method == "eagle" else 1 <= picked <= MAX_SPEC_TOKENS
    return picked if ok else k


# Whether a workload is filled up to max_num_seqs requests arriving together ("at"), or one
# more, which then waits for a free seat ("one over"); "no" shrinks first.
FULL_BATCH = ("no",) * 5 + ("at", "one over")


def full_batch(wl: Workload, cfg: EngineConfig, fill: str, max_requests: int) -> Workload:
    """`wl` with short filler requests (1-3 tokens, 2 outputs) arriving with its first
    ones, so that max_num_seqs (or one more) sequences arrive together; as is when `fill` is
    "no", when as many already do, or when the fillers would pass `max_requests`."""
    first = min(r.arrival_step for r in wl.requests)
    together = sum(r.params.n for r in wl.requests if r.arrival_step == first)
    missing = cfg.max_num_seqs + (fill == "one over") - together
    if fill == "no" or missing <= 0 or len(wl.requests) + missing > max_requests:
        return wl
    fillers = tuple(RequestSpec(tuple((i + j) % cfg.vocab_size for j in range(1 + i % 3)), min(2, cfg.max_model_len - 3), first)
                    for i in range(missing))
    return Workload(wl.requests + fillers)


# The KV pool: as drawn ("no", what a shrink leaves), just holding every request of the
# workload at once, or one block short of it (a preemption when they all run together).
KV_POOL = ("no",) * 3 + ("exact", "one short")


def kv_pool(cfg: EngineConfig, wl: Workload, how: str) -> EngineConfig:
    """`cfg` with num_gpu_blocks set so the workload's KV demand (`kv_demand`)
    fills the pool exactly, or one block past it; as is where that pool would not hold a
    max_model_len sequence or would outgrow the one drawn."""
    if how == "no":
        return cfg
    blocks = kv_demand(cfg, wl.requests) + 1 - (how == "one short")  # + the null block
    if not cfg.max_blocks_per_req + 1 <= blocks <= cfg.num_gpu_blocks:
        return cfg
    return cfg.replace(num_gpu_blocks=blocks)
