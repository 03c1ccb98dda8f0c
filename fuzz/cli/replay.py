"""`llmfuzz replay` and `llmfuzz minimize`: a reproducer's Case run again on its target.

Replay exit codes (fuzz.cli.common): 0 the Case passes now, 1 it fails as recorded (the
recorded property and the same kind of message, fuzz.campaign.reproduce.message_kind; for a crash,
the same signature), 4 it fails, but with another violation (reported as such: another bug,
or the recorded one changed), 2 bad input. A reproducer with a `history` (earlier Cases the
engine's state needs: fuzz.campaign.history) has them run first, on the same new engine.
"""
from __future__ import annotations

import json
import sys

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


def _replays(args) -> int | None:
    from fuzz.errors import BadInput

    n = getattr(args, "replays", None)
    if n is not None and n < 1:
        raise BadInput(f"--replays: {n}; it takes 1 or more")
    return n


def cmd_replay(args) -> int:
    from fuzz.campaign.replay_rate import replay_times, replays_for
    from fuzz.campaign.reproduce import message_kind, replay_report
    from fuzz.contention.command import for_replay, held
    from fuzz.stop import stop_requested

    repro = _load(args.file)
    asked = _replays(args)
    profile = for_replay(getattr(args, "contention", None), (repro.meta or {}).get("contention"))
    n = replays_for(repro, asked, profile)
    target = replay_target(repro, args)
    try:
        with held(profile, device=repro.case.config.device):
            rate = replay_times(target, repro, n, stop=stop_requested)
    finally:
        target.close()
    verdict, violation = rate.verdict, rate.violation
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
                          "recorded_kind": message_kind(repro.property, repro.message),
                          "history": len(repro.history),  # earlier Cases run first (fuzz.campaign.history)
                          "rate": rate.to_json()}))
    else:
        print(replay_report(repro, violation))
    if rate.runs > 1 or rate.contention:
        print(f"Replayed {rate.runs} time(s): {rate.line()}", file=sys.stderr if args.json else sys.stdout)
    return VERDICT_EXIT[verdict]


def cmd_minimize(args) -> int:
    """Shrink a reproducer while it fails as recorded (fuzz.campaign.reproduce.replay_verdict), under the
    load it recorded (or `--contention`); the result is written with `minimal` (the minimizer
    reached a fixpoint) and, for a timing-dependent failure, its own replay rate."""
    from fuzz.campaign.replay_rate import replays_for
    from fuzz.contention.command import for_replay, held

    repro = _load(args.file)
    asked = _replays(args)
    profile = for_replay(getattr(args, "contention", None), (repro.meta or {}).get("contention"))
    target = replay_target(repro, args)
    try:
        with held(profile, device=repro.case.config.device):
            return _minimize_under(args, repro, target, replays_for(repro, asked, profile))
    finally:
        target.close()


def _minimize_under(args, repro, target, n: int) -> int:
    """Shrink on `target` under the load in force. A timing-dependent failure (n > 1 replays)
    keeps a candidate when any of up to n tries fails as recorded, and the result's rate is
    measured over n replays and written beside it."""
    from fuzz.campaign.replay_rate import replay_times
    from fuzz.campaign.reproduce import Reproducer, replay_verdict, write_reproducer
    from fuzz.campaign.shrink import Shrinker, minimize_to_fixpoint

    rate = replay_times(target, repro, n)
    if rate.verdict != "reproduces":
        first = rate.violation
        now = "passes" if first is None else f"fails with another violation: {first.property}: {first}"
        print(f"{args.file}: does not fail as recorded ({repro.property}: {repro.message}); it {now}; "
              f"nothing to minimize ({rate.line()})")
        return VERDICT_EXIT[rate.verdict]
    # Kept when it fails as recorded (the oracle may differ: sampled ones).
    check = target.check if n == 1 else _retrying(target.check, n, repro)
    sh = Shrinker(rate.violation, check, same=lambda v, _: replay_verdict(repro, v) == "reproduces")
    small, checks, minimal = minimize_to_fixpoint(repro.case, sh.still_fails, simpler=target.simpler)
    v = sh.best
    meta = {**target.reproducer_meta(small, v), "minimal": minimal}
    if repro.history:  # the earlier Cases it needs stay with it (fuzz.campaign.history)
        from fuzz.campaign.history import history_fields

        # Its candidates ran one after another on the engine the history warmed, not each on a
        # fresh one: nothing shows the result minimal.
        meta.update(history_fields(repro.history), minimal=False)
    said = ""
    if n > 1:  # the shrunk Case's own rate, under the same load
        shrunk = replay_times(target, Reproducer(small, repro.property, repro.message, meta=repro.meta), n)
        meta["replay_rate"], said = shrunk.to_json(), f"; {shrunk.line()}"
    path = write_reproducer(args.out, small, v.property, v.message, v.error_ratio, v.oracle, v.second_opinion, meta)
    print(f"minimized in {checks} checks ({'minimal' if minimal else 'not minimal: the check budget ran out'}): "
          f"{small.describe()}\n  {v.property}: {v.message}{said}\n  -> {path}")
    return EXIT_FAIL


def _retrying(check, n: int, repro):
    """`check` tried up to `n` times while it passes or fails otherwise: a race that shows one
    time in three is still a failure of the candidate."""
    from fuzz.campaign.reproduce import replay_verdict
    from fuzz.verdict.properties import Violation

    def tried(case):
        last = None
        for _ in range(n):
            try:
                last = check(case)
            except Violation as v:
                if replay_verdict(repro, v) == "reproduces":
                    raise
        return last
    return tried
