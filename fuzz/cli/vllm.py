"""The vLLM commands: `llmfuzz run --target vllm` (alias `llmfuzz vllm run`), `llmfuzz vllm
replay` (what `llmfuzz replay` calls for a vLLM reproducer) and `llmfuzz vllm cells`: their
arguments and what they print.

A vLLM campaign is fuzz.campaign.loop.Campaign on the vLLM target
(fuzz.targets.vllm.target.VLLMTarget, whose policies set its time and shrinking), over the
configs the plan picks (fuzz.targets.vllm.plan). Nothing here imports torch or vLLM at
import time: `llmfuzz --help` builds these parsers.
"""
from __future__ import annotations

import json
import os
import sys
import time

from fuzz.errors import EXIT_FAIL, EXIT_OK, EXIT_UNWRITTEN, BadInput


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def parse_modes(text: str | None) -> tuple[str, ...]:
    """'eager,graph' -> ('eager', 'compiled'): `graph` (the reference engine's word) and
    `compiled` both mean vLLM without enforce_eager (torch.compile on CPU)."""
    out = []
    for m in _split(text):
        m = {"graph": "compiled"}.get(m, m)
        if m not in ("eager", "compiled"):
            raise BadInput(f"--modes: {m!r} is not one of eager, compiled (or graph)")
        if m not in out:
            out.append(m)
    return tuple(out)


def parse_layouts(text: str | None) -> tuple[str, ...]:
    """The reference engine's --layouts parser (fuzz.cli.common), checked against the vLLM model."""
    from fuzz.cli.common import parse_layouts as _parse_layouts
    from fuzz.targets.vllm.configs import VLLM_MODEL

    if not _split(text):
        return ()
    try:
        return tuple(dict.fromkeys(_parse_layouts(text, VLLM_MODEL)))
    except BadInput as e:
        raise BadInput(f"--layouts: {e}") from None


def _plan(args, cells: str | None, machines: int = 1) -> tuple[list, dict]:
    """The configs the arguments ask for (fuzz.targets.vllm.plan) and the report of their plan;
    `machines`: the shards sharing it (their budgets together afford that many times the configs)."""
    from fuzz.targets.vllm.plan import campaign_configs, plan_report

    layouts, modes = parse_layouts(args.layouts), parse_modes(args.modes)
    include = bool(getattr(args, "include_known", False))
    configs = campaign_configs(budget_s=args.budget * machines, seed=args.seed, count=args.configs, layouts=layouts,
                               modes=modes, cells=_split(cells), exclude=_split(args.exclude), include_known=include)
    # Named cells: the user chose what to visit, the known crashes left nothing out.
    return configs, plan_report(configs, layouts, modes, include_known=include or bool(_split(cells)))


def _shard_configs(configs: list, shard):
    """A shard's configs (every N-th of the plan, `run --shard K/N`: fuzz.campaign.shard) and
    its Share: each config at its place in the whole plan, so its chunk seeds are the plan's."""
    from fuzz.campaign.jobs_worker import Share
    from fuzz.campaign.shard import shard_part
    from fuzz.targets.vllm.configs import cell_name

    names = [cell_name(c, o) for c, o in configs]
    shard = shard_part(shard, names, cost=lambda name: 1.0)
    mine = [configs[names.index(n)] for n in shard.part["layouts"]]
    share = Share(len(configs), shard.part["stream"], shard.part["streams"],
                  positions={n: names.index(n) for n in shard.part["layouts"]})
    return mine, shard, share


def _cmd_run(args, shard=None) -> int:
    """`llmfuzz run --target vllm ...` and `llmfuzz vllm run ...`: fuzz.campaign.loop.Campaign on
    the vLLM target (`shard`: `run --shard K/N`'s, fuzz.campaign.shard)."""
    from fuzz.targets.runs import TargetUnavailable
    from fuzz.targets.vllm.known import default_known, load_known
    from fuzz.targets.vllm.launch import vllm_python
    from fuzz.targets.vllm.plan import format_plan

    if not 0 < args.budget < float("inf"):
        raise BadInput(f"--budget {args.budget} is not a positive number of seconds")
    configs, plan = _plan(args, args.cells, shard.count if shard is not None else 1)
    share = None
    if shard is not None:
        configs, shard, share = _shard_configs(configs, shard)
    try:
        known = default_known() if args.known is None else load_known(args.known)
    except OSError as e:
        raise BadInput(f"--known {args.known}: {e.strerror}") from None
    if args.include_known:  # fuzzed like any other failure: reported, shrunk, written
        known = set()
    try:
        vllm_python()  # before anything starts: one line naming the missing package
        if not args.quiet:
            sys.stderr.write(format_plan(plan) + "\n")
        summary = _campaign(args, configs, known, plan, share, replay_known=shard is None or shard.index == 1)
        summary.shard = shard
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


