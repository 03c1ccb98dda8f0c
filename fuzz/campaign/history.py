"""The Cases an engine served before a failure (its history), and what a reproducer says of them.

A target that keeps state across Cases (`Target.keeps_state`: vLLM, transformers continuous
batching, adapters) may fail on a Case only because of an earlier one. The campaign keeps, per
cell, the last HISTORY_LEN Cases the cell's engine served since it last (re)started (`Histories`,
fed by `recording_check`); a Violation carries the history it was raised after (`history`
attribute). `fuzz.campaign.settle` decides from a fresh replay what is written:

- the Case alone fails on a fresh engine: the reproducer is the Case, as always;
- only after its history: the reproducer carries the history (shrunk: Cases dropped from the
  front, halves then singles, then each one made simpler with the target's candidates, each
  step checked by a fresh replay), and a replay runs it first;
- not even then: written with `reproducible: false`, `minimal: false` and `fresh_replay:
  "passes"`, never dropped.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from fuzz.cases.case import Case, CaseFormatError
from fuzz.verdict.properties import Violation

HISTORY_LEN = 32  # the last Cases kept per cell: a bug that needs an older one is not caught here
HISTORY_FORMAT = 1  # the `history` field's own version (`history_format` in the reproducer)
FAILS, FAILS_WITH_HISTORY, PASSES, NOT_RUN = "fails", "fails with history", "passes", "not run"


class Histories:
    """Per cell, the last HISTORY_LEN Cases its engine served since it (re)started."""

    def __init__(self, maxlen: int = HISTORY_LEN) -> None:
        self.maxlen = maxlen
        self._cells: dict[str, deque] = {}

    def of(self, cell: str) -> tuple[Case, ...]:
        return tuple(self._cells.get(cell, ()))

    def served(self, cell: str, case: Case) -> None:
        self._cells.setdefault(cell, deque(maxlen=self.maxlen)).append(case)

    def reset(self, cell: str, served: Iterable[Case] = ()) -> None:
        """The cell's engine (re)started; `served`: what the new one has run since."""
        self._cells[cell] = deque(served, maxlen=self.maxlen)

    def after(self, cell: str, v, crashed: bool) -> None:
        """Failure `v` of `cell` is finished. A crash ends the engine (the next Case starts
        another); a fresh replay that restarted the cell's own engine (vLLM, transformers
        continuous batching) leaves it having served that replay's Cases only."""
        from fuzz.targets.fresh import RESTARTED

        res = getattr(v, "fresh_replay", None)
        if crashed:
            self.reset(cell)
        elif res is not None and res.how == RESTARTED and res.ran:
            self.reset(cell, res.last_run)


def recording_check(target, histories: Histories, cell: Callable[[], str]) -> Callable:
    """`target.check`, each Case recorded as served by the current cell's engine (`cell()`), a
    Violation given the history before its Case (`history`). Targets that keep no state: as is."""
    if not getattr(target, "keeps_state", False):
        return target.check

    def check(case: Case):
        name = cell()
        # Only the Cases since the last one of another summary row (vLLM, transformers: another
        # config, so another engine, started in place of this one: a shrink candidate's).
        row, before = target.stats_key(case)[0], histories.of(name)
        for i in range(len(before) - 1, -1, -1):
            if target.stats_key(before[i])[0] != row:
                before = before[i + 1:]
                break
        try:
            return target.check(case)
        except Violation as v:
            if getattr(v, "history", None) is None:
                v.history = before
            raise
        finally:
            histories.served(name, case)
    return check


def parse_history(doc: dict) -> tuple[Case, ...]:
    """A reproducer's `history` (Case dicts, oldest first; absent in older reproducers: none)."""
    raw = doc.get("history") or []
    if not isinstance(raw, list):
        raise CaseFormatError("'history': expected a list of Cases")
    fmt = doc.get("history_format", HISTORY_FORMAT)
    if isinstance(fmt, int) and fmt > HISTORY_FORMAT:
        raise CaseFormatError(f"'history_format' {fmt} is newer than this llmfuzz understands; upgrade llmfuzz")
    out = []
    for i, d in enumerate(raw):
        try:
            out.append(Case.from_dict(d))
        except CaseFormatError as e:
            raise CaseFormatError(f"history[{i}]: {e}") from None
    return tuple(out)


