"""pytest plugin (entry point `llmfuzz`): registers our Hypothesis profiles and markers, and the
options of `llmfuzz.check` in a test suite (docs/targets.md):

- `--llmfuzz-profile NAME` (or $LLMFUZZ_PROFILE): load that Hypothesis profile (dev, ci,
  nightly, repro: fuzz/profiles.py); without either, Hypothesis' settings stay the suite's own;
- `--llmfuzz-reproducers DIR` (or $LLMFUZZ_REPRODUCERS; default ./reproducers): where the
  reproducers of failing checks are written. pytest-xdist workers get the same options.

Imports nothing heavy: torch is loaded by the tests that need it, not by pytest start-up.
"""
from __future__ import annotations

import os


def pytest_addoption(parser) -> None:
    g = parser.getgroup("llmfuzz")
    g.addoption("--llmfuzz-profile", default=None, help="Hypothesis profile: dev, ci, nightly, repro")
    g.addoption("--llmfuzz-reproducers", default=None,
                help="where llmfuzz.check writes reproducers (default $LLMFUZZ_REPRODUCERS, else ./reproducers)")


def pytest_configure(config) -> None:
    for line in ("gpu: needs a CUDA device (skips cleanly without one)",
                 "distributed: spawns torch.distributed worker processes (gloo on CPU)",
                 "slow: long-running; still part of the default CPU run"):
        config.addinivalue_line("markers", line)
    from fuzz import profiles

    profiles.register()
    name = config.getoption("llmfuzz_profile", None) or os.environ.get("LLMFUZZ_PROFILE")
    if name:
        profiles.load(name)
    out = config.getoption("llmfuzz_reproducers", None)
    if out:  # the environment: what llmfuzz.check reads, in this process and in xdist's workers
        os.environ["LLMFUZZ_REPRODUCERS"] = os.path.abspath(out)
