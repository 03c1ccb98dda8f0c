"""`llmfuzz run --target transformers-cb`: a campaign on transformers' continuous batching
(fuzz.targets.transformers_cb.target.CBTarget) over the planned configs
(fuzz.targets.transformers_cb.plan), on --device (cpu, or cuda for its graph, async and
flash configs). Of the vLLM options only --configs (the first N planned configs) and
--max-requests apply. Nothing here imports torch or transformers at import time."""
from __future__ import annotations

import importlib.util
import json

from fuzz.errors import EXIT_FAIL, EXIT_OK, EXIT_UNWRITTEN, BadInput

NOT_HERE = ("cells", "exclude", "known", "include_known")


def cmd_run(args) -> int:
    from fuzz.campaign.loop import Campaign
    from fuzz.targets.transformers_cb.plan import campaign_configs
    from fuzz.targets.transformers_cb.target import CBTarget

    if importlib.util.find_spec("transformers") is None:
        raise BadInput("--target transformers-cb: package transformers is not installed (pip install transformers)")
    if args.fault:
        raise BadInput("--fault: registry faults exist in the reference engine only, not with --target transformers-cb")
    for opt in NOT_HERE:
        if getattr(args, opt, None) is not None:
            raise BadInput(f"--{opt.replace('_', '-')}: applies to --target vllm only")
    if not 0 < args.budget < float("inf"):
        raise BadInput(f"--budget {args.budget} is not a positive number of seconds")
    device = getattr(args, "device", "cpu") or "cpu"
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: CUDA is not available on this machine")
    configs = campaign_configs(device, args.configs)
    target = CBTarget(configs, max_requests=args.max_requests)
    try:
        summary = Campaign(target=target, budget_s=args.budget, out_dir=args.out or "reproducers/transformers_cb",
                           seed=args.seed, shrink_s=args.shrink_budget, progress=not (args.quiet or args.json)).run()
        version = target.runner.version
    finally:
        target.close()
    doc = summary.to_json()
    if args.json:
        print(json.dumps({**doc, "transformers_version": version}, indent=1))
    else:
        print(f"transformers {version} continuous batching, {summary.seconds:.0f}s")
        print(summary.table())
        for f in summary.failures:
            print(f"\nFAILED {f.property}: {str(f.message)[:300]}\n  Reproduce with: llmfuzz replay {f.path}")
    if summary.write_errors:
        return EXIT_UNWRITTEN
    return EXIT_FAIL if summary.failures else EXIT_OK


def replay_target(repro):
    """The target a transformers-cb reproducer replays on."""
    from fuzz.targets.transformers_cb.configs import CBOptions
    from fuzz.targets.transformers_cb.target import CBTarget

    try:
        CBOptions.of(repro.case)
    except (TypeError, ValueError) as e:
        raise BadInput(f"{repro.path}: {e}") from None
    return CBTarget([])
