"""A reproducer replayed N times: how often it fails as recorded, and under what load.

A failure that depends on timing (a race widened by contention on a shared GPU) may not
show on every replay. It is reported as a rate ("reproduces 5/8 under gpu:3"), never dropped
as flaky, and a replay that fails at least once fails (exit 1): one red run is a bug.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fuzz.campaign.reproduce import Reproducer, replay_on
from fuzz.contention.coprocs import active

# Replays of a reproducer recorded under contention when `--replays` is not given: enough
# that a 1-in-3 race shows with probability > 0.95 (1 - (2/3)^8 = 0.96).
TIMED_REPLAYS = 8


@dataclass
class Rate:
    verdicts: list[str] = field(default_factory=list)
    violations: list = field(default_factory=list)  # each replay's Violation (None: it passed)
    contention: str | None = None  # the profile in force during the replays

    @property
    def runs(self) -> int:
        return len(self.verdicts)

    @property
    def reproduced(self) -> int:
        return self.verdicts.count("reproduces")

    @property
    def verdict(self) -> str:
        """'reproduces' if any replay did, else 'differs' if any failed otherwise, else 'passes'."""
        for v in ("reproduces", "differs"):
            if v in self.verdicts:
                return v
        return "passes"

    @property
    def violation(self):
        """The first violation of the aggregate verdict (None when every replay passed)."""
        for verdict, v in zip(self.verdicts, self.violations):
            if verdict == self.verdict:
                return v
        return None

    def line(self) -> str:
        under = f"under {self.contention}" if self.contention else "without contention"
        other = self.verdicts.count("differs")
        rest = f", {other} failed otherwise" if other else ""
        return f"reproduces {self.reproduced}/{self.runs} {under}{rest}"

    def to_json(self) -> dict:
        return {"reproduced": self.reproduced, "runs": self.runs, "differs": self.verdicts.count("differs"),
                "contention": self.contention}


def replays_for(repro: Reproducer, asked: int | None, contention: object) -> int:
    """How many replays: as asked, else TIMED_REPLAYS for a failure found or replayed under
    contention (or one whose file records a rate), else 1 (a CPU Case is deterministic)."""
    if asked is not None:
        return asked
    meta = repro.meta or {}
    return TIMED_REPLAYS if contention is not None or meta.get("contention") or meta.get("replay_rate") else 1


def replay_times(target, repro: Reproducer, n: int, stop=None) -> Rate:
    """Run `repro` on `target` (a target, or its check function) `n` times (fewer if `stop()`
    says so after a replay)."""
    rate = Rate(contention=active())
    if callable(target) and not hasattr(target, "check"):
        target = _Checking(target)
    for _ in range(n):
        verdict, violation = replay_on(target, repro)
        rate.verdicts.append(verdict)
        rate.violations.append(violation)
        if stop is not None and stop():
            break
    return rate


class _Checking:
    """A check function where replay_on wants a target."""

    def __init__(self, check) -> None:
        self.check = check
