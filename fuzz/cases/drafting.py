"""Prompts whose n-gram drafts greedy verification accepts: the class that multi-token
acceptance, rollback and the cut of drafts to the token budget need
(docs/bug_classes.md#spec_rollback_missing, #sched_drafts_over_budget): drafts proposed, and
accepted, at a decode.

The fuzz model's weights are random: its greedy continuation of a drawn prompt rarely repeats
an n-gram of its context, so the n-gram proposer mostly proposes nothing; a prompt of a
repeated segment does not help either, since the first sampled token already breaks the
period (docs/reach.md). These prompts are the model's own greedy continuation of a seed
segment, cut where the continuation is about to repeat an earlier n-gram and go on as it did
there: at the first decode the proposer finds that n-gram and proposes what followed it, which
is what greedy decoding produces next, so verification accepts 2 or more drafts.

They depend on the weights, so they are searched for once (`search`: `python
bench/drafting_prompts.py 192`) and stored as token ids; a Case stores its prompt's ids as any
other, so drawing and replaying run no model. tests/fuzz/cases/test_drafting.py reruns the
model to check that they still continue as stored. The strategies add one or two requests of
them to two n-gram Cases in three (`add_requests`) and label such a Case with event()
(`self_drafting`); docs/reach.md has what that changed.
"""
from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.spec_decode import NgramProposer
from fuzz.cases.case import RequestSpec, Workload

# The model the stored prompts were searched on: FUZZ_MODEL's shape and seeded weights. Each
# prompt drafts with the weights in float32 and rounded to bfloat16 and float16 (what the
# reference run of a half-precision Case computes with, fuzz.cases.case.reference_config).
MODEL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=8, intermediate_size=128, seed=0, model_path=None)
SEARCH_DTYPES = ("float32", "bfloat16", "float16")
MIN_ACCEPTED = 2  # drafts greedy verification accepts at the first decode (k >= 2)
K = 4  # drafts proposed in the search (the proposer's k only truncates what it finds)
# Prompt lengths searched: long enough to hold a repeat, short enough that a request of one
# costs a campaign few steps (prompts are prefilled in chunks of budgets down to 5 tokens).
MIN_CUT, MAX_CUT = 8, 24

# (a seed segment and its greedy continuation, the lengths at which a prompt of it drafts), the
# shortest first (what a shrink leaves): `python bench/drafting_prompts.py 192` (18 of 192 seeds).
PROMPTS: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((108, 108, 108, 108, 108, 121, 121, 56, 121, 56, 121, 56, 32, 104),
     (8, 9)),
    ((99, 99, 99, 15, 15, 15, 120, 15, 120, 15, 120, 18, 15, 120, 15, 120, 99, 15, 120, 99, 15, 120, 15, 115),
     (8, 18, 19)),
    ((74, 74, 74, 74, 74, 74, 120, 8, 100, 8, 100, 8, 24, 8, 24, 24, 24, 8, 24, 24, 24, 24, 120),
     (9, 17, 18)),
    ((35, 74, 74, 8, 26, 74, 8, 8, 26, 8, 26, 8, 26, 8, 26, 8, 26, 8, 26, 8, 26, 8, 26, 8, 26, 8, 8, 26),
     (9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23)),
    ((125, 125, 79, 46, 60, 49, 92, 46, 94, 51, 94, 92, 46, 94, 31, 92, 21, 122, 2, 46, 94, 31, 64, 23),
     (11, 19)),
    ((28, 28, 28, 28, 28, 108, 69, 105, 69, 39, 105, 69, 56, 105, 69, 56, 12, 13),
     (13,)),
    ((42, 42, 42, 42, 98, 115, 98, 115, 94, 44, 126, 120, 99, 99, 120, 99, 99, 99, 115),
     (14,)),
    ((28, 28, 28, 28, 28, 28, 108, 69, 105, 69, 39, 105, 69, 56, 105, 69, 56, 12, 13),
     (14,)),
    ((72, 19, 55, 87, 104, 74, 116, 108, 115, 65, 56, 61, 19, 56, 19, 56, 19, 56, 99, 58),
     (14, 15)),
    ((13, 13, 13, 13, 92, 63, 10, 67, 63, 67, 42, 63, 67, 107, 92, 63, 10, 67, 20, 8),
     (14, 15)),
    ((82, 82, 31, 126, 56, 115, 15, 63, 119, 46, 4, 106, 56, 56, 56, 106, 56, 56, 56, 56, 56),
     (15, 16)),
    ((127, 127, 127, 127, 127, 127, 96, 70, 96, 70, 85, 99, 99, 70, 81, 70, 81, 70, 81, 76, 81, 76, 70, 81, 76,
      18, 26),
     (15, 16, 22)),
    ((58, 58, 58, 50, 34, 34, 34, 34, 55, 96, 35, 76, 57, 15, 103, 89, 96, 35, 76, 77, 53),
     (16,)),
    ((68, 68, 68, 68, 68, 100, 99, 115, 15, 115, 115, 98, 15, 115, 63, 115, 98, 98, 127, 115, 98, 115, 98, 115, 8,
      115),
     (21,)),
    ((52, 52, 52, 52, 52, 52, 59, 3, 76, 76, 93, 19, 8, 76, 83, 39, 41, 74, 41, 74, 26, 39, 41, 74, 41, 116, 93),
     (21, 22)),
    ((62, 62, 62, 62, 99, 99, 99, 99, 99, 87, 99, 99, 99, 99, 14, 36, 76, 87, 35, 99, 87, 99, 87, 35, 99, 87, 99,
      41, 87),
     (23, 24)),
    ((62, 62, 62, 62, 62, 62, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 87, 99, 99, 99, 99, 99, 87, 99, 99, 99,
      35, 35),
     (23, 24)),
    ((10, 10, 10, 10, 86, 23, 58, 56, 122, 39, 105, 79, 39, 122, 50, 89, 122, 102, 79, 39, 23, 23, 23, 3, 23, 3,
      23, 86, 0),
     (24,)),
)


