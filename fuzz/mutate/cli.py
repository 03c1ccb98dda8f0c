"""`llmfuzz mutate`: how strong a green campaign is, as a mutation score (docs/mutate.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from fuzz.errors import EXIT_OK, BadInput


def add_mutate_parser(sub) -> None:
    p = sub.add_parser("mutate", help="mutation analysis: the share of observable engine mutants the campaign "
                       "catches (docs/mutate.md)")
    p.add_argument("--target", default="reference", help="reference (default) or vllm (the installed vllm "
                   "package, mutated in scratch copies; run llmfuzz with the Python that has vLLM: docs/mutate.md)")
    p.add_argument("--paths", nargs="+", default=None, metavar="GLOB",
                   help="files to mutate, globs relative to the target's source root (default: the engine's "
                        "bookkeeping: scheduler, KV cache, input preparation, PP stages, graph runner, "
                        "attention metadata, speculative decoding, engine loop)")
    p.add_argument("--n", type=int, default=20, help="mutants, drawn uniformly over all points (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-per-mutant", type=float, default=60.0, help="campaign seconds per mutant (default 60)")
    p.add_argument("--cases", type=int, default=None, help="fixed Cases each mutant runs, compared bitwise "
                   "with the unmutated engine's outputs (default 24; vllm: 4)")
    p.add_argument("--layouts", default="", help="comma list of the campaign's layouts, e.g. tp1pp1,tp2pp2 "
                   "(default: all, as `llmfuzz run`; vllm: tp1pp1, eager configs only)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once, one process each (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a mutant's process is killed "
                   "and counted as caught by timeout (default: budget + 3x the baseline's time on the Cases + 60; vllm: "
                   "1.1 x budget + 3x the baseline's first start and Cases + 120)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default="reproducers/mutate",
                   help="directory for mutate.json and the survivors' reproducers (default reproducers/mutate)")
    p.set_defaults(fn=cmd_mutate)


def _positive(name: str, v: float) -> None:
    if not 0 < v < float("inf"):
        raise BadInput(f"--{name}: {v:g} is not a positive number")


def _layouts(text: str, target: str) -> tuple[str, ...]:
    """--layouts as `llmfuzz run` reads it (for vLLM: as `llmfuzz run --target vllm`)."""
    from engine.config import ConfigError, parse_layouts
    from fuzz.cases.strategies import FUZZ_MODEL
    from fuzz.targets.vllm.configs import VLLM_MODEL

    try:
        return tuple(dict.fromkeys(parse_layouts(text, VLLM_MODEL if target == "vllm" else FUZZ_MODEL)))
    except ConfigError as e:
        raise BadInput(f"--layouts: {e}") from None


def plan_from_args(args):
    """The Plan, every argument checked (a one-line BadInput) before any process starts."""
    from fuzz.mutate.run import Plan
    from fuzz.mutate.sources import default_paths, find_source

    source = find_source(args.target)
    if args.n < 1:
        raise BadInput(f"--n: {args.n} mutants; it takes 1 or more")
    if args.jobs < 1:
        raise BadInput(f"--jobs: {args.jobs} processes; it takes 1 or more")
    if args.cases is None:
        from fuzz.mutate.vllm import DEFAULT_CASES

        args.cases = DEFAULT_CASES if args.target == "vllm" else 24
    if args.cases < 1:
        raise BadInput(f"--cases: {args.cases}; it takes 1 or more")
    _positive("budget-per-mutant", args.budget_per_mutant)
    if args.timeout is not None:
        _positive("timeout", args.timeout)
    files = source.files(tuple(args.paths or default_paths(args.target)))
    layouts = ()
    if args.layouts:
        layouts = _layouts(args.layouts, args.target)
    return Plan(source, files, args.seed, args.n, args.budget_per_mutant, args.jobs, args.cases, layouts,
                out_dir=args.out, timeout_s=args.timeout, progress=not args.json)


def cmd_mutate(args: argparse.Namespace) -> int:
    from fuzz.campaign.reproduce import write_json_atomic
    from fuzz.mutate.report import build, text
    from fuzz.mutate.run import enumerate_points, run_plan, sample

    plan = plan_from_args(args)
    t0 = time.monotonic()
    mutants = sample(enumerate_points(plan), plan.n, plan.seed)

    def log(line: str) -> None:
        if plan.progress:
            print(f"llmfuzz mutate: {line}", file=sys.stderr, flush=True)

    log(f"{plan.points_total} mutation points in {len(plan.files)} files; {len(mutants)} mutants drawn")
    base, rows = run_plan(plan, mutants, log)
    doc = build(plan, base, rows, time.monotonic() - t0)
    path = os.path.join(plan.out_dir, "mutate.json")
    write_json_atomic(path, doc)
    print(json.dumps(doc, indent=1, sort_keys=True) if args.json else f"{text(doc)}\nreport: {path}")
    return EXIT_OK