def _campaign(args, configs: list, known: set[str], plan: dict, share=None, replay_known: bool = True):
    """The campaign run to its end; the vLLM engines it started are shut down. Unless
    --include-known, the known crashes whose configs the plan left out replay their
    reproducers beside it, in a process of their own (fuzz.campaign.vllm_replays), within the
    budget, so the summary says whether each still fails (of a sharded campaign, shard 1
    only: `replay_known`)."""
    from fuzz.campaign.loop import Campaign
    from fuzz.campaign.vllm_replays import BackgroundReplays, state_line
    from fuzz.targets.vllm.target import HARD_SLACK, VLLMTarget

    target = VLLMTarget(configs, known=known, max_requests=args.max_requests,
                        shrink_configs=not args.no_config_shrink, plan=plan, include_known=bool(args.include_known))
    hard_end = time.monotonic() + args.budget * (1 + HARD_SLACK)
    replays = BackgroundReplays(plan, known) if not args.include_known and replay_known else None
    try:
        summary = Campaign(target=target, budget_s=args.budget, out_dir=args.out or "reproducers/vllm",
                           seed=args.seed, shrink_s=args.shrink_budget, progress=not args.quiet, share=share).run()
        if replays is not None:
            target.known_crashes = replays.result(hard_end - time.monotonic())
            target.known_crash_replay_s = replays.seconds
            if not args.quiet:
                sys.stderr.write("".join(state_line(k) + "\n" for k in target.known_crashes))
        return summary
    finally:
        if replays is not None:
            replays.stop()
            if not target.known_crashes:  # stopped before they were collected: still listed
                target.known_crashes = [{**r, "state": "not replayed", "detail": "the campaign was stopped"}
                                        for r in replays.rows]
        target.close()


def replay_target(repro):
    """The vLLM target a reproducer replays or minimizes on (fuzz.cli.main): one line and exit 2 for
    options this llmfuzz does not know, or without vLLM."""
    from fuzz.targets.runs import TargetUnavailable
    from fuzz.targets.vllm.configs import VLLMOptions
    from fuzz.targets.vllm.target import VLLMTarget

    try:
        VLLMOptions.of(repro.case)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{repro.path}: {e}") from None
    target = VLLMTarget([])
    try:
        target.checker  # noqa: B018 - looks for vLLM now, before anything runs
    except TargetUnavailable as e:
        raise BadInput(str(e)) from None
    return target


def replay_output(args, repro, v, target) -> None:
    """What `llmfuzz replay` prints for a vLLM reproducer: the versions and the signature too."""
    meta = repro.meta or {}
    from fuzz.targets.vllm.known import KNOWN_CRASHES

    rec_sig, version = meta.get("signature"), target.checker.runner.vllm_version
    same = v is not None and v.property == repro.property and getattr(v, "signature", None) == rec_sig
    known = next((k for k in KNOWN_CRASHES if k.signature == rec_sig), None)
    if args.json:
        print(json.dumps({"file": args.file, "reproduces": v is not None, "same_failure": same,
                          "known_crash_fixed": known is not None and v is None,
                          "property": getattr(v, "property", None), "message": str(v) if v else None,
                          "signature": getattr(v, "signature", None), "recorded_property": repro.property,
                          "recorded_signature": rec_sig, "vllm_version": version,
                          "recorded_vllm_version": meta.get("vllm_version")}))
        return
    if known is not None and v is None:  # one line: what to do about it
        print(f"fixed: known crash {known.short} ({rec_sig}) passes on vLLM {version}; drop it from "
              "KNOWN_CRASHES (fuzz/targets/vllm/known.py) and fuzz/targets/vllm/known_failures.txt")
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
    from fuzz.targets.vllm.configs import cell_name
    from fuzz.targets.vllm.launch import llm_kwargs
    from fuzz.targets.vllm.plan import format_plan

    configs, plan = _plan(args, None)
    print(format_plan(plan))
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
                   "the signatures of reproducers/vllm/**.json and fuzz/targets/vllm/known_failures.txt; "
                   "--known /dev/null: none)")
    r.add_argument("--include-known", action="store_true", default=None,
                   help=f"{t}plan the configs known crashes kill, and report, shrink and write those crashes "
                   "like new ones (default: leave them out, list the pairs left out, and replay each known "
                   "crash's reproducer once to say whether it still fails)")
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
    c.add_argument("--include-known", action="store_true")
    c.set_defaults(fn=_cmd_cells)
