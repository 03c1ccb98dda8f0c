"""pytest plugin (entry point `llmfuzz`): registers our Hypothesis profiles and markers.

Imports nothing heavy: torch is loaded by the tests that need it, not by pytest start-up.
"""
from __future__ import annotations


def pytest_configure(config) -> None:
    for line in ("gpu: needs a CUDA device (skips cleanly without one)",
                 "distributed: spawns torch.distributed worker processes (gloo on CPU)",
                 "slow: long-running; still part of the default CPU run"):
        config.addinivalue_line("markers", line)
    from fuzz import profiles

    profiles.register()
