"""A config transformers' continuous batching refuses is reported unsupported with the
library's own message (`CBRunner.check_supported` -> fuzz.targets.base.Unsupported), and
the worker that refused it runs the next config without a restart."""
from __future__ import annotations

import importlib.util

import pytest

from fuzz.case import Case, RequestSpec, Workload
from fuzz.targets.base import Unsupported
from fuzz.targets.runs import TargetFailure
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions
from fuzz.targets.transformers_cb.runner import unsupported

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
              pytest.mark.slow]

WL = Workload((RequestSpec((1, 2, 3), 2),))


def test_refused_configs_are_unsupported_with_the_library_message():
    from fuzz.targets.transformers_cb.runner import CBRunner

    r = CBRunner()
    try:
        with pytest.raises(Unsupported, match=r"RuntimeError@transformers/generation/continuous_batching/"
                                              r"input_outputs.py:__init__.*Async batching requires a device type"):
            r.check_supported(CBOptions(async_batching=True).on(Case(CB_MODEL, WL)))
        tiny_pages = CB_MODEL.replace(block_size=2, num_gpu_blocks=65)
        with pytest.raises(Unsupported, match=r"ValueError@transformers/.*page_size must be at least 4"):
            r.check_supported(CBOptions().on(Case(tiny_pages, WL)))
        run = r.run(CBOptions().on(Case(CB_MODEL, WL)))  # the same worker, a config it takes
        assert len(run.results["r0"].token_ids) == 2 and len(r.starts) == 1
    finally:
        r.close()


def test_a_crash_at_start_is_no_refusal():
    """Only the library's config checks are refusals: an AssertionError, or a RuntimeError
    outside a continuous-batching constructor, is a crash at start-up."""
    sig = "ValueError@transformers/generation/continuous_batching/initialization.py:check_cb_values_bounds"
    assert unsupported(TargetFailure("startup", sig))
    assert not unsupported(TargetFailure("crash", sig))
    assert not unsupported(TargetFailure("startup", "AssertionError@transformers/generation/x.py:f"))
    assert not unsupported(TargetFailure("startup", "RuntimeError@transformers/generation/continuous_batching/"
                                                    "continuous_api.py:prepare_next_batch"))
    assert not unsupported(TargetFailure("startup", "ValueError@<outside transformers>"))
