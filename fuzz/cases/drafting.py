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

They depend on the weights, so they are searched for once per model (`search`: `python
bench/drafting_prompts.py fuzz|vllm 192`) and stored as token ids (fuzz.cases.drafting_prompts:
the fuzz model's, run by our engine, and the vLLM target's model, whose n-gram rule differs);
a Case stores its prompt's ids as any other, so drawing and replaying run no model. tests/fuzz/cases/test_drafting.py reruns the
model to check that they still continue as stored. The strategies add one or two requests of
them to two n-gram Cases in three (`add_requests`) and label such a Case with event()
(`self_drafting`); docs/reach.md has what that changed.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.spec_decode import NgramProposer
from fuzz.cases.case import RequestSpec, Workload
from fuzz.cases.drafting_prompts import FUZZ_MODEL_PROMPTS, VLLM_MODEL_PROMPTS, Prompts


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per model
class Table:
    """Stored prompts for one model (its shape and seeded weights), searched with the n-gram rule
    of the engine that runs them (`rule`: "recent", our engine's proposer, the most recent earlier
    match; "earliest", vLLM's, fuzz.targets.vllm.drafts.expected_draft), each drafting with the
    weights in every one of `dtypes` (what the Cases on that model compute in: the reference run
    of a half-precision Case, fuzz.cases.case.reference_config; vLLM's float32 and bfloat16 cells)."""

    name: str
    model: dict
    prompts: Prompts
    rule: str
    dtypes: tuple[str, ...]


TABLES = (
    Table("fuzz", dict(vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=8, intermediate_size=128, seed=0, model_path=None),
          FUZZ_MODEL_PROMPTS, "recent", ("float32", "bfloat16", "float16")),
    Table("vllm", dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, intermediate_size=256, seed=0, model_path=None),
          VLLM_MODEL_PROMPTS, "earliest", ("float32", "bfloat16")),
)
FUZZ, VLLM = TABLES
MIN_ACCEPTED = 2  # drafts greedy verification accepts at the first decode (k >= 2)
K = 4  # drafts proposed in the search (the proposer's k only truncates what it finds)
# Prompt lengths searched: long enough to hold a repeat, short enough that a request of one
# costs a campaign few steps (prompts are prefilled in chunks of budgets down to 5 tokens).
MIN_CUT, MAX_CUT = 8, 24


def model_table(cfg: EngineConfig) -> Table | None:
    """The table of the model `cfg` runs (shape and seeded weights), else None."""
    return next((t for t in TABLES if all(getattr(cfg, k) == v for k, v in t.model.items())), None)


def table(cfg: EngineConfig) -> Table | None:
    """The table whose prompts draft on `cfg`: n-gram drafting on a model they were searched on."""
    return model_table(cfg) if cfg.speculative_method == "ngram" else None


