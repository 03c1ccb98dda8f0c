"""Sensitivity of the vLLM checks to a subtle planted bug: a decode in a context of 40 tokens or
more reads position 30's K/V at position 10, every layer (`LLMFUZZ_VLLM_PLANT=wrong_kv_row`,
fuzz/targets/vllm/site/sitecustomize.py). Per dtype and prompt seed (a 44-token prompt, 8
tokens out), the largest |delta logprob| against the fp32 reference and that error over the
bound of each rule: in bf16 vLLM's own (VLLM_HALF_RULES), the black-box rule
(BLACKBOX_HALF_RULES) and the dtype formula; in fp32 the formula. > 1 is caught.

    PYTHONPATH=$PWD LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python bench/vllm_wrong_kv_row.py [--seeds 6]
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    os.environ["LLMFUZZ_VLLM_PLANT"] = "wrong_kv_row"  # the worker's environment is this one's
    from fuzz.cases.case import RequestSpec, Workload
    from fuzz.cases.strategies import tokens_from_seed
    from fuzz.targets.vllm.checker import VLLMChecker, vllm_case
    from fuzz.verdict.properties import Violation
    from fuzz.verdict.tolerance import BLACKBOX_HALF_RULES, VLLM_HALF_RULES

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    c = VLLMChecker(half_rule=False, transformers=False)  # the formula's bound: every error is measured
    out: dict = {}
    try:
        for dtype in ("bfloat16", "float32"):
            for s in range(args.seeds):
                try:
                    v = c.check(vllm_case(Workload((RequestSpec(tokens_from_seed(s, 44, 256), 8),)), dtype=dtype))
                except Violation as e:  # caught under the formula already (fp32): its ratio
                    out.setdefault(dtype, {})[s] = {"caught_by": e.property, "over_formula": e.error_ratio}
                    continue
                err = v.vs_reference.max_lp_error
                row = {"error": round(err, 5), "over_formula": round(err / v.lp_tol, 4)}
                if dtype == "bfloat16":
                    noise = c.reference.half_noise(v.case)
                    for name, rules in (("over_vllm_rule", VLLM_HALF_RULES), ("over_blackbox_rule", BLACKBOX_HALF_RULES)):
                        r = rules[dtype]
                        row[name] = round(err / (r.k * noise + r.atol), 3)
                    row["noise"] = round(noise, 5)
                out.setdefault(dtype, {})[s] = row
    finally:
        c.close()
    print(json.dumps({"command": "PYTHONPATH=$PWD LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python "
                      f"bench/vllm_wrong_kv_row.py --seeds {args.seeds}", "vllm_version": c.runner.vllm_version,
                      "per_seed": out}, indent=1))


if __name__ == "__main__":
    main()
