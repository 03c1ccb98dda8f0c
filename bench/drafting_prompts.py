"""Search the fuzz model for self-drafting prompts and print them as fuzz.cases.drafting.PROMPTS
entries (to paste there when the model or its weights change; tests/fuzz/cases/test_drafting.py
says when they no longer continue as stored).

usage: python bench/drafting_prompts.py [SEEDS]      # default 192 seed segments
"""
from __future__ import annotations

import sys
import textwrap

from fuzz.cases.drafting import search
from fuzz.cases.strategies import FUZZ_MODEL


def main(argv: list[str]) -> int:
    seeds = range(int(argv[0]) if argv else 192)
    for tokens, cuts in search(FUZZ_MODEL, seeds):
        rows = "\n      ".join(textwrap.wrap(", ".join(map(str, tokens)), 108))
        print(f"    (({rows}),\n     {cuts}),")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