@dataclass
class FreshResult:
    """What a fresh replay showed of a failure: `state` (FAILS, FAILS_WITH_HISTORY, PASSES,
    NOT_RUN), the history it needs, how the fresh engine was had (`how`: fuzz.targets.fresh),
    the fresh checks spent, whether the history shrink reached a fixpoint, and why it could
    not run (`why`)."""

    state: str
    history: tuple = ()
    how: str | None = None
    checks: int = 0
    history_minimal: bool = True
    why: str = ""
    seen_history: int = 0  # Cases the warm engine had served before the failing one (up to HISTORY_LEN)
    last_run: tuple = ()  # the Cases of the last fresh replay: what a restarted engine has served since

    @property
    def fails(self) -> bool:
        return self.state in (FAILS, FAILS_WITH_HISTORY)

    @property
    def ran(self) -> bool:
        return self.state != NOT_RUN

    def text(self) -> str:
        """The summary's words: 'fails', 'fails with history of N', 'passes', 'not run'."""
        return f"{FAILS_WITH_HISTORY} of {len(self.history)}" if self.state == FAILS_WITH_HISTORY else self.state

    def fields(self) -> dict:
        """The reproducer's fields (beside `minimal`, which the writer sets from `fails`)."""
        doc: dict = {"fresh_replay": self.text(), "fresh": self.how, "history_seen": self.seen_history,
                     # Not run: nothing is known either way.
                     "reproducible": None if self.state == NOT_RUN else self.fails}
        if self.state == PASSES:
            doc["fresh_replay_note"] = ("did not fail when replayed in a fresh engine, not even after the "
                                        f"{self.seen_history} Case(s) the engine served before it: it depends "
                                        "on state older than that, or on timing")
        if self.state == NOT_RUN:
            doc["fresh_replay_note"] = f"no fresh replay could run: {self.why}"
        if self.history:
            doc.update(history_fields(self.history), history_minimal=self.history_minimal)
        return doc


def history_fields(history: Iterable[Case]) -> dict:
    """A reproducer's `history` (oldest first) and its version."""
    return {"history": [h.to_dict() for h in history], "history_format": HISTORY_FORMAT}


def shrink_history(history: tuple, fails: Callable[[tuple], bool], simpler: Callable,
                   deadline: float | None, max_checks: int) -> tuple[tuple, int, bool]:
    """The smallest history that still `fails` (a fresh replay of it, then the Case): Cases
    dropped from the front, halves then singles, then each one left made simpler (`simpler`:
    the target's candidates). (history, checks, minimal): minimal when no step was cut short."""
    checks = 0

    def room() -> bool:
        return checks < max_checks and (deadline is None or time.monotonic() < deadline)

    def tried(h: tuple) -> bool:
        nonlocal checks
        checks += 1
        return fails(h)

    # Runs of Cases dropped, from the front: halves, then quarters, ... then singles (the
    # oldest Cases matter least often; a run that can go costs one check, not one per Case).
    size = len(history) // 2
    while size >= 1:
        i = 0
        while i < len(history) and len(history) > 1:
            if not room():
                return history, checks, False
            cand = history[:i] + history[i + size:]
            if tried(cand):
                history = cand
            else:
                i += size
        size //= 2
    for i in range(len(history)):
        case, start = history[i], 0
        while True:
            cands, taken = [c for c in simpler(case) if c is not None and c != case], None
            for c in cands[start:]:
                try:
                    c.validate()
                except CaseFormatError:
                    continue
                if not room():
                    return history, checks, False
                if tried(history[:i] + (c,) + history[i + 1:]):
                    taken = c
                    break
            if taken is None:
                break
            case, start = taken, 0
            history = history[:i] + (case,) + history[i + 1:]
    return history, checks, True
