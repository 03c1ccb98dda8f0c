"""How far clean bfloat16 runs of transformers' continuous batching lie from each oracle of
the black-box checker, in logprobs: the data a bf16 tolerance for that target would be
calibrated on (docs/transformers_cb.md: none is used yet; the generic black-box formula
gives ~30-40 nats, under which every comparison passes and reports its largest error).

    PYTHONPATH=$PWD python bench/tcb_bf16_error.py [--cases 40] [--out FILE]

Cases: workloads drawn by the campaign's strategy (fuzz.strategies.workloads, derandomized)
on the target's model in bf16 with a 16-token budget (chunked prefill), checked by CBChecker:
per oracle (the fp32 reference, transformers teacher-forced, each request alone) the
largest |delta logprob| over the positions compared (each request up to its first greedy
divergence), and every divergence's margin (the oracle's top-1 minus top-2).
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    from hypothesis import HealthCheck, given, settings

    from fuzz.case import Case
    from fuzz.strategies import workloads
    from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions
    from fuzz.targets.transformers_cb.target import CBChecker

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = CB_MODEL.replace(dtype="bfloat16", max_num_batched_tokens=16)
    chk = CBChecker(transformers=True)
    worst: dict[str, float] = {}
    stats = {"cases": 0, "positions": 0, "divergences": 0, "largest_divergence_margin": 0.0, "min_tolerance": 1e9}

    @settings(max_examples=args.cases, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(workloads(cfg, 6))
    def one(wl):
        v = chk.check(CBOptions().on(Case(cfg, wl)))
        stats["cases"] += 1
        stats["positions"] += v.vs_reference.positions
        stats["min_tolerance"] = min(stats["min_tolerance"], v.lp_tol)
        for name, rep in v.oracles.items():
            worst[name] = max(worst.get(name, 0.0), rep.max_lp_error)
            for d in getattr(rep, "divergences", []):
                stats["divergences"] += 1
                stats["largest_divergence_margin"] = max(stats["largest_divergence_margin"], d[-1])

    try:
        one()
    finally:
        chk.close()
    doc = {**stats, "max_lp_error": worst, "transformers_version": chk.runner.version}
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**doc, "command": f"PYTHONPATH=$PWD python bench/tcb_bf16_error.py --cases {args.cases}",
                       "machine": "cpu (2 shared cores)"}, f, indent=1)


if __name__ == "__main__":
    main()
