"""Properties: what must hold between a test run and its reference, and on every FA call.

Each property is a function that raises a typed `Violation` carrying the Case. The
harness catches them for shrinking and for writing reproducers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fuzz.case import Case
from fuzz.tolerance import Tolerance
from fuzz.invariants import FAInvariantError, check_varlen_args


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


def check_logits(case: Case, ref, test, tol: Tolerance, oracle: str = "reference") -> LogitsReport:
    """Per request, per generated position, the test run's logits row lies within the noise
    bound of the oracle's, and greedy tokens agree wherever the oracle's top-2 margin exceeds
    that bound (all runs teacher-forced with the same tokens). A failure reports the worst
    position, so its ratio says how far past the bound the bug lands."""
    worst, worst_tol, n, bad = 0.0, 1.0, 0, None
    for rid, ref_recs in ref.tokens.items():
        got = test.tokens.get(rid, [])
        if len(got) != len(ref_recs):
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
            elif bad is None and margin > bound and t.sampled != r.sampled:
                bad = (err / bound, f"request {rid} position {i}: greedy token {t.sampled} != {oracle} "
                                    f"{r.sampled} (margin {margin:.3g} > noise bound {bound:.3g}) {where}")
            if err / bound >= worst / worst_tol:
                worst, worst_tol = err, bound
            n += 1
    if bad is not None:
        raise LogitsMismatch(bad[1], case, bad[0], oracle)
    return LogitsReport(oracle, worst, worst_tol, n)


def check_fa_records(case: Case, records: list) -> int:
    """Every recorded attention call satisfies the FlashAttention varlen contract. Each record
    counts on its own: the layers of one forward share a metadata snapshot, but each call has
    its own scalars (a bad max_seqlen_q in layer 5 must not hide behind a good layer 0)."""
    # Verdicts of calls already found good, by everything the contract reads of a record
    # (its scalars and shapes included): a record equal to one of them would get the same
    # verdict, so only distinct calls pay for the value checks (most layers of a forward).
    passed: set[tuple] = set()
    contents: dict = {}  # snapshot bytes by identity, shared by the records of this check
    for rec in records:
        key = rec.contract_key(contents)
        if key in passed:
            continue
        try:
            check_varlen_args(**rec.varlen_args())
        except FAInvariantError as e:
            where = f"rank {rec.rank} layer {rec.layer} microbatch {rec.microbatch}" + (" (graph replay)" if rec.graph else "")
            raise FAViolation(f"{where}: {e}", case) from None
        passed.add(key)
    return len(records)


def check_determinism(case: Case, a, b) -> None:
    """The same Case run twice gives bitwise identical traces (CPU)."""
    if a.tokens.keys() != b.tokens.keys():
        raise DeterminismViolation("request sets differ between two runs", case, oracle="determinism")
    for rid in a.tokens:
        for i, (x, y) in enumerate(zip(a.tokens[rid], b.tokens[rid])):
            if x.token != y.token or x.sampled != y.sampled or not torch.equal(x.logits, y.logits):
                diff = float((x.logits - y.logits).abs().max()) if x.logits.shape == y.logits.shape else float("inf")
                raise DeterminismViolation(f"request {rid} position {i} differs between two runs of the same "
                                           f"Case (max |logits diff| = {diff:.3g}, tokens {x.sampled} / "
                                           f"{y.sampled})", case, oracle="determinism")
        if len(a.tokens[rid]) != len(b.tokens[rid]):
            raise DeterminismViolation(f"request {rid}: generated lengths differ between two runs", case,
                                       oracle="determinism")