def applies(cfg: EngineConfig) -> bool:
    """Whether the stored prompts draft on `cfg`: n-gram drafting on the model they were
    searched on."""
    return cfg.speculative_method == "ngram" and all(getattr(cfg, k) == v for k, v in MODEL.items())


def prompt(which: int) -> tuple[int, ...]:
    """Stored prompt `which`: entry `which % len(PROMPTS)` at its `which // len(PROMPTS)`-th
    drafting length (modulo their number). 0, what a shrink leaves: the first at its shortest."""
    tokens, cuts = PROMPTS[which % len(PROMPTS)]
    return tokens[:cuts[which // len(PROMPTS) % len(cuts)]]


# How many self-drafting requests join an n-gram Case (strategies.workloads): none (first: what
# a shrink leaves), one, or two (whose decodes meet in a step: the second's drafts get what the
# first left of the token budget). They join the drawn workload instead of replacing a drawn
# prompt, so that switching them off leaves the rest of the Case as drawn (a shrink would not
# trade a stored prompt's length back for a drawn one), and arrive one step after its first
# requests, which are then prefilling or decoding beside them, without counting among the
# requests that arrive together (the max_num_seqs limits and full batches stay as drawn).
REQUESTS = (0, 1, 2)
# Their output tokens: the prefill's, then a decode verifying up to 3 drafts (2 or more of them
# accepted; with k >= 3 the third may be rejected and rolled back) and its bonus token. With 8
# of them and prompts up to 53 tokens, campaign Cases took about a fifth more CPU (measured on
# the same drawn Cases with and without these requests), for later drafts that mostly no
# longer match; with these, within the noise.
MAX_TOKENS = 5
# Drawn with MAX_TOKENS output tokens three times in four; else 1 to MAX_TOKENS, so that a shrink
# takes them to 1 token where a failure needs the requests but not their drafts.
FULL = (False, True, True, True)


def add_requests(wl: Workload, cfg: EngineConfig, count: int, which: int, max_requests: int,
                 max_tokens: int = MAX_TOKENS) -> Workload:
    """`wl` and `count` self-drafting requests (prompts `which`, `which + 1`, ...; `max_tokens`
    output tokens, or what max_model_len leaves) arriving one step after its first ones; as
    is where the stored prompts do not apply (`applies`), and no more than `max_requests` in all."""
    count = min(count, max_requests - len(wl.requests))
    if count <= 0 or not applies(cfg):
        return wl
    step = min(r.arrival_step for r in wl.requests) + 1
    prompts = [prompt(which + i) for i in range(count)]
    return Workload(wl.requests + tuple(RequestSpec(p, min(max_tokens, cfg.max_model_len - len(p)), step)
                                        for p in prompts))


# Every stored prompt at each of its drafting lengths: a Case tells its class from token ids alone.
_AT_CUTS = frozenset(tokens[:c] for tokens, cuts in PROMPTS for c in cuts)


def self_drafting(cfg: EngineConfig, r: RequestSpec) -> bool:
    """Whether request `r` of a Case on `cfg` drafts MIN_ACCEPTED tokens or more at its first
    decode that greedy decoding goes on with (all of them verified, unless the token budget
    cuts them): a stored prompt at a drafting length, decoded greedily (penalties and a logit
    bias would move the continuation), with room for MIN_ACCEPTED drafts and a bonus token."""
    p = r.sampling
    plain = p is None or (p.is_greedy and not p.has_penalties and not p.logit_bias)
    return (applies(cfg) and cfg.num_speculative_tokens >= MIN_ACCEPTED and r.max_tokens >= 2 + MIN_ACCEPTED
            and r.prompt_token_ids in _AT_CUTS and plain)


def accepted_at_first_decode(tokens: list[int], cut: int, k: int = K) -> int:
    """Drafts accepted at the first decode of the prompt `tokens[:cut]` when `tokens` is its
    greedy continuation: the proposer sees the prompt and the first sampled token."""
    drafts = NgramProposer(k).propose(list(tokens[:cut + 1]))
    a = 0
    while a < len(drafts) and cut + 1 + a < len(tokens) and drafts[a] == tokens[cut + 1 + a]:
        a += 1
    return a


def greedy(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference run's greedy continuation of each prompt (tp1pp1, eager, no drafting), up to
    `max_tokens` or max_model_len."""
    from engine import LLMEngine
    from fuzz.cases.case import reference_config

    ref = reference_config(cfg.replace(device="cpu", world="inproc"))
    engine, out = LLMEngine(ref), []
    try:
        for i in range(0, len(prompts), ref.max_num_seqs):
            engine.reset()
            batch = prompts[i:i + ref.max_num_seqs]
            for j, p in enumerate(batch):
                engine.add_request(f"g{j}", list(p), min(max_tokens, ref.max_model_len - len(p)))
            while engine.has_unfinished_requests():
                engine.step()
            got = engine.trace.output_token_ids()
            out += [got[f"g{j}"] for j in range(len(batch))]
    finally:
        engine.shutdown()
    return out


def search(cfg: EngineConfig, seeds: range, min_cut: int = MIN_CUT, max_cut: int = MAX_CUT) -> list:
    """PROMPTS entries from seed segments `seeds`: the segment, a run of one token (1 to 6 of
    it: continuations of runs repeat themselves more often; with cuts up to 53 tokens, 27 of
    192 run segments made an entry, 5 of 128 random segments of 1 to 6 tokens) and its greedy
    continuation, with every cut from `min_cut` to `max_cut` tokens whose first decode accepts
    MIN_ACCEPTED drafts in each of SEARCH_DTYPES; the shortest first."""
    segs = [[random.Random(s).randrange(cfg.vocab_size)] * (1 + s % 6) for s in seeds]
    runs = {d: greedy(cfg.replace(dtype=d), segs, max_cut + K) for d in SEARCH_DTYPES}
    found: list = []
    for i, seg in enumerate(segs):
        full = [seg + runs[d][i] for d in SEARCH_DTYPES]
        cuts = tuple(c for c in range(max(min_cut, len(seg)), min(max_cut + 1, len(full[0]) - K))
                     if all(t[:c + K + 1] == full[0][:c + K + 1] for t in full)
                     and accepted_at_first_decode(full[0], c) >= MIN_ACCEPTED)
        # One entry a segment (a run of the same token, longer, continues alike).
        if cuts and all(tokens[:len(seg)] != tuple(seg) for tokens, _ in found):
            found.append((tuple(full[0][:max(cuts) + 1 + K]), cuts))
    return sorted(found, key=lambda e: (min(e[1]), len(e[0])))
