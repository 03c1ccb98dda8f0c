"""The Sampler's transforms on a batch of fp32 logits rows, one parameter value per row.

Every transform is the identity on a row whose parameter is neutral (bias 0, penalties
0 / 1, temperature 1, min_p 0, top_k 0, top_p 1), bit for bit, so a plain row batched with
processed ones samples exactly what it samples alone.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return logits.add_(bias)


def apply_min_tokens(logits: torch.Tensor, suppressed: torch.Tensor) -> torch.Tensor:
    """Stop tokens may not be sampled before min_tokens outputs: their logits become -inf."""
    return logits.masked_fill_(suppressed, NEG_INF)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition (over prompt and output tokens: positive logits divided, others multiplied),
    then frequency (times the output count) and presence (once per output token seen)."""
    seen = output_counts > 0
    rep = torch.where(prompt_mask | seen, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= frequency[:, None] * output_counts.to(logits.dtype)
    logits -= presence[:, None] * seen.to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Greedy rows (temperature 0) are divided by 1: their argmax was taken before."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits.div_(t[:, None])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose logit reaches the k-th largest (ties at the boundary stay)."""
    V = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Over what top-k left: drop the least likely tokens while their total probability is at
    most 1 - p; the most likely token always stays. Rows with p = 1 are left alone (their
    underflowed tokens keep their finite logits)."""
    probs, order = logits.softmax(-1).sort(-1)
    drop_sorted = probs.cumsum(-1) <= (1 - top_p)[:, None]
    drop_sorted[:, -1] = False
    drop_sorted &= (top_p < 1)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill_(drop, NEG_INF)


def draw_noise(vocab_size: int, generator: torch.Generator, device) -> torch.Tensor:
    """One sample's randomness: Exp(1) per token (the exponential race: argmax p / q is a
    draw from p). Clamped away from 0, where p / q would be inf or NaN."""
    q = torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def race(probs_row: torch.Tensor, noise: torch.Tensor) -> int:
    return int((probs_row / noise).argmax())


def top_logprobs(logprobs_row: torch.Tensor, k: int, token: int) -> dict[int, float]:
    """The k most likely tokens of a logprobs row, and `token` (vLLM returns the sampled or
    prompt token's logprob along with the top k)."""
    out = {}
    if k > 0:
        vals, ids = logprobs_row.topk(min(k, logprobs_row.numel()))
        out = dict(zip(ids.tolist(), vals.tolist()))
    out[token] = float(logprobs_row[token])
    return out
