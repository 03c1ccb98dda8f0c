"""Properties: what must hold between a test run and its reference, and on every FA call.

Each property is a function that raises a typed `Violation` carrying the Case. The
harness catches them for shrinking and for writing reproducers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fuzz.cases.case import Case
from fuzz.verdict.oracles import drafts as drafts_oracle, sampling as sampling_oracle
from fuzz.verdict.tolerance import Tolerance
from fuzz.verdict.invariants import FAInvariantError, check_varlen_args


class Violation(AssertionError):
    """A property failed for `case`; `property` names it, `error_ratio` is error/tolerance,
    `oracle` what the run was compared against (None for checks of the run alone)."""

    property = "violation"

    def __init__(self, message: str, case: Case | None = None, error_ratio: float | None = None,
                 oracle: str | None = None) -> None:
        super().__init__(" ".join(str(message).split()))
        self.message = str(self)
        self.case = case
        self.error_ratio = error_ratio
        self.oracle = oracle
        self.second_opinion: str | None = None  # another oracle's verdict on the same Case


class LogitsMismatch(Violation):
    property = "logits"


class FAViolation(Violation):
    property = "fa_invariants"


class EngineViolation(Violation):
    property = "engine_invariants"


class LivenessViolation(Violation):
    property = "liveness"


class DeterminismViolation(Violation):
    property = "determinism"


class PrefixCacheViolation(Violation):
    """With prefix caching on, the run differs from the same run with caching off (fp32 CPU,
    where the engine promises them bitwise equal)."""

    property = "prefix_cache_invariance"


class SamplingViolation(Violation):
    """A request's sampling disagrees with the independent sampler (oracle "sampling"), or its
    random draws with the same request's in another run ("reference", "solo"), or its prompt
    logprobs with the solo oracle's rows ("solo")."""

    property = "sampling"


class DraftViolation(Violation):
    """An n-gram draft differs from the rule the engine documents (fuzz/verdict/oracles/drafts.py):
    invisible in the outputs, since verification rejects a wrong draft."""

    property = "drafts"


class CrashViolation(Violation):
    """The engine raised something that is not a property violation (a crash signature)."""

    property = "crash"


def same_failure(a, b) -> bool:
    """A minimizer keeps a candidate that fails the same way: same property, same oracle, and
    for crashes the same signature (another crash is another bug)."""
    return (a.property, a.oracle, getattr(a, "signature", None)) == \
        (b.property, b.oracle, getattr(b, "signature", None))


@dataclass(slots=True)
class LogitsReport:
    oracle: str
    max_error: float
    tolerance: float
    positions: int

    @property
    def ratio(self) -> float:
        return self.max_error / self.tolerance if self.tolerance else float("inf")


def aborted_ids(case) -> set[str]:
    """Requests a Case aborts (their records compare as prefixes: how far a request got before
    its abort step depends on the layout)."""
    return case.workload.aborted_ids() if isinstance(case, Case) else set()


