"""Sampler: logits rows -> tokens, in vLLM v1's order.

1. logits processors that change the argmax: logit bias, then min_tokens suppression;
2. penalties: repetition (prompt + output), frequency and presence (output);
3. greedy rows take the argmax here;
4. random rows: temperature, min_p, then top-k and top-p, then a draw with the request's
   own generator (the exponential race: argmax of probs / Exp(1) noise).

The processed distribution of a row is the log-softmax of its logits after every step that
applies to it (greedy rows: after step 2). Rows of requests that record it return it, with
the noise of random rows, so the harness can check both without this code
(fuzz/verdict/oracles/sampling.py).

A random row's generator draws exactly once per token the request samples, whether or not
the driver then appends that token: under teacher forcing the driver appends the forced
token instead, and a test run and its reference must consume randomness identically.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sample import ops
from engine.sample.metadata import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64
    processed_logprobs: torch.Tensor | None = None  # [rows, V] fp32, -inf where masked
    noise: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> its draw's Exp(1) noise


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata | None) -> SamplerOutput:
        if md is None:
            return SamplerOutput(logits.argmax(-1))
        for g in md.unsampled_generators:  # only under a fault (metadata.drawing_rows)
            ops.draw_noise(logits.shape[-1], g, logits.device)
        if md.all_plain:
            return SamplerOutput(logits.argmax(-1))
        # In float32 whatever the model's dtype, as vLLM's sampler: a bf16 softmax and cumulative
        # sum move top-p / min-p borders by far more than rounding (a copy: the raw rows are
        # returned as they are).
        logits = self.apply_logits_processors(logits.to(torch.float32, copy=True), md)
        greedy = logits.argmax(-1)
        if md.all_greedy:
            return SamplerOutput(greedy, logits.log_softmax(-1))
        logits = self.apply_sampling_transforms(logits, md)
        probs = logits.softmax(-1)
        sampled, noise = greedy.clone(), {}
        for row, g in md.generators.items():
            noise[row] = ops.draw_noise(logits.shape[-1], g, logits.device)
            sampled[row] = ops.race(probs[row], noise[row])
        return SamplerOutput(sampled, logits.log_softmax(-1), noise)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.logit_bias is not None:
            ops.apply_logit_bias(logits, md.logit_bias)
        if md.min_tokens_mask is not None:
            ops.apply_min_tokens(logits, md.min_tokens_mask)
        if md.output_counts is not None:
            logits = ops.apply_penalties(logits, md.prompt_mask, md.output_counts, md.repetition_penalty,
                                         md.frequency_penalty, md.presence_penalty)
        return logits

    @staticmethod
    def apply_sampling_transforms(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """What only random rows use; neutral on greedy rows (their params are normalised)."""
        ops.apply_temperature(logits, md.temperature)
        if bool((md.min_p > 0).any()):
            ops.apply_min_p(logits, md.min_p)
        if bool((md.top_k > 0).any()):
            ops.apply_top_k(logits, md.top_k)
        if bool((md.top_p < 1).any()):
            ops.apply_top_p(logits, md.top_p)
        return logits


def prompt_logprobs(logits: torch.Tensor, md: SamplingMetadata) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """Per request: (index of the first prompt token covered, per position the raw
    distribution's top-k logprobs and the prompt token's own). `logits`: the rows of every
    position in md.prompt_logprobs, in order."""
    out, i = {}, 0
    lp = logits.float().log_softmax(-1).cpu()
    for p in md.prompt_logprobs:
        n = len(p.token_indices)
        out[p.req_id] = (p.first_token, [ops.top_logprobs(lp[i + j], p.num_logprobs, t)
                                         for j, t in enumerate(p.target_ids)])
        i += n
    return out
