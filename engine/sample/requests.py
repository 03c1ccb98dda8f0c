"""The driver's side of sampling: admitting a request's params (add_request), fanning out
n > 1 into child requests, the stop checks applied to appended tokens, and what the Trace
records of each generated token.
"""
from __future__ import annotations

from engine.config import ConfigError, EngineConfig
from engine.sample import ops
from engine.sample.sampling_params import DEFAULT, SamplingParams, child_request_ids


def resolve_params(req_id: str, params: SamplingParams | None, max_tokens: int) -> tuple[SamplingParams, int]:
    """The request's params (default: plain greedy) and its max_tokens: add_request's, which
    params.max_tokens may repeat but not contradict."""
    params = DEFAULT if params is None else params
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"request {req_id}: sampling_params must be a SamplingParams, got {type(params).__name__}")
    if params.max_tokens is not None and params.max_tokens != max_tokens:
        raise ConfigError(f"request {req_id}: sampling_params.max_tokens={params.max_tokens} "
                          f"contradicts max_tokens={max_tokens}")
    if params.min_tokens > max_tokens:
        raise ConfigError(f"request {req_id}: min_tokens={params.min_tokens} > max_tokens={max_tokens}")
    return params, max_tokens


def check_request_params(cfg: EngineConfig, spec_cfg: EngineConfig, req_id: str, params: SamplingParams) -> None:
    """What SamplingParams cannot check alone: token ids against the vocabulary, and
    speculative decoding, whose verification is greedy (vLLM's rejection sampler is not
    built): random sampling is refused on an engine that drafts."""
    bad = [t for t in params.token_ids() if t >= cfg.vocab_size]
    if bad:
        raise ConfigError(f"request {req_id}: sampling_params token id {min(bad)} outside vocab_size={cfg.vocab_size}")
    if params.min_tokens and len(set(params.stop_token_ids)) >= cfg.vocab_size:
        raise ConfigError(f"request {req_id}: min_tokens would suppress every token (stop_token_ids cover the vocab)")
    if spec_cfg.speculative_method != "none" and not params.is_greedy:
        raise ConfigError(f"request {req_id}: speculative_method={spec_cfg.speculative_method} verifies greedily; "
                          f"temperature={params.temperature} needs a rejection sampler, which is not built")


def fan_out(req_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1: n child requests (vLLM's parallel sampling), each with n=1 and its own seed."""
    if params.n == 1:
        return [(req_id, params)]
    return [(cid, params.child(i)) for i, cid in enumerate(child_request_ids(req_id, params.n))]


def check_stop(req, new_tokens: list[int]) -> tuple[list[int], int | tuple[int, ...] | None]:
    """Of the tokens verified this step, those the request keeps -- appended one by one, up
    to max_tokens and through the first stop -- and what stopped it (a stop token id or a
    stop sequence; None: not stopped, or stopped by max_tokens only). As in vLLM, no stop
    counts before min_tokens outputs."""
    p: SamplingParams = req.sampling_params
    n0, kept = len(req.output_token_ids), []
    for tok in new_tokens:
        if n0 + len(kept) >= req.max_tokens:
            break
        kept.append(tok)
        if n0 + len(kept) < p.min_tokens:
            continue
        if tok in p.stop_token_ids:
            return kept, tok
        for seq in p.stop_sequences:
            L = len(seq)
            if n0 + len(kept) >= L and tuple((req.output_token_ids[-L:] + kept)[-L:]) == seq:
                return kept, seq
    return kept, None


def token_record_fields(out, row: int, sampled: int, params: SamplingParams) -> dict:
    """What a TokenRecord holds besides the raw logits: for requests that record it, the
    processed distribution's logprobs row, the noise of a random draw and the top logprobs
    asked for (the sampled token's included)."""
    if not params.records_distribution or out.processed_logprobs is None:
        return {}
    lp = out.processed_logprobs[row]
    fields = {"logprobs": lp, "noise": out.sample_noise.get(row)}
    if params.logprobs is not None:
        fields["top_logprobs"] = ops.top_logprobs(lp, params.logprobs, sampled)
    return fields


def merge_prompt_logprobs(into: dict[str, list], found: dict[str, tuple[int, list[dict[int, float]]]]) -> None:
    """Prompt logprobs by prompt index (index 0, which nothing predicts, is None). A position
    computed again after a preemption keeps its first value."""
    for rid, (first, rows) in found.items():
        entries = into.setdefault(rid, [None])
        for k, d in enumerate(rows):
            i = first + k
            entries.extend([None] * (i + 1 - len(entries)))
            if entries[i] is None:
                entries[i] = d
