"""Hypothesis strategies for Cases. Every toggle shrinks open: tp1pp1, eager, no chunking,
one request, short prompts, no arrivals, natural schedule, no preemption pressure.

Model shapes are few and fixed (`FUZZ_MODEL`) so engines are reused across examples.
Prompt tokens come from a drawn seed: the length is what matters for batching bugs and it
shrinks directly; the reproducer still stores every token id.
"""
from __future__ import annotations

import random

from hypothesis import event, strategies as st

from engine.config import EngineConfig, parse_layout
from engine.poison import POISON_MODES
from engine.schedule import Schedule
from fuzz.case import Case, RequestSpec, Workload

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
    """Short lengths, plus lengths on either side of block and budget boundaries."""
    bs, budget = cfg.block_size, cfg.max_num_batched_tokens
    edges = sorted({n for k in (1, 2, 3) for n in (k * bs - 1, k * bs, k * bs + 1)}
                   | {budget - 1, budget, budget + 1, 2 * budget + 1})
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
def request_specs(draw, cfg: EngineConfig) -> RequestSpec:
    """One request: prompt around block/budget edges, a few output tokens, maybe late."""
    length = draw(prompt_lengths(cfg))
    seed = draw(st.integers(0, 2 ** 16))
    alphabet = draw(st.sampled_from((cfg.vocab_size, REPETITIVE_ALPHABET)))
    max_tokens = draw(st.integers(1, min(8, cfg.max_model_len - length)))
    arrival = draw(st.one_of(st.just(0), st.integers(1, 6)))
    return RequestSpec(tokens_from_seed(seed, length, alphabet), max_tokens, arrival)


@st.composite
def workloads(draw, cfg: EngineConfig, max_requests: int = 10) -> Workload:
    """Mixes of prefill, decode and chunked prefill; arrivals while others run."""
    reqs = draw(st.lists(request_specs(cfg), min_size=1, max_size=max_requests))
    return Workload(tuple(reqs))


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
                    prepare_ahead=draw(st.sampled_from((0.5, 1.0, 0.0))))


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
    method, k = draw(st.sampled_from((("none", 0), ("ngram", 2), ("ngram", 4), ("eagle", 2))))
    return base.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=budget,
                        num_gpu_blocks=blocks, sequence_parallel=sp, broadcast_pp_output=bcast,
                        speculative_method=method, num_speculative_tokens=k, **extra)


@st.composite
def cases(draw, layouts=DEFAULT_LAYOUTS, modes=("eager",), faults: tuple[str, ...] = (),
          base: EngineConfig = FUZZ_MODEL, max_requests: int = 10, poisons: tuple[str, ...] = POISON_MODES) -> Case:
    """A whole Case; labels its class with event() for Hypothesis statistics. `poisons`: what
    resets may leave in memory (engine/poison.py); campaigns alternate NaN and stale."""
    cfg = draw(engine_configs(layouts, modes, base))
    wl = draw(workloads(cfg, max_requests))
    case = Case(cfg, wl, draw(schedules()), tuple(faults), poison=draw(st.sampled_from(tuple(poisons))))
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
    return case
