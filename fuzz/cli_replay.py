"""`llmfuzz replay` and `llmfuzz minimize`: a reproducer's Case run again on its target.

Replay exit codes (fuzz.cli_common): 0 the Case passes now, 1 it fails as recorded (the
recorded property and the same kind of message, fuzz.reproduce.message_kind; for a crash,
the same signature), 4 it fails, but with another violation (reported as such: another bug,
or the recorded one changed), 2 bad input.
"""
from __future__ import annotations

import json

from fuzz.cli_common import EXIT_FAIL, EXIT_OK, EXIT_OTHER_FAILURE
from fuzz.cli_common import load as _load
from fuzz.cli_common import oracles as _oracles
from fuzz.cli_common import replay_oracles as _replay_oracles

VERDICT_EXIT = {"passes": EXIT_OK, "reproduces": EXIT_FAIL, "differs": EXIT_OTHER_FAILURE}


def replay_target(repro, args):
    """The engine a reproducer's Case runs on (fuzz.target): ours, checked by every oracle (the
    one that found the failure may have been sampled), or vLLM (fuzz/targets/vllm_cli.py)."""
    if repro.case.target == "vllm":
        from fuzz.targets.vllm_cli import replay_target as vllm_replay_target

        return vllm_replay_target(repro)
    from fuzz.isolated import make_harness
    from fuzz.target import HarnessTarget

    return HarnessTarget(make_harness(repro.case.config.device, getattr(args, "isolate", "auto"),
                                      oracles=_oracles(args) or _replay_oracles()))


def cmd_replay(args) -> int:
    from fuzz.properties import Violation
    from fuzz.reproduce import message_kind, replay_report, replay_verdict

    repro = _load(args.file)
    target = replay_target(repro, args)
    violation = None
    try:
        target.check(repro.case)
    except Violation as v:
        violation = v
    finally:
        target.close()
    verdict = replay_verdict(repro, violation)
    if repro.case.target == "vllm":
        from fuzz.targets.vllm_cli import replay_output

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
    """Shrink a reproducer while it fails as recorded (fuzz.reproduce.replay_verdict); the
    result is written with `minimal` (the minimizer reached a fixpoint)."""
    from fuzz.properties import Violation
    from fuzz.reproduce import replay_verdict, write_reproducer
    from fuzz.shrink import Shrinker, minimize_to_fixpoint

    repro = _load(args.file)
    target = replay_target(repro, args)
    try:
        first = None
        try:
            target.check(repro.case)
        except Violation as v:
            first = v
        verdict = replay_verdict(repro, first)
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
