"""The vLLM commands: `llmfuzz run --target vllm` (alias `llmfuzz vllm run`), `llmfuzz vllm
replay` (what `llmfuzz replay` calls for a vLLM reproducer) and `llmfuzz vllm cells`.

They drive the shared campaign, minimizer and writer (fuzz.campaign, fuzz.shrink,
fuzz.reproduce) on the vLLM target (`fuzz.targets.vllm_fuzz`). Nothing here imports torch
or vLLM at import time: `llmfuzz --help` builds these parsers.
"""
from __future__ import annotations

import json

from fuzz.cli_common import EXIT_FAIL, EXIT_OK, EXIT_UNWRITTEN, BadInput
from fuzz.targets.vllm_campaign import VLLMCampaign, campaign_configs, load_known


def _cmd_run(args) -> int:
    """`llmfuzz run --target vllm ...` and `llmfuzz vllm run ...`: fuzz.campaign.Campaign on
    the vLLM target."""
    from fuzz.targets import TargetUnavailable
    from fuzz.targets.vllm_target import vllm_python

    if not 0 < args.budget < float("inf"):
        raise BadInput(f"--budget {args.budget} is not a positive number of seconds")
    import sys

    from fuzz.targets.vllm_campaign import default_known, format_plan, plan_report

    configs = campaign_configs(budget_s=args.budget, seed=args.seed, count=args.configs, layouts=args.layouts,
                               modes=args.modes, cells=args.cells, exclude=args.exclude)
    try:
        known = default_known() if args.known is None else load_known(args.known)
    except OSError as e:
        raise BadInput(f"--known {args.known}: {e.strerror}") from None
    plan = plan_report(configs, args.seed, args.layouts, args.modes)
    try:
        vllm_python()  # before anything starts: one line naming the missing package
        if not args.quiet:
            sys.stderr.write(format_plan(plan) + "\n")
        camp = VLLMCampaign(configs, budget_s=args.budget, out_dir=args.out or "reproducers/vllm", seed=args.seed,
                            known=known, max_requests=args.max_requests,
                            shrink_s=args.shrink_budget, plan=plan,
                            progress=not args.quiet, shrink_configs=not args.no_config_shrink)
        summary = camp.run()  # closes the engine it started
        doc = summary.to_json()
    except TargetUnavailable as e:
        raise BadInput(str(e)) from None
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"vLLM {doc['vllm_version']}, {summary.seconds:.0f}s, oracles: {', '.join(doc['oracles'])}")
        print(summary.table())
        for f in doc["failures"]:
            print(f"\nFAILED {f['property']} on {f['config']}: {f['message'][:300]}\n  case: {f['case']}\n"
                  f"  Reproduce with: llmfuzz replay {f['path']}")
        if summary.interrupted:
            print("(interrupted: summary so far)")
    if summary.write_errors:
        return EXIT_UNWRITTEN
    return EXIT_FAIL if summary.failures else EXIT_OK


def replay_target(repro):
    """The vLLM target a reproducer replays or minimizes on (fuzz.cli): one line and exit 2 for
    options this llmfuzz does not know, or without vLLM."""
    from fuzz.targets import TargetUnavailable
    from fuzz.targets.vllm_fuzz import VLLMFuzzTarget
    from fuzz.targets.vllm_target import VLLMOptions

    try:
        VLLMOptions.of(repro.case)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{repro.path}: {e}") from None
    target = VLLMFuzzTarget([])
    try:
        target.checker  # noqa: B018 - looks for vLLM now, before anything runs
    except TargetUnavailable as e:
        raise BadInput(str(e)) from None
    return target


