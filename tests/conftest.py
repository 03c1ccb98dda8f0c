"""Test-suite setup: our Hypothesis profile (dev unless LLMFUZZ_PROFILE says otherwise)."""
from fuzz import profiles

profiles.load()


def pytest_configure(config):
    # `pytest -n auto` hands tests to the workers in batches ("load"): on 2 cores one worker sat
    # idle while the other ran the last of the 20-35 s campaign tests. Work stealing keeps both
    # busy to the end (605 s -> 546 s for the whole suite). xdist sets "load" for -n itself, so
    # an explicit `--dist load` is taken as stealing too.
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "worksteal"