def check_logits(case: Case, ref, test, tol: Tolerance, oracle: str = "reference") -> LogitsReport:
    """Per request, per generated position, the test run's logits row lies within the noise
    bound of the oracle's, and greedy tokens agree wherever the oracle's top-2 margin exceeds
    that bound (all runs teacher-forced with the same tokens). A failure reports the worst
    position, so its ratio says how far past the bound the bug lands. An aborted request
    compares over the positions both runs have; a request whose sampling params process the
    logits (penalties, bias, random sampling) compares its raw rows only: its tokens are the
    sampling checks' (`check_sampling`, `check_noise`)."""
    worst, worst_tol, n, bad = 0.0, 1.0, 0, None
    victims = aborted_ids(case)
    processed = {rid for rid, p in getattr(test, "sampling_params", {}).items() if p.processes_logits}
    for rid, ref_recs in ref.tokens.items():
        got = test.tokens.get(rid, [])
        if rid in victims:
            k = min(len(got), len(ref_recs))
            got, ref_recs = got[:k], ref_recs[:k]
        elif len(got) != len(ref_recs):
            raise LogitsMismatch(f"request {rid}: {len(got)} generated positions, {oracle} has "
                                 f"{len(ref_recs)}", case, float("inf"), oracle)
        for i, (r, t) in enumerate(zip(ref_recs, got)):
            bound = tol.bound(rid, r.logits)
            where = f"(step {t.step}, microbatch {t.microbatch})"
            if not torch.isfinite(t.logits).all():
                nonfinite = int((~torch.isfinite(t.logits)).sum())
                raise LogitsMismatch(f"request {rid} position {i}: {nonfinite} non-finite logits {where}",
                                     case, float("inf"), oracle)
            err = float((t.logits - r.logits).abs().max())
            top2 = r.logits.topk(2).values
            margin = float(top2[0] - top2[1])
            if err > bound and (bad is None or err / bound > bad[0]):
                bad = (err / bound, f"request {rid} position {i}: max |logits - {oracle}| = {err:.3g} "
                                    f"> tolerance {bound:.3g} {where}")
            elif bad is None and margin > bound and t.sampled != r.sampled and rid not in processed:
                bad = (err / bound, f"request {rid} position {i}: greedy token {t.sampled} != {oracle} "
                                    f"{r.sampled} (margin {margin:.3g} > noise bound {bound:.3g}) {where}")
            if err / bound >= worst / worst_tol:
                worst, worst_tol = err, bound
            n += 1
    if bad is not None:
        raise LogitsMismatch(bad[1], case, bad[0], oracle)
    return LogitsReport(oracle, worst, worst_tol, n)


def decodes_first(cu_seqlens_q: torch.Tensor, num_reqs: int) -> str | None:
    """The batch order the engine's metadata promises (InputBatch.reorder_batch, as vLLM's
    reorder_batch_threshold of 1): every one-token row before every longer one; rows of no
    tokens (graph padding) aside. None when it holds, else what breaks it."""
    q_lens = (cu_seqlens_q[1:num_reqs + 1] - cu_seqlens_q[:num_reqs]).tolist()
    longer = next((i for i, n in enumerate(q_lens) if n > 1), None)
    late = None if longer is None else next((i for i in range(longer + 1, len(q_lens)) if q_lens[i] == 1), None)
    if late is None:
        return None
    return (f"batch order: row {late} runs 1 token after row {longer} runs {q_lens[longer]} "
            f"(reorder_batch puts decodes first)")


def padded_rows_null(block_table: torch.Tensor, num_reqs: int) -> str | None:
    """Graph padding as the engine's metadata promises it (vLLM's rules): the rows a padded
    graph is handed past the batch's own point at the null block 0 only, never at blocks a
    request holds. None when they do, else the first that does not."""
    padded = block_table[num_reqs:]
    bad = (padded != 0).any(dim=1).nonzero().flatten()
    if not bad.numel():
        return None
    row = padded[int(bad[0])]
    return (f"padded row {num_reqs + int(bad[0])} points at blocks {sorted(set(row[row != 0].tolist()))[:4]}, "
            f"not the null block 0")


