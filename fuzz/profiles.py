"""Hypothesis profiles, selected explicitly (`LLMFUZZ_PROFILE` or `--profile`).

Hypothesis auto-loads its own `ci` profile when the CI variable is set; registering ours
under the same name replaces it, and `load()` always names the profile it wants.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

PROFILES = ("dev", "ci", "nightly", "repro")
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def database_path() -> str:
    return os.environ.get("LLMFUZZ_DB", os.path.join(".hypothesis", "llmfuzz-examples"))


def register() -> None:
    common = dict(deadline=None, suppress_health_check=_SUPPRESS, print_blob=True)
    settings.register_profile("dev", max_examples=25, **common)
    settings.register_profile("ci", max_examples=15, derandomize=True, database=None, **common)
    settings.register_profile("nightly", max_examples=2000, derandomize=False,
                              database=DirectoryBasedExampleDatabase(database_path()), **common)
    # Replay what the database holds, generate nothing new.
    settings.register_profile("repro", max_examples=1, phases=[Phase.explicit, Phase.reuse],
                              database=DirectoryBasedExampleDatabase(database_path()), **common)


def load(name: str | None = None) -> str:
    # Explicit choice first; on a CI machine (CI set) our own "ci" profile, never Hypothesis's.
    name = name or os.environ.get("LLMFUZZ_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    if name not in PROFILES:
        raise ValueError(f"profile: {name!r} is not one of {', '.join(PROFILES)}")
    register()
    settings.load_profile(name)
    return name
