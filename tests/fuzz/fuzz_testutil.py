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
    """No engine: every Case passes, or fails (logits) from `fail_from` requests on."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.fail_from = fail_from

    def check(self, case):
        if self.fail_from is not None and len(case.workload.requests) >= self.fail_from:
            raise LogitsMismatch("two requests", case, 2.0, oracle="reference")
        return PASS

    def close(self) -> None:
        pass


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