def replay_output(args, repro, v, target) -> None:
    """What `llmfuzz replay` prints for a vLLM reproducer: the versions and the signature too."""
    meta = repro.meta or {}
    rec_sig, version = meta.get("signature"), target.checker.target.vllm_version
    same = v is not None and v.property == repro.property and getattr(v, "signature", None) == rec_sig
    if args.json:
        print(json.dumps({"file": args.file, "reproduces": v is not None, "same_failure": same,
                          "property": getattr(v, "property", None), "message": str(v) if v else None,
                          "signature": getattr(v, "signature", None), "recorded_property": repro.property,
                          "recorded_signature": rec_sig, "vllm_version": version,
                          "recorded_vllm_version": meta.get("vllm_version")}))
        return
    print(f"Failing case: {repro.case.describe()}  [vLLM {version}; recorded with "
          f"{meta.get('vllm_version')}; options {repro.case.target_options}]\n  file: {args.file}")
    if v is None:
        print(f"What was violated: nothing now; the case passes (recorded: {repro.property}: {repro.message})")
    else:
        print(f"What was violated: {v.property}: {v}" + ("" if same else
              f"\n  (recorded: {repro.property}: {repro.message})"))
    print(f"Reproduce with: llmfuzz replay {args.file}")


def _cmd_cells(args) -> int:
    from fuzz.targets.vllm_target import cell_name, llm_kwargs

    configs = campaign_configs(budget_s=args.budget, seed=args.seed, count=args.configs, layouts=args.layouts,
                               modes=args.modes, cells=None, exclude=args.exclude)
    from fuzz.targets.vllm_campaign import format_plan, plan_report

    print(format_plan(plan_report(configs, args.seed, args.layouts, args.modes)))
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
                   help=f"{t}how many configs of the covering plan to visit (default: as many as the budget affords)")
    r.add_argument("--cells", default=None, help=f"{t}comma list of config names to visit instead of drawing "
                   "(e.g. tp1pp2-eager,tp1pp1-compiled-b16-s2; see `llmfuzz vllm cells`)")
    r.add_argument("--exclude", default=None, help=f"{t}comma list of config-name prefixes not to visit (e.g. tp1pp2-eager)")
    r.add_argument("--known", default=None, help=f"{t}known-failures file: one crash signature per line (default: "
                   "the signatures of reproducers/vllm/**.json and fuzz/targets/vllm_known_failures.txt; "
                   "--known /dev/null: none)")
    r.add_argument("--max-requests", type=int, default=8, help=f"{t}requests per workload (default 8)")
    r.add_argument("--shrink-budget", type=float, default=None,
                   help="seconds of shrinking after the budget (default max(60, budget/4)); "
                        "with --target vllm: per failure, within the budget (default min(300, budget/5))")
    r.add_argument("--no-config-shrink", action="store_true",
                   help=f"{t}shrink a failure's workload only, not its config (each config step restarts vLLM)")


def add_vllm_parser(subparsers, replay=None) -> None:
    """`llmfuzz vllm run|replay|cells` (imports nothing heavy until a command runs).
    `replay`: the `llmfuzz replay` command, which replays a vLLM reproducer on vLLM by its
    Case's target (handed in, so this module does not import the CLI)."""
    v = subparsers.add_parser("vllm", help="fuzz a real vLLM (needs vLLM: scripts/setup_vllm_cpu.sh, docs/vllm.md)")
    vs = v.add_subparsers(dest="vllm_cmd", required=True)
    r = vs.add_parser("run", help="time-budgeted campaign against vLLM (= llmfuzz run --target vllm)")
    add_vllm_run_options(r, standalone=True)
    r.set_defaults(fn=_cmd_run)
    rp = vs.add_parser("replay", help="re-run a vLLM reproducer: exit 1 if it still fails (= llmfuzz replay)")
    rp.add_argument("file")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(fn=replay)
    c = vs.add_parser("cells", help="list the vLLM configs a campaign with this budget and seed visits")
    c.add_argument("--budget", type=float, default=600.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--configs", type=int, default=None)
    c.add_argument("--layouts", default="")
    c.add_argument("--modes", default="")
    c.add_argument("--exclude", default=None)
    c.set_defaults(fn=_cmd_cells)
