"""How far clean bfloat16 vLLM runs lie from each oracle of the vLLM checker, in logprobs,
against the low-precision noise of the same Case: what the black-box half-precision rule
(fuzz.verdict.tolerance.BLACKBOX_HALF_RULES, calibrated on transformers' kernels by
bench/tcb_bf16_error.py) leaves on vLLM's kernels. The rule is on for vLLM only where the
largest clean error stays well under its bound.

    PYTHONPATH=$PWD LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python bench/vllm_bf16_error.py \\
        [--cases 60] [--budget 16] [--layout tp1pp1] [--mode eager|compiled] [--out FILE]

Cases: workloads drawn by the campaign's strategy (derandomized) on the vLLM model in bf16,
eager or compiled (torch.compile: inductor's fused kernels round differently), with the given
token budget (16: chunked prefill) and layout; checked by VLLMChecker
with the dtype formula's bound (half_rule off), so that no comparison stops the measurement.
"""
from __future__ import annotations

import argparse


def main() -> None:
    from bench.tcb_bf16_error import report
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.configs import COMPILED, VLLM_MODEL, VLLMOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=60)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--layout", default="tp1pp1")
    ap.add_argument("--mode", choices=("eager", "compiled"), default="eager")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = VLLM_MODEL.replace(dtype="bfloat16", max_num_batched_tokens=args.budget, layout=args.layout,
                             **(COMPILED if args.mode == "compiled" else {}))
    report(VLLMChecker(half_rule=False), cfg, VLLMOptions().on, args.cases,
           lambda chk: {"vllm_version": chk.runner.vllm_version}, args.out,
           "PYTHONPATH=$PWD LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python bench/vllm_bf16_error.py "
           f"--cases {args.cases} --budget {args.budget} --layout {args.layout} --mode {args.mode}")


if __name__ == "__main__":
    main()
