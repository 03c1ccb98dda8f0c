"""A failure of a target that keeps state, settled by a fresh replay before it is written
(fuzz.campaign.history says what is kept and why): `settle` replays it on brand-new engines
(`Target.fresh_check`, fuzz.targets.fresh), alone then after its history, and shrinks the
history it needs; `FreshRecorder` writes what that showed into the reproducer, and
`note_fresh` into the summary's record of the failure.
"""
from __future__ import annotations

from fuzz.campaign.history import FAILS, FAILS_WITH_HISTORY, NOT_RUN, PASSES, FreshResult, shrink_history
from fuzz.campaign.recorder import Recorder
from fuzz.campaign.reproduce import Reproducer, replay_verdict
from fuzz.contention.coprocs import active
from fuzz.targets.base import FreshUnavailable

FRESH_TRIES = 3


def settle(v, target, deadline: float | None, max_checks: int) -> FreshResult:
    """Replay failure `v` (its Case, after `v.history`) on fresh engines (`target.fresh_check`),
    shrinking the history where it is needed; the FreshResult is put on `v` (`fresh_replay`)
    for the reproducer's writer. The first two replays (alone, then after the whole history)
    always run: they decide what the file may claim."""
    rec = Reproducer(v.case, v.property, v.message, meta={"signature": getattr(v, "signature", None)})
    seen = tuple(getattr(v, "history", None) or ())
    last: list = [()]

    # Under contention a failure may be a race that shows one time in a few: a fresh replay
    # then gets FRESH_TRIES before it is said to pass (a quiet machine's replays are one each).
    tries = FRESH_TRIES if active() else 1

    def fails(history: tuple) -> bool:
        last[0] = (*history, v.case)
        return any(replay_verdict(rec, target.fresh_check(v.case, history)) == "reproduces" for _ in range(tries))

    try:
        if fails(()):
            res = FreshResult(FAILS, (), target.fresh, 1)
        elif not seen or not fails(seen):
            res = FreshResult(PASSES, (), target.fresh, 1 + bool(seen))
        else:
            small, n, minimal = shrink_history(seen, fails, target.simpler, deadline, max_checks)
            res = FreshResult(FAILS_WITH_HISTORY, small, target.fresh, 2 + n, minimal)
    except FreshUnavailable as e:
        res = FreshResult(NOT_RUN, why=str(e))
    res.seen_history, res.last_run = len(seen), last[0]
    v.fresh_replay = res
    return res


class FreshRecorder(Recorder):
    """The campaign's reproducer writer (fuzz.campaign.recorder), adding what a fresh replay
    showed (`v.fresh_replay`): the history, the replay's state, and `minimal: false` unless the
    fresh replay failed. The summary's record of the failure says the same (`Failure.fresh_replay`)."""

    def write(self, v, extra: dict) -> str | None:
        res = getattr(v, "fresh_replay", None)
        if res is not None:
            extra = {**extra, **res.fields()}
            if not res.fails:
                extra["minimal"] = False
        return super().write(v, extra)

    def rewrite(self, p, r, seconds: float) -> None:
        super().rewrite(p, r, seconds)
        note_fresh(p.failure, p.violation)


def not_replayed(v, why: str) -> None:
    """`v` is written without a fresh replay (a stop, or no time): unless one ran, say so."""
    if getattr(v, "fresh_replay", None) is None:
        v.fresh_replay = FreshResult(NOT_RUN, why=why, seen_history=len(getattr(v, "history", None) or ()))


def note_fresh(failure, v) -> None:
    """The summary record (fuzz.campaign.summary.Failure) of failure `v`: its fresh replay."""
    res = getattr(v, "fresh_replay", None)
    if res is not None and getattr(failure, "path", None) is not None:
        failure.fresh_replay, failure.history = res.text(), len(res.history)
        if not res.fails:
            failure.minimal = False
