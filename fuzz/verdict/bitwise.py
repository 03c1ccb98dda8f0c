"""Bitwise invariance: where the engine promises two runs bit-identical, and the check of it.

The engine keeps every reduction's order fixed by the data's shape, never by timing or by
what else is in the batch: collectives sum in rank order (engine/parallel_state.py), GEMMs
pad rows to a fixed tile and accumulate in float64 for float32 (engine/model.py), so on the
CPU in float32 a run's logits depend on the Case's layout only. docs/oracles.md#bitwise-invariance
has the measured table (bench/bitwise_invariance.py) this module's rules come from.
"""
from __future__ import annotations

import torch

from fuzz.cases.case import Case
from fuzz.verdict.properties import Violation, aborted_ids

# The guarantee a comparison with the reference can break (the Violation's oracle says
# which; schedule invariance is the determinism oracle's: Harness.check_determinism).
BATCH = "reference"  # tp1 runs vs the reference: batch mix, chunking, PP, graphs, speculation
TWIN = "plain twin"  # tp1 half-precision runs vs their plain form in the same dtype


class BitwiseViolation(Violation):
    """Two runs the engine promises bit-identical differ (`oracle`: the guarantee broken)."""

    property = "bitwise_invariance"


WHY = {BATCH: "the reference (at tp1 a run's bits must not depend on its batch mix, chunking, "
              "pipeline stages, graphs or speculation)",
       TWIN: "its plain twin in the same dtype (tp1pp1 eager, synchronous, no speculation or prefix "
             "caching: at tp1 a half-precision run's bits must not depend on its batch mix, chunking, "
             "pipeline stages, graphs, speculation, caching or async scheduling either)"}


def bitwise_cpu_fp32(case: Case) -> bool:
    """Where the engine promises anything bitwise: the CPU in float32 (half precision rounds
    each GEMM's output to the dtype on a path that depends on the kernel; CUDA kernels choose
    their split by shape and by the device)."""
    return case.config.device == "cpu" and case.config.dtype == "float32"


def reference_bitwise_due(case: Case) -> bool:
    """The test run equals its reference bitwise: CPU fp32 with tp 1 (tp > 1 splits the
    reduction dimension of the row-parallel GEMMs: float64 partials summed in another order,
    which rounds to another float32 about once in a few hundred Cases)."""
    return bitwise_cpu_fp32(case) and case.config.tensor_parallel_size == 1


def twin_bitwise_due(case: Case) -> bool:
    """The test run equals its plain twin (`fuzz.verdict.derived.plain_twin`) bitwise: CPU,
    half precision, tp 1. The float32 reference cannot be compared bit for bit with a half
    run, but the engine's order of every reduction is as fixed in bf16 and fp16 as in
    float32 (GEMMs accumulate in float32 and round once to the half dtype), so the same run's
    plain form in the same dtype can; tp > 1 splits the GEMMs' reduction dimension, whose
    float32 partials then round to another half value in a few Cases of a hundred
    (docs/oracles.md#bitwise-invariance)."""
    cfg = case.config
    return cfg.device == "cpu" and cfg.dtype in ("bfloat16", "float16") and cfg.tensor_parallel_size == 1


def reference_bitwise_skip(case: Case) -> str:
    """Why a CPU Case's run is judged against its reference by the tolerance rule only."""
    if case.config.dtype != "float32":
        return (f"{case.config.dtype}: bitwise equality is promised against the float32 reference in float32 "
                f"only, and against the plain twin in the same dtype at tp1 only")
    return (f"tp{case.config.tensor_parallel_size}: a split reduction dimension sums in another order "
            f"(float64 partials can round to another float32)")


def first_difference(a, b, victims: set[str] = frozenset()) -> str | None:
    """Where two traces first differ in tokens, logits bits or random draws, or None. An
    aborted request compares as a prefix (how far it got depends on the batching)."""
    if a.tokens.keys() != b.tokens.keys():
        return "the request sets differ"
    for rid in sorted(a.tokens):
        x_recs, y_recs = a.tokens[rid], b.tokens[rid]
        if rid in victims:
            k = min(len(x_recs), len(y_recs))
            x_recs, y_recs = x_recs[:k], y_recs[:k]
        for i, (x, y) in enumerate(zip(x_recs, y_recs)):
            noise_same = (x.noise is None and y.noise is None) or (
                x.noise is not None and y.noise is not None and torch.equal(x.noise, y.noise))
            if x.token != y.token or x.sampled != y.sampled or not noise_same \
                    or not torch.equal(x.logits, y.logits):
                same_shape = x.logits.shape == y.logits.shape
                diff = float((x.logits - y.logits).abs().max()) if same_shape else float("inf")
                return (f"request {rid} position {i} (step {x.step}): max |logits diff| = {diff:.3g}, "
                        f"tokens {x.sampled} / {y.sampled}" + ("" if noise_same else ", random draws differ"))
        if len(x_recs) != len(y_recs):
            return f"request {rid}: {len(x_recs)} generated positions, the other run {len(y_recs)}"
    return None


def check_bitwise(case: Case, test, other, guarantee: str) -> None:
    """`test` and `other` are bit-identical, as `guarantee` promises; else a BitwiseViolation
    that names the guarantee and the first difference."""
    where = first_difference(test, other, aborted_ids(case))
    if where is not None:
        raise BitwiseViolation(f"{where}: bitwise invariance broken against {WHY[guarantee]}", case,
                               oracle=guarantee)
