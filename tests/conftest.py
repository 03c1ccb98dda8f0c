"""Test-suite setup: our Hypothesis profile (dev unless LLMFUZZ_PROFILE says otherwise)."""
from fuzz import profiles

profiles.load()
