"""Properties: what must hold between a test run and its reference, and on every FA call.

Each property is a function that raises a typed `Violation` carrying the Case. The
harness catches them for shrinking and for writing reproducers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fuzz.case import Case
from fuzz.invariants import FAInvariantError, check_varlen_args


class Violation(AssertionError):
    """A property failed for `case`; `property` names it, `error_ratio` is error/tolerance."""

    property = "violation"

    def __init__(self, message: str, case: Case | None = None, error_ratio: float | None = None) -> None:
        super().__init__(" ".join(str(message).split()))
        self.message = str(self)
        self.case = case
        self.error_ratio = error_ratio


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


class CrashViolation(Violation):
    """The engine raised something that is not a property violation (a crash signature)."""

    property = "crash"


_EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float64: 2.0 ** -52}


def logits_tolerance(dtype: torch.dtype, hidden_size: int, ref_absmax: float) -> float:
    """A dtype-derived bound: k x the rounding error of a length-`hidden` dot product at the
    reference's logit scale (k = 2, as FlashAttention's tests calibrate against fp32)."""
    per_op = 16 * _EPS[dtype] * hidden_size ** 0.5 * max(1.0, ref_absmax)
    return 2.0 * per_op


@dataclass(slots=True)
class LogitsReport:
    max_error: float
    tolerance: float
    positions: int

    @property
    def ratio(self) -> float:
        return self.max_error / self.tolerance if self.tolerance else float("inf")


def check_logits(case: Case, ref, test) -> LogitsReport:
    """Per request, per generated position, the test run's logits row matches the
    reference's within the dtype tolerance, and greedy tokens agree wherever the
    reference's top-2 margin exceeds the tolerance (both runs teacher-forced)."""
    cfg = case.config
    dtype = cfg.torch_dtype()
    worst, worst_tol, n = 0.0, 1.0, 0
    for rid, ref_recs in ref.tokens.items():
        got = test.tokens.get(rid, [])
        if len(got) != len(ref_recs):
            raise LogitsMismatch(f"request {rid}: {len(got)} generated positions, reference has "
                                 f"{len(ref_recs)}", case, float("inf"))
        for i, (r, t) in enumerate(zip(ref_recs, got)):
            absmax = float(r.logits.abs().max())
            tol = logits_tolerance(dtype, cfg.hidden_size, absmax)
            if not torch.isfinite(t.logits).all():
                bad = int((~torch.isfinite(t.logits)).sum())
                raise LogitsMismatch(f"request {rid} position {i}: {bad} non-finite logits "
                                     f"(step {t.step}, microbatch {t.microbatch})", case, float("inf"))
            err = float((t.logits - r.logits).abs().max())
            if err > tol:
                raise LogitsMismatch(f"request {rid} position {i}: max |logits - reference| = {err:.3g} "
                                     f"> tolerance {tol:.3g} (step {t.step}, microbatch {t.microbatch})",
                                     case, err / tol)
            top2 = r.logits.topk(2).values
            if float(top2[0] - top2[1]) > tol and t.sampled != r.sampled:
                raise LogitsMismatch(f"request {rid} position {i}: greedy token {t.sampled} != "
                                     f"reference {r.sampled}", case, err / tol)
            if err / tol >= worst / worst_tol:
                worst, worst_tol = err, tol
            n += 1
    return LogitsReport(worst, worst_tol, n)


def record_args(rec) -> tuple[tuple, dict]:
    """Rebuild a recorded call's arguments for `check_varlen_args` (q/k/v as meta tensors)."""
    dtype = getattr(torch, rec.dtype)
    q = torch.empty_strided(rec.q_shape, rec.q_stride, dtype=dtype, device="meta")
    kv = torch.empty_strided(rec.kv_shape, rec.kv_stride, dtype=dtype, device="meta")
    args = (q, kv, kv, rec.cu_seqlens_q, None, rec.max_seqlen_q, rec.max_seqlen_k)
    kwargs = dict(block_table=rec.block_table, seqused_k=rec.seqused_k, causal=rec.causal,
                  num_reqs=rec.num_reqs, num_actual_tokens=rec.num_actual_tokens,
                  slot_mapping=rec.slot_mapping,
                  require_half=rec.device.startswith("cuda") and rec.backend != "reference")
    return args, kwargs


def check_fa_records(case: Case, records: list) -> int:
    """Every recorded attention call satisfies the FlashAttention varlen contract."""
    seen, n = set(), 0
    for rec in records:
        key = id(rec.cu_seqlens_q)  # layers of one forward share one metadata snapshot
        if key in seen:
            continue
        seen.add(key)
        args, kwargs = record_args(rec)
        try:
            check_varlen_args(*args, **kwargs)
        except FAInvariantError as e:
            where = f"rank {rec.rank} layer {rec.layer} microbatch {rec.microbatch}" + (" (graph replay)" if rec.graph else "")
            raise FAViolation(f"{where}: {e}", case) from None
        n += 1
    return n


def check_determinism(case: Case, a, b) -> None:
    """The same Case run twice gives bitwise identical traces (CPU)."""
    if a.tokens.keys() != b.tokens.keys():
        raise DeterminismViolation("request sets differ between two runs", case)
    for rid in a.tokens:
        for i, (x, y) in enumerate(zip(a.tokens[rid], b.tokens[rid])):
            if x.token != y.token or not torch.equal(x.logits, y.logits):
                raise DeterminismViolation(f"request {rid} position {i} differs between two runs", case)
        if len(a.tokens[rid]) != len(b.tokens[rid]):
            raise DeterminismViolation(f"request {rid}: generated lengths differ between two runs", case)
