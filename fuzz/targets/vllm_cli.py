"""The vLLM commands: `llmfuzz run --target vllm` (alias `llmfuzz vllm run`), `llmfuzz vllm
replay` (what `llmfuzz replay` calls for a vLLM reproducer) and `llmfuzz vllm cells`.

The campaign, minimizer and replay they drive are in `fuzz.targets.vllm_campaign`. Nothing
here imports torch or vLLM at import time: `llmfuzz --help` builds these parsers.
"""
from __future__ import annotations

import json
import sys

from fuzz.targets.vllm_campaign import (EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, BadArgs, VLLMCampaign,
                                        campaign_configs, load_known, replay)


def _cmd_run(args) -> int:
    """`llmfuzz run --target vllm ...` and `llmfuzz vllm run ...`."""
    from fuzz.targets import TargetUnavailable
    from fuzz.targets.vllm_target import vllm_python

    prog = getattr(args, "prog", "llmfuzz run --target vllm")
    if not 0 < args.budget < float("inf"):
        print(f"{prog}: --budget {args.budget} is not a positive number of seconds", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        configs = campaign_configs(budget_s=args.budget, seed=args.seed, count=args.configs, layouts=args.layouts,
                                   modes=args.modes, cells=args.cells, exclude=args.exclude)
    except BadArgs as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        known = load_known(args.known)
    except OSError as e:
        print(f"{prog}: --known {args.known}: {e.strerror}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        vllm_python()  # before anything starts: one line naming the missing package
        camp = VLLMCampaign(configs, budget_s=args.budget, out_dir=args.out or "reproducers/vllm", seed=args.seed,
                            known=known, max_requests=args.max_requests, shrink_s=args.shrink_budget,
                            progress=not args.quiet, shrink_configs=not args.no_config_shrink)
        summary = camp.run()
    except TargetUnavailable as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(summary.to_json(), indent=1))
    else:
        print(f"vLLM {summary.vllm_version}, {summary.seconds:.0f}s, oracles: {', '.join(summary.oracles)}")
        print(summary.table())
        for f in summary.failures:
            print(f"\nFAILED {f['property']} on {f['config']}: {f['message'][:300]}\n  case: {f['case']}\n"
                  f"  Reproduce with: llmfuzz replay {f['path']}")
        if summary.interrupted:
            print("(interrupted: summary so far)")
    return EXIT_FAIL if summary.failures else EXIT_OK


def _cmd_replay(args) -> int:
    from fuzz.case import CaseFormatError
    from fuzz.targets import TargetUnavailable

    try:
        repro, v, version = replay(args.file)
    except CaseFormatError as e:
        print(f"llmfuzz vllm replay: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (TargetUnavailable, ValueError) as e:
        print(f"llmfuzz vllm replay: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    meta = repro.meta or {}
    rec_sig = meta.get("signature")
    same = v is not None and v.property == repro.property and getattr(v, "signature", None) == rec_sig
    if args.json:
        print(json.dumps({"file": args.file, "reproduces": v is not None, "same_failure": same,
                          "property": getattr(v, "property", None), "message": str(v) if v else None,
                          "signature": getattr(v, "signature", None), "recorded_property": repro.property,
                          "recorded_signature": rec_sig, "vllm_version": version,
                          "recorded_vllm_version": meta.get("vllm_version")}))
    else:
        print(f"Failing case: {repro.case.describe()}  [vLLM {version}; recorded with "
              f"{meta.get('vllm_version')}; options {meta.get('vllm_options')}]\n  file: {args.file}")
        if v is None:
            print(f"What was violated: nothing now; the case passes (recorded: {repro.property}: {repro.message})")
        else:
            print(f"What was violated: {v.property}: {v}" + ("" if same else
                  f"\n  (recorded: {repro.property}: {repro.message})"))
        print(f"Reproduce with: llmfuzz replay {args.file}")
    return EXIT_FAIL if v is not None else EXIT_OK


def _cmd_cells(args) -> int:
    from fuzz.targets.vllm_target import cell_name, llm_kwargs

    try:
        configs = campaign_configs(budget_s=args.budget, seed=args.seed, count=args.configs, layouts=args.layouts,
                                   modes=args.modes, cells=None, exclude=args.exclude)
    except BadArgs as e:
        print(f"llmfuzz vllm cells: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for cfg, opts in configs:
        print(f"{cell_name(cfg, opts)}\n    {llm_kwargs(cfg, opts)}")
    return EXIT_OK


def add_vllm_run_options(r, *, standalone: bool) -> None:
    """The options of a vLLM campaign. `standalone`: for `llmfuzz vllm run`, which also needs
    the ones `llmfuzz run` already has (--budget, --layouts, --modes, --seed, --out, --json,
    --quiet)."""
    if standalone:
        r.add_argument("--budget", type=float, default=600.0, help="seconds (default 600)")
        r.add_argument("--layouts", default="", help="comma list of layouts to draw from (default tp1pp1,tp2pp1,tp1pp2)")
        r.add_argument("--modes", default="", help="comma list: eager, compiled (graph = compiled; default both)")
        r.add_argument("--seed", type=int, default=0)
        r.add_argument("--out", default=None, help="reproducer directory (default reproducers/vllm)")
        r.add_argument("--json", action="store_true", help="print the summary as JSON (progress still on stderr)")
        r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    t = "(--target vllm) " if not standalone else ""
    r.add_argument("--configs", type=int, default=None,
                   help=f"{t}how many vLLM configs to draw (default: one per 150 s of budget, at most 12)")
    r.add_argument("--cells", default=None, help=f"{t}comma list of config names to visit instead of drawing "
                   "(e.g. tp1pp2-eager,tp1pp1-compiled-b16-s2; see `llmfuzz vllm cells`)")
    r.add_argument("--exclude", default=None, help=f"{t}comma list of config-name prefixes not to visit (e.g. tp1pp2-eager)")
    r.add_argument("--known", default=None, help=f"{t}known-failures file: one crash signature per line")
    r.add_argument("--max-requests", type=int, default=8, help=f"{t}requests per workload (default 8)")
    r.add_argument("--shrink-budget", type=float, default=300.0, help=f"{t}seconds per failure for shrinking")
    r.add_argument("--no-config-shrink", action="store_true",
                   help=f"{t}shrink a failure's workload only, not its config (each config step restarts vLLM)")


def add_vllm_parser(subparsers) -> None:
    """`llmfuzz vllm run|replay|cells` (imports nothing heavy until a command runs)."""
    v = subparsers.add_parser("vllm", help="fuzz a real vLLM (needs vLLM: scripts/setup_vllm_cpu.sh, docs/vllm.md)")
    vs = v.add_subparsers(dest="vllm_cmd", required=True)
    r = vs.add_parser("run", help="time-budgeted campaign against vLLM (= llmfuzz run --target vllm)")
    add_vllm_run_options(r, standalone=True)
    r.set_defaults(fn=_cmd_run, prog="llmfuzz vllm run")
    rp = vs.add_parser("replay", help="re-run a vLLM reproducer: exit 1 if it still fails (= llmfuzz replay)")
    rp.add_argument("file")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(fn=_cmd_replay)
    c = vs.add_parser("cells", help="list the vLLM configs a campaign with this budget and seed visits")
    c.add_argument("--budget", type=float, default=600.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--configs", type=int, default=None)
    c.add_argument("--layouts", default="")
    c.add_argument("--modes", default="")
    c.add_argument("--exclude", default=None)
    c.set_defaults(fn=_cmd_cells)


def main(argv: list[str] | None = None) -> int:
    """`python -m fuzz.targets.vllm_cli run ...` (the same as `llmfuzz vllm run ...`)."""
    import argparse

    p = argparse.ArgumentParser(prog="llmfuzz")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_vllm_parser(sub)
    args = p.parse_args(["vllm", *(argv if argv is not None else sys.argv[1:])])
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
