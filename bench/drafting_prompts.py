"""Search a model for self-drafting prompts and print them as a fuzz.cases.drafting_prompts
table (to paste there when the model or its weights change; tests/fuzz/cases/test_drafting.py
says when they no longer continue as stored).

usage: python bench/drafting_prompts.py fuzz|vllm [SEEDS]      # default 192 seed segments
  fuzz: the fuzz model (FUZZ_MODEL_PROMPTS); vllm: the vLLM target's model (VLLM_MODEL_PROMPTS)
"""
from __future__ import annotations

import sys
import textwrap

from fuzz.cases import drafting


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("fuzz", "vllm"):
        print("usage: python bench/drafting_prompts.py fuzz|vllm [SEEDS]", file=sys.stderr)
        return 2
    if argv[0] == "fuzz":
        from fuzz.cases.strategies import FUZZ_MODEL as model
    else:
        from fuzz.targets.vllm.configs import VLLM_MODEL as model
    tab = {"fuzz": drafting.FUZZ, "vllm": drafting.VLLM}[argv[0]]
    seeds = range(int(argv[1]) if len(argv) > 1 else 192)
    for tokens, cuts in drafting.search(model, seeds, tab):
        rows = "\n      ".join(textwrap.wrap(", ".join(map(str, tokens)), 108))
        print(f"    (({rows}),\n     {cuts}),")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