def graph_shape(cfg, graph: bool, num_actual_tokens: int, num_rows: int) -> str | None:
    """The shape a call runs at, as the config promises it, derived here from the config alone
    (not the engine's dispatcher): in FULL graph mode a batch replays the smallest captured
    size (a multiple of tp under sequence parallelism) that holds its tokens rounded up to that
    multiple, and runs eager at its own token count only where that size is past the token
    budget (or there is none); without graphs, always eager at its own count. A pooled engine
    is built with a larger budget than the Case's (fuzz.verdict.engine_pool), so a graph past
    the Case's budget may replay. A dispatcher that runs graph-mode batches eager, or pads to a
    larger graph than needed, computes the same tokens; only this sees it. None when the shape
    holds, else what differs."""
    m = cfg.tp if cfg.sequence_parallel else 1
    need = -(-num_actual_tokens // m) * m
    fits = min((s for s in cfg.capture_sizes if s % m == 0 and s >= need), default=None)
    if cfg.cudagraph_mode != "FULL" or fits is None:
        want = (False, num_actual_tokens)
    elif graph or fits <= cfg.max_num_batched_tokens:
        want = (True, fits)
    else:
        want = (False, num_actual_tokens)
    if (graph, num_rows) == want:
        return None
    how = lambda g, n: f"a graph of {n} rows" if g else f"eager at {n} rows"
    return (f"graph shape: {num_actual_tokens} tokens ran {how(graph, num_rows)}; cudagraph_mode={cfg.cudagraph_mode} "
            f"with capture sizes {tuple(cfg.capture_sizes)} runs them {how(*want)}")


def check_fa_records(case: Case, records: list) -> int:
    """Every recorded attention call satisfies the FlashAttention varlen contract, and the
    target model's calls hand it the rows in the engine's batch order (`decodes_first`),
    padded rows pointing at the null block (`padded_rows_null`) and run at the shape the
    graph mode promises (`graph_shape`). Each record
    counts on its own: the layers of one forward share a metadata snapshot, but each call has
    its own scalars (a bad max_seqlen_q in layer 5 must not hide behind a good layer 0)."""
    # Verdicts of calls already found good, by everything the contract reads of a record
    # (its scalars and shapes included): a record equal to one of them would get the same
    # verdict, so only distinct calls pay for the value checks (most layers of a forward).
    passed: set[tuple] = set()
    contents: dict = {}  # snapshot bytes by identity, shared by the records of this check
    layers = case.config.num_hidden_layers if case is not None else 0  # records without a Case: the contract only
    for rec in records:
        key = (rec.graph, rec.contract_key(contents))  # graph_shape reads where it ran too
        if key in passed:
            continue
        where = f"rank {rec.rank} layer {rec.layer} microbatch {rec.microbatch}" + (" (graph replay)" if rec.graph else "")
        try:
            check_varlen_args(**rec.varlen_args())
        except FAInvariantError as e:
            raise FAViolation(f"{where}: {e}", case) from None
        if rec.layer < layers:  # the target model's forward (a drafter's has its own rows)
            broken = (decodes_first(rec.cu_seqlens_q, rec.num_reqs) or padded_rows_null(rec.block_table, rec.num_reqs)
                      or graph_shape(case.config, rec.graph, rec.num_actual_tokens, rec.q_shape[0]))
            if broken:
                raise FAViolation(f"{where}: {broken}", case)
        passed.add(key)
    return len(records)


def check_determinism(case: Case, a, b) -> None:
    """The same Case run twice gives bitwise identical traces (CPU)."""
    if a.tokens.keys() != b.tokens.keys():
        raise DeterminismViolation("request sets differ between two runs", case, oracle="determinism")
    for rid in a.tokens:
        for i, (x, y) in enumerate(zip(a.tokens[rid], b.tokens[rid])):
            if x.token != y.token or x.sampled != y.sampled or not torch.equal(x.logits, y.logits) \
                    or not _same_noise(x, y):
                diff = float((x.logits - y.logits).abs().max()) if x.logits.shape == y.logits.shape else float("inf")
                raise DeterminismViolation(f"request {rid} position {i} differs between two runs of the same "
                                           f"Case (max |logits diff| = {diff:.3g}, tokens {x.sampled} / "
                                           f"{y.sampled})", case, oracle="determinism")
        if len(a.tokens[rid]) != len(b.tokens[rid]):
            raise DeterminismViolation(f"request {rid}: generated lengths differ between two runs", case,
                                       oracle="determinism")


def _same_noise(x, y) -> bool:
    """Two records drew the same random noise (or neither drew)."""
    if x.noise is None or y.noise is None:
        return x.noise is None and y.noise is None
    return torch.equal(x.noise, y.noise)


def check_prefix_cache_invariance(case: Case, on, off) -> None:
    """The run with prefix caching on gives bitwise the tokens, logits and random draws of the
    same Case, teacher-forced alike, with caching off: a hit only skips computing KV that is
    already there (on CPU in fp32, where the engine promises it; elsewhere the reference
    oracle's tolerance judges it). An aborted request compares as a prefix: a hit can take it
    further before its abort."""
    if on.tokens.keys() != off.tokens.keys():
        raise PrefixCacheViolation("request sets differ between caching on and off", case, oracle="caching off")
    victims = aborted_ids(case)
    for rid in on.tokens:
        a, b = on.tokens[rid], off.tokens[rid]
        if rid in victims:
            a, b = a[:min(len(a), len(b))], b[:min(len(a), len(b))]
        for i, (x, y) in enumerate(zip(a, b)):
            if x.token != y.token or x.sampled != y.sampled or not torch.equal(x.logits, y.logits) \
                    or not _same_noise(x, y):
                same_shape = x.logits.shape == y.logits.shape
                diff = float((x.logits - y.logits).abs().max()) if same_shape else float("inf")
                finite = bool(torch.isfinite(x.logits).all())
                raise PrefixCacheViolation(
                    f"request {rid} position {i}: prefix caching on differs from off (max |logits diff| = "
                    f"{diff:.3g}{'' if finite else ', non-finite logits with caching on'}, tokens {x.sampled} / "
                    f"{y.sampled}, step {x.step})", case, oracle="caching off")
        if len(a) != len(b):
            raise PrefixCacheViolation(f"request {rid}: {len(a)} generated positions with prefix caching on, "
                                       f"{len(b)} off", case, oracle="caching off")


# -- sampling ----------------------------------------------------------------------------------

_TRACE_LINE = re.compile(r"^sampling: request (\S+) output (\d+) \(step (\d+)\): (.*)$")


def check_ngram_drafts(case: Case, test) -> None:
    """Each n-gram draft of the run is the rule's for the tokens the proposer saw."""
    reqs = case.workload.engine_requests()
    prompts = {rid: list(r.prompt_token_ids) for rid, _, r, _ in reqs}
    why = drafts_oracle.check_drafts(test, prompts, {rid: r.max_tokens for rid, _, r, _ in reqs},
                                     case.config.num_speculative_tokens, case.config.max_model_len)
    if why is not None:
        raise DraftViolation(why, case, oracle="ngram rule")


def check_sampling(case: Case, test, prompts: dict[str, list[int]]) -> None:
    """The independent sampler (fuzz/verdict/oracles/sampling.py, which shares no code with
    the engine) agrees with every recorded processed distribution, sampled token and top
    logprobs of the requests with sampling params."""
    problems = sampling_oracle.check_trace(test, prompts)
    if problems:
        m = _TRACE_LINE.match(problems[0])
        msg = f"request {m[1]} position {m[2]}: {m[4]} (step {m[3]})" if m else problems[0]
        raise SamplingViolation(msg, case, oracle="sampling")


_AGAINST = {"reference": "the reference's", "solo": "the request's run alone, unchunked",
            "determinism": "the same Case's other run"}


def check_noise(case: Case, test, other, oracle: str, rid: str | None = None) -> None:
    """Each random draw of the test run is bitwise `other`'s at the same output index (same
    seed, same draws: a request's generator draws once per token it samples, whatever it is
    batched or chunked with). `rid`: that request only."""
    test_part = test if rid is None else _only(test, rid)
    problems = sampling_oracle.compare_noise(test_part, other)
    if problems:
        m = re.match(r"^sampling: request (\S+) output (\d+):", problems[0])
        where = f"request {m[1]} position {m[2]}" if m else "a request"
        raise SamplingViolation(f"{where}: its random draw differs from {_AGAINST.get(oracle, oracle)} "
                                f"(the generator is out of step)", case, oracle=oracle)


def _only(trace, rid: str):
    from types import SimpleNamespace

    return SimpleNamespace(tokens={rid: trace.tokens.get(rid, [])})


def check_prompt_logprobs(case: Case, rid: str, recorded: list, prompt_logits: torch.Tensor, prompt) -> None:
    """The prompt logprobs the run reported for `rid` are those of the solo oracle's rows over
    the prompt (`prompt_logits[i - 1]` predicts prompt token i)."""
    why = sampling_oracle.check_prompt_logprobs(recorded, prompt_logits.double().numpy(), list(prompt))
    if why is not None:
        raise SamplingViolation(f"request {rid}: {why}", case, oracle="solo")
