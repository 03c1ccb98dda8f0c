"""Helpers shared by the fuzz tests."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from fuzz.cases.case import Case
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import LogitsMismatch, Violation


def violation_on_fresh_engines(case: Case, oracles: frozenset[str] = frozenset()) -> Violation:
    """The Violation a new Harness (engines no other Case ran on, checking every Case with
    `oracles` besides those it always runs) finds in `case`; fails the test if it finds none."""
    h = Harness(oracles=oracles)
    try:
        with pytest.raises(Violation) as ei:
            h.check(case)
    finally:
        h.close()
    return ei.value


PASS = SimpleNamespace(logits=SimpleNamespace(ratio=0.1))


class FakeHarness:
    """No engine: every Case passes, or fails (logits) from `fail_from` requests on. With a
    `clock` (FakeClock), each check moves it by `check_s`."""

    def __init__(self, fail_from: int | None = None, clock=None, check_s: float = 0.0) -> None:
        self.fail_from, self.clock, self.check_s = fail_from, clock, check_s

    def check(self, case):
        if self.clock is not None:
            self.clock.sleep(self.check_s)
        if self.fail_from is not None and len(case.workload.requests) >= self.fail_from:
            raise LogitsMismatch("two requests", case, 2.0, oracle="reference")
        return PASS

    def close(self) -> None:
        pass


class FakeClock:
    """A campaign's clock that only the test moves (`Campaign(clock=...)`): `sleep(s)` stands
    for work that takes s seconds, and every reading moves it on by `tick`, so a loop that does
    no work (every Case a skipped duplicate) still reaches its deadline. What a test asserts
    on it does not depend on how loaded the machine is. (The minimizer, which reads
    time.monotonic(), is handed the time left on this clock: Campaign._real.)"""

    def __init__(self, tick: float = 0.001) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def campaigns_on(monkeypatch, clock: FakeClock, check_s: float | None = None) -> None:
    """Every Campaign made from here on runs on `clock`, `llmfuzz run` in-process too (the
    command line imports fuzz.campaign.loop.Campaign when it runs). With `check_s`, each check
    of a harness a campaign makes for itself (the reference engine's) moves it that much."""
    from fuzz.campaign import loop

    class OnTheClock(loop.Campaign):
        def __init__(self, **kw) -> None:
            kw.setdefault("clock", clock)  # the latest `campaigns_on` decides
            super().__init__(**kw)

    monkeypatch.setattr(loop, "Campaign", OnTheClock)
    if check_s is not None:
        make = loop.make_harness

        def timed_harness(*a, **kw):
            h = make(*a, **kw)
            check = h.check

            def timed_check(case):
                clock.sleep(check_s)
                return check(case)

            h.check = timed_check
            return h

        monkeypatch.setattr(loop, "make_harness", timed_harness)


@contextlib.contextmanager
def recording_draws(monkeypatch):
    """Within: every Case each campaign chunk draws, as {(cell data, chunk index): [Case JSON]}."""
    from fuzz.campaign.loop import Campaign

    seen: dict = {}
    orig_test, orig_body = Campaign._hypothesis_test, Campaign._body

    def test(self, cell, i, examples=None):
        inner = orig_test(self, cell, i, examples)

        def run():
            self._tag = (cell.data, i)
            seen[self._tag] = []
            return inner()
        return run

    def body(self, case):
        seen[self._tag].append(case.key())
        return orig_body(self, case)

    with monkeypatch.context() as m:
        m.setattr(Campaign, "_hypothesis_test", test)
        m.setattr(Campaign, "_body", body)
        yield seen