def prompt(which: int, tab: Table = FUZZ) -> tuple[int, ...]:
    """Stored prompt `which` of `tab`: entry `which % len` at its `which // len`-th drafting
    length (modulo their number). 0, what a shrink leaves: the first at its shortest."""
    tokens, cuts = tab.prompts[which % len(tab.prompts)]
    return tokens[:cuts[which // len(tab.prompts) % len(cuts)]]


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
    is where the stored prompts do not apply (`table`), and no more than `max_requests` in all."""
    count, tab = min(count, max_requests - len(wl.requests)), table(cfg)
    if count <= 0 or tab is None:
        return wl
    step = min(r.arrival_step for r in wl.requests) + 1
    prompts = [prompt(which + i, tab) for i in range(count)]
    return Workload(wl.requests + tuple(RequestSpec(p, min(max_tokens, cfg.max_model_len - len(p)), step)
                                        for p in prompts))


@functools.cache
def _at_cuts(tab: Table) -> frozenset:
    """Every prompt of `tab` at each of its drafting lengths: a Case tells its class from token ids alone."""
    return frozenset(tokens[:c] for tokens, cuts in tab.prompts for c in cuts)


def self_drafting(cfg: EngineConfig, r: RequestSpec) -> bool:
    """Whether request `r` of a Case on `cfg` drafts MIN_ACCEPTED tokens or more at its first
    decode that greedy decoding goes on with (all of them verified, unless the token budget
    cuts them): a stored prompt at a drafting length, decoded greedily (penalties and a logit
    bias would move the continuation), with room for MIN_ACCEPTED drafts and a bonus token, and
    not aborted (which may come before its first decode)."""
    p, tab = r.sampling, table(cfg)
    plain = p is None or (p.is_greedy and not p.has_penalties and not p.logit_bias)
    return (tab is not None and cfg.num_speculative_tokens >= MIN_ACCEPTED and r.max_tokens >= 2 + MIN_ACCEPTED
            and r.prompt_token_ids in _at_cuts(tab) and plain and r.abort_step is None)


def expected_draft(tokens: list[int] | tuple, n: int, k: int, min_n: int, max_n: int, max_model_len: int) -> list[int]:
    """vLLM's n-gram draft for the context tokens[:n], written from its documentation
    (vllm/v1/spec_decode/ngram_proposer.py): the longest suffix of length in [min_n, max_n]
    that also occurs earlier; among equally long matches the earliest; the draft is up to k
    tokens that followed it, never past the context's end nor max_model_len."""
    ctx = list(tokens[:n])
    if n < min_n:
        return []
    k = min(k, max_model_len - n)
    if k <= 0:
        return []
    for size in range(min(max_n, n - 1), min_n - 1, -1):  # longest first
        suffix = ctx[n - size:]
        for j in range(0, n - size):  # earliest first; the suffix itself (j = n - size) excluded
            if ctx[j:j + size] == suffix:
                start = j + size
                return ctx[start:start + min(k, n - start)]
    return []


def propose(rule: str, tokens: list[int], k: int) -> list[int]:
    """The n-gram draft of `rule` (Table.rule) for the context `tokens`."""
    if rule == "recent":
        return NgramProposer(k).propose(list(tokens))
    return expected_draft(list(tokens), len(tokens), k, 1, 3, len(tokens) + k)


def accepted_at_first_decode(tokens: list[int], cut: int, k: int = K, rule: str = "recent") -> int:
    """Drafts accepted at the first decode of the prompt `tokens[:cut]` when `tokens` is its
    greedy continuation: the proposer sees the prompt and the first sampled token."""
    drafts = propose(rule, tokens[:cut + 1], k)
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


def search(cfg: EngineConfig, seeds: range, tab: Table = FUZZ, min_cut: int = MIN_CUT,
           max_cut: int = MAX_CUT) -> list:
    """Entries for `tab` from seed segments `seeds`: the segment, a run of one token (1 to 6 of
    it: continuations of runs repeat themselves more often; with cuts up to 53 tokens, 27 of
    192 run segments made an entry on the fuzz model, 5 of 128 random segments of 1 to 6
    tokens) and its greedy continuation on `cfg` (the table's model), with every cut from
    `min_cut` to `max_cut` tokens whose first decode accepts MIN_ACCEPTED drafts under the
    table's rule in each of its dtypes; the shortest first."""
    segs = [[random.Random(s).randrange(cfg.vocab_size)] * (1 + s % 6) for s in seeds]
    runs = {d: greedy(cfg.replace(dtype=d), segs, max_cut + K) for d in tab.dtypes}
    found: list = []
    for i, seg in enumerate(segs):
        full = [seg + runs[d][i] for d in tab.dtypes]
        cuts = tuple(c for c in range(max(min_cut, len(seg)), min(max_cut + 1, len(full[0]) - K))
                     if all(t[:c + K + 1] == full[0][:c + K + 1] for t in full)
                     and accepted_at_first_decode(full[0], c, rule=tab.rule) >= MIN_ACCEPTED)
        # One entry a segment (a run of the same token, longer, continues alike).
        if cuts and all(tokens[:len(seg)] != tuple(seg) for tokens, _ in found):
            found.append((tuple(full[0][:max(cuts) + 1 + K]), cuts))
    return sorted(found, key=lambda e: (min(e[1]), len(e[0])))
