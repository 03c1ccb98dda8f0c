"""A config transformers' continuous batching refuses is reported unsupported with the
library's own message (`CBRunner.check_supported` -> fuzz.targets.base.Unsupported), and
the worker that refused it runs the next config without a restart."""
from __future__ import annotations

import importlib.util

import pytest

from fuzz.cases.case import Case, RequestSpec, Workload
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


def test_the_config_is_spelled_as_the_installed_version_spells_it():
    """transformers 5.17's ContinuousBatchingConfig names the page size `block_size` and has no
    `auto_switch_to_flash`; newer ones `page_size`: the adapter passes what each accepts."""
    import inspect

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from fuzz.targets.transformers_cb.configs import cb_config
    from fuzz.targets.transformers_cb.worker import cb_kwargs

    kw = cb_config(CB_MODEL, CBOptions())
    older = {"block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
             "allow_block_sharing", "use_cuda_graph", "use_async_batching", "cpu_offload_space",
             "return_logprobs", "seed"}
    old = cb_kwargs(older, kw)
    assert old["block_size"] == CB_MODEL.block_size and "page_size" not in old
    assert "auto_switch_to_flash" not in old and set(old) <= older
    installed = set(inspect.signature(ContinuousBatchingConfig).parameters)
    ContinuousBatchingConfig(**cb_kwargs(installed, kw))  # the installed version takes what it is given


def test_a_start_that_fails_before_the_library_runs_is_a_harness_error_not_a_finding(monkeypatch):
    """The adapter's own call failing (here a config field no transformers version has) is not
    transformers' crash: the config is reported not run, naming the adapter."""
    from fuzz.targets.transformers_cb import runner as runner_mod

    monkeypatch.setattr(runner_mod, "cb_config", lambda cfg, opts: {"no_such_field": 1})
    r = runner_mod.CBRunner()
    try:
        with pytest.raises(Unsupported, match=r"adapter failed before entering transformers.*TypeError@<outside "
                                              r"transformers>.*no_such_field"):
            r.check_supported(CBOptions().on(Case(CB_MODEL, WL)))
    finally:
        r.close()
