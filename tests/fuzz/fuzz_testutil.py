"""Helpers shared by the fuzz tests."""
from __future__ import annotations

import pytest

from fuzz.case import Case
from fuzz.harness import Harness
from fuzz.properties import Violation


def violation_on_fresh_engines(case: Case) -> Violation:
    """The Violation a new Harness (engines no other Case ran on) finds in `case`; fails the
    test if it finds none."""
    h = Harness()
    try:
        with pytest.raises(Violation) as ei:
            h.check(case)
    finally:
        h.close()
    return ei.value
