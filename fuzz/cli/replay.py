"""`llmfuzz replay` and `llmfuzz minimize`: a reproducer's Case run again on its target.

Replay exit codes (fuzz.cli.common): 0 the Case passes now, 1 it fails as recorded (the
recorded property and the same kind of message, fuzz.campaign.reproduce.message_kind; for a crash,
the same signature), 4 it fails, but with another violation (reported as such: another bug,
or the recorded one changed), 2 bad input.
"""
from __future__ import annotations

import json

from fuzz.errors import EXIT_FAIL, EXIT_OK, EXIT_OTHER_FAILURE
from fuzz.cli.common import load as _load
from fuzz.cli.common import oracles as _oracles
from fuzz.cli.common import replay_oracles as _replay_oracles

VERDICT_EXIT = {"passes": EXIT_OK, "reproduces": EXIT_FAIL, "differs": EXIT_OTHER_FAILURE}


def replay_target(repro, args):
    """The engine a reproducer's Case runs on (fuzz.targets.base): ours, checked by every oracle (the
    one that found the failure may have been sampled), or vLLM (fuzz/cli/vllm.py)."""
    adapter = (repro.meta or {}).get("blackbox_target")
    if adapter:  # an engine adapter's (docs/targets.md): only its own code can run it again
        from fuzz.errors import BadInput

        raise BadInput(f"{repro.path}: recorded on the adapter {adapter!r}; replay it in Python: "
                       f"llmfuzz.replay(path, target=<your {adapter} target>)")
    if repro.case.target == "vllm":
        from fuzz.cli.vllm import replay_target as vllm_replay_target

        return vllm_replay_target(repro)
    if repro.case.target == "transformers-cb":
        from fuzz.cli.transformers_cb import replay_target as cb_replay_target

        return cb_replay_target(repro)
    from fuzz.verdict.isolated import make_harness
    from fuzz.targets.reference import HarnessTarget

    return HarnessTarget(make_harness(repro.case.config.device, getattr(args, "isolate", "auto"),
                                      oracles=_oracles(args) or _replay_oracles()))


def cmd_replay(args) -> int:
    from fuzz.campaign.reproduce import message_kind, replay_on, replay_report

    repro = _load(args.file)
    target = replay_target(repro, args)
    try:
        verdict, violation = replay_on(target, repro)
    finally:
        target.close()
    if repro.case.target == "vllm":
        from fuzz.cli.vllm import replay_output

        replay_output(args, repro, violation, target)
    elif args.json:
        print(json.dumps({"file": args.file, "reproduces": verdict == "reproduces", "verdict": verdict,
                          "property": getattr(violation, "property", None),
                          "oracle": getattr(violation, "oracle", None),
                          "message": str(violation) if violation else None,
                          "kind": message_kind(violation.property, str(violation)) if violation else None,
                          "recorded_property": repro.property,
                          "recorded_kind": message_kind(repro.property, repro.message)}))
    else:
        print(replay_report(repro, violation))
    return VERDICT_EXIT[verdict]


def cmd_minimize(args) -> int:
    """Shrink a reproducer while it fails as recorded (fuzz.campaign.reproduce.replay_verdict); the
    result is written with `minimal` (the minimizer reached a fixpoint)."""
    from fuzz.campaign.reproduce import replay_on, replay_verdict, write_reproducer
    from fuzz.campaign.shrink import Shrinker, minimize_to_fixpoint

    repro = _load(args.file)
    target = replay_target(repro, args)
    try:
        verdict, first = replay_on(target, repro)
        if verdict != "reproduces":
            now = "passes" if first is None else f"fails with another violation: {first.property}: {first}"
            print(f"{args.file}: does not fail as recorded ({repro.property}: {repro.message}); it {now}; "
                  "nothing to minimize")
            return VERDICT_EXIT[verdict]
        # Kept when it fails as recorded (the oracle may differ: sampled ones).
        sh = Shrinker(first, target.check, same=lambda v, _: replay_verdict(repro, v) == "reproduces")
        small, checks, minimal = minimize_to_fixpoint(repro.case, sh.still_fails, simpler=target.simpler)
        v = sh.best
        meta = {**target.reproducer_meta(small, v), "minimal": minimal}
    finally:
        target.close()
    path = write_reproducer(args.out, small, v.property, v.message, v.error_ratio, v.oracle, v.second_opinion, meta)
    print(f"minimized in {checks} checks ({'minimal' if minimal else 'not minimal: the check budget ran out'}): "
          f"{small.describe()}\n  {v.property}: {v.message}\n  -> {path}")
    return EXIT_FAIL
