"""How far a run's logits may lie from an oracle's: measured noise, not a formula.

float32 / float64 runs: the engine accumulates one precision wider (fp64) and every oracle
computes in the same dtype, so clean runs agree to ~1e-6 of a logit; the bound is a small
multiple of the rounding error of a hidden-size dot product at the row's logit scale.

bfloat16 / float16 runs, FlashAttention's own test rule: an error against the float32
oracle is allowed up to k times the error that plain low-precision arithmetic makes on the
same position, plus atol:

    |test - oracle32| <= k * |base - solo32| + atol

where `base` is the solo oracle (each request alone, whole, plain attention) in the test
dtype and `solo32` the same in float32 on the same rounded weights. The noise is measured
per request (the largest over its positions: one position's baseline error can be small by
chance while the run under test rounds elsewhere). k and atol per dtype were calibrated over
clean runs of every layout and mode (`bench/calibrate_tolerance.py`, results in
`bench/results/tolerance_*.json`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float64: 2.0 ** -52}


@dataclass(frozen=True, slots=True)
class NoiseRule:
    k: float
    atol: float


# Calibrated constants (see the module docstring); the script prints the margins they leave.
HALF_RULES = {"bfloat16": NoiseRule(k=4.0, atol=0.02), "float16": NoiseRule(k=4.0, atol=0.003)}

# The same rule for a black-box target (fuzz.targets.blackbox), in logprobs: |target - fp32
# reference| <= k * noise + atol, where noise is the Case's largest |logprob| error of our own
# engine in the test dtype (solo, plain attention) against float32 on the same rounded weights.
# Another engine's kernels round differently from ours (a GEMM's order, fused norms), hence a
# wider k than the white-box rule's. Calibrated on clean transformers continuous-batching runs
# (bench/tcb_bf16_error.py, bench/results/tcb_bf16_error_cpu.json).
# fp16: atol scaled from the white-box rule (HALF_RULES), not yet calibrated on a black box.
BLACKBOX_HALF_RULES = {"bfloat16": NoiseRule(k=8.0, atol=0.1), "float16": NoiseRule(k=8.0, atol=0.02)}
# vLLM's own, calibrated on its CPU kernels (bench/vllm_bf16_error.py: 180 clean bf16 Cases over
# tp1 eager, tp2 eager and tp1 compiled, bench/results/vllm_bf16_error_cpu.json). The largest
# clean error is 2.64 x the noise (against transformers, itself in bf16; 0.91 x against the
# fp32 reference; vLLM alone and in the batch agree bit for bit), so k = 6 leaves a margin of
# 2.3 (at most 0.44 of the bound; 0.28 the largest over the Cases weighed one by one); atol of
# the white-box rule's order. Tighter than the black-box rule (k 8, atol 0.1), it is what sees
# one wrong KV row in bf16 (docs/vllm.md). fp16: vLLM's CPU plan runs none; the black-box rule.
VLLM_HALF_RULES = {"bfloat16": NoiseRule(k=6.0, atol=0.05), "float16": BLACKBOX_HALF_RULES["float16"]}


def logits_tolerance(dtype: torch.dtype, hidden_size: int, ref_absmax: float) -> float:
    """Full-precision bound: k x the rounding error of a length-`hidden` dot product at the
    reference's logit scale (k = 2, as FlashAttention's tests calibrate against fp32)."""
    per_op = 16 * _EPS[dtype] * hidden_size ** 0.5 * max(1.0, ref_absmax)
    return 2.0 * per_op


def is_half(dtype: str) -> bool:
    return dtype in HALF_RULES


class Tolerance:
    """Per-position bounds for one Case's comparisons."""

    def __init__(self, dtype: str, hidden_size: int, noise: dict[str, float] | None = None,
                 rule: NoiseRule | None = None) -> None:
        self.dtype, self.hidden = dtype, hidden_size
        self.noise = noise or {}  # request id -> measured baseline error (half dtypes)
        self.rule = rule or HALF_RULES.get(dtype)

    def bound(self, rid: str, ref_row: torch.Tensor) -> float:
        if self.rule is None:
            return logits_tolerance(getattr(torch, self.dtype), self.hidden, float(ref_row.abs().max()))
        return self.rule.k * self.noise.get(rid, 0.0) + self.rule.atol

    @staticmethod
    def measure_logprobs(base, solo32) -> float:
        """The largest |log_softmax(base) - log_softmax(solo32)| over every request and position
        (float64): a black box returns logprobs, whose error is the logits' plus the shift of
        the log-normalizer."""
        err = 0.0
        for rid, recs in solo32.tokens.items():
            for b, r in zip(base.tokens[rid], recs):
                d = torch.log_softmax(b.logits.double(), -1) - torch.log_softmax(r.logits.double(), -1)
                err = max(err, float(d.abs().max()))
        return err

    @staticmethod
    def measure(base, solo32) -> dict[str, float]:
        """Per request: the largest |base - solo32| over its positions (two sequence traces)."""
        out = {}
        for rid, recs in solo32.tokens.items():
            errs = [float((b.logits - r.logits).abs().max()) for b, r in zip(base.tokens[rid], recs)]
            out[rid] = max(errs, default=0.0)
        return out
