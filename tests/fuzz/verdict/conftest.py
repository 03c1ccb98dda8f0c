"""Verdict tests: a fresh harness per test (modules that need another one define their own)."""
import pytest

from fuzz.verdict.harness import Harness


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()
