"""How far clean bfloat16 runs of transformers' continuous batching lie from each oracle of
the black-box checker, in logprobs, against the low-precision noise of the same Case: the
data the black-box half-precision rule (fuzz.verdict.tolerance.BLACKBOX_HALF_RULES:
|error| <= k * noise + atol) is calibrated on.

    PYTHONPATH=$PWD python bench/tcb_bf16_error.py [--cases 40] [--out FILE]

Cases: workloads drawn by the campaign's strategy (fuzz.cases.strategies.workloads, derandomized)
on the target's model in bf16 with a 16-token budget (chunked prefill), checked by CBChecker:
per oracle (the fp32 reference, transformers teacher-forced, each request alone) the
largest |delta logprob| over the positions compared (each request up to its first greedy
divergence), and every divergence's margin (the oracle's top-1 minus top-2). The checker runs
with the dtype formula's bound (half_rule off) so that no comparison stops the measurement;
per Case the noise (ReferenceRunner.half_noise) and each oracle's error / noise, and the
largest error / bound under the rule in force. `measure` does it for any black-box checker
(bench/vllm_bf16_error.py: vLLM's).
"""
from __future__ import annotations

import argparse
import json


def dist(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"min": xs[0], "median": xs[len(xs) // 2], "p95": xs[int(0.95 * (len(xs) - 1))], "max": xs[-1]} if xs else {}


def measure(chk, cfg, on, cases: int, max_requests: int = 6) -> dict:
    """Run `cases` drawn workloads on `cfg` (each Case made the target's by `on(case)`) through
    `chk` (a BlackBoxChecker with half_rule off) and return the errors against the noise and
    against the bf16 rule's bound, per oracle."""
    from hypothesis import HealthCheck, given, settings

    from fuzz.cases.case import Case
    from fuzz.cases.strategies import workloads
    from fuzz.verdict.tolerance import BLACKBOX_HALF_RULES

    rule = BLACKBOX_HALF_RULES["bfloat16"]
    worst: dict[str, float] = {}
    stats = {"cases": 0, "positions": 0, "divergences": 0, "largest_divergence_margin": 0.0, "min_tolerance": 1e9}
    ratios: dict[str, list[float]] = {}  # oracle -> error / noise per Case
    over: list[float] = []  # per Case: the largest error / the rule's bound
    noises: list[float] = []
    per_case: list = []  # per Case: [noise, {oracle: error}], to weigh another rule on the same data

    @settings(max_examples=cases, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(workloads(cfg, max_requests))
    def one(wl):
        v = chk.check(on(Case(cfg, wl)))
        stats["cases"] += 1
        stats["positions"] += v.vs_reference.positions
        stats["min_tolerance"] = min(stats["min_tolerance"], v.lp_tol)
        noise = chk.reference.half_noise(v.case)
        noises.append(noise)
        bound = rule.k * noise + rule.atol
        over.append(max(rep.max_lp_error for rep in v.oracles.values()) / bound)
        per_case.append([noise, {name: rep.max_lp_error for name, rep in v.oracles.items()}])
        for name, rep in v.oracles.items():
            worst[name] = max(worst.get(name, 0.0), rep.max_lp_error)
            ratios.setdefault(name, []).append(rep.max_lp_error / noise if noise else float("inf"))
            for d in getattr(rep, "divergences", []):
                stats["divergences"] += 1
                stats["largest_divergence_margin"] = max(stats["largest_divergence_margin"], d[-1])
                stats["max_margin_over_rule_bound"] = max(stats.get("max_margin_over_rule_bound", 0.0), d[-1] / bound)

    one()
    return {**stats, "max_error_over_rule_bound": max(over, default=0.0), "error_over_rule_bound": dist(over),
            "max_lp_error": worst, "rule": {"k": rule.k, "atol": rule.atol}, "noise": dist(noises),
            "error_over_noise": {k: dist(v) for k, v in ratios.items()}, "per_case": per_case}


def report(chk, cfg, on, cases: int, version, out: str | None, command: str) -> None:
    """`measure`, then `chk` closed; print the result with `version(chk)` (what ran it) and, with
    `out`, write it there with the command that made it."""
    try:
        doc = {**measure(chk, cfg, on, cases), **version(chk)}
    finally:
        chk.close()
    print(json.dumps(doc, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump({**doc, "command": command, "machine": "cpu (2 shared cores)"}, f, indent=1)


def main() -> None:
    from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions
    from fuzz.targets.transformers_cb.target import CBChecker

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = CB_MODEL.replace(dtype="bfloat16", max_num_batched_tokens=16)
    report(CBChecker(transformers=True, half_rule=False), cfg, CBOptions().on, args.cases,
           lambda chk: {"transformers_version": chk.runner.version}, args.out,
           f"PYTHONPATH=$PWD python bench/tcb_bf16_error.py --cases {args.cases}")


if __name__ == "__main__":
    main()
