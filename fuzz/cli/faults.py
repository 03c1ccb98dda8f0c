"""`llmfuzz faults` lists the engine's registered faults (planted bugs); `llmfuzz selftest`
runs a short campaign with each on and reports whether, and how fast, the harness found it."""
from __future__ import annotations

import json
import sys

from fuzz.cli.common import base_config, load_profile, oracles, poison
from fuzz.errors import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, BadInput


def cmd_faults(args) -> int:
    from engine.faults import FAULTS

    # Where each fault lives in the engine, when the registry says (only then is it shown).
    where = {n: getattr(f, "where", "") for n, f in FAULTS.items()}
    if args.json:
        print(json.dumps({n: {"doc": f.doc, "needs": f.needs, **({"where": where[n]} if where[n] else {})}
                          for n, f in FAULTS.items()}, indent=1))
        return EXIT_OK
    for name, f in FAULTS.items():
        print(f"{name}\n    {f.doc}\n    needs: {f.needs or '-'}")
        if where[name]:
            print(f"    where: {where[name]}")
    return EXIT_OK


def cmd_selftest(args) -> int:
    from engine.faults import FAULTS
    from fuzz.contention.command import checked, held

    names = args.fault or list(FAULTS)
    for f in names:
        if f not in FAULTS:
            raise BadInput(f"--fault: unknown fault {f!r} (see `llmfuzz faults`)")
    if not 0 < args.budget_per_fault < float("inf"):
        raise BadInput(f"--budget-per-fault: {args.budget_per_fault} is not a positive number of seconds")
    load_profile(args.profile)
    base = base_config(args)
    with held(checked(args.contention, device=args.device), device=args.device, seed=args.seed):
        return _selftest(args, names, base)


def _selftest(args, names, base) -> int:
    from fuzz.campaign.selftest import run_selftest, summary_json, table

    results = run_selftest(names, args.budget_per_fault, args.out, args.seed, progress=not args.json, base=base,
                           isolate=args.isolate, everywhere=args.everywhere, oracles=oracles(args),
                           poison=poison(args))
    if args.json:
        print(json.dumps({**summary_json(results), "dtype": base.dtype, "device": base.device,
                          "attention_backend": base.attention_backend, "everywhere": args.everywhere,
                          "poison": args.poison, "contention": args.contention,
                          "budget_per_fault": args.budget_per_fault, "seed": args.seed}, indent=1))
    else:
        print(table(results))
    if any(r.interrupted for r in results):
        print(f"(interrupted: {len(results)} of {len(names)} faults run)", file=sys.stderr)
        return EXIT_INTERRUPTED  # no verdict on the faults not run
    return EXIT_OK if all(r.detected for r in results) else EXIT_FAIL
