"""The transformers-cb campaign's plan and command line, without starting the library: every
planned config is valid, named apart, and turns a knob away from its default; the CPU plan
asks for one config the library refuses (counted unsupported, not left out); options that
belong to the vLLM target, and a bad --configs, are one-line bad input."""
from __future__ import annotations

import pytest

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cli.main import main
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions, cb_config, cell_name
from fuzz.targets.transformers_cb.plan import cpu_plan, cuda_plan


@pytest.mark.parametrize("plan", [cpu_plan(), cuda_plan(CB_MODEL, flash=True), cuda_plan(CB_MODEL, flash=False)],
                         ids=["cpu", "cuda-flash", "cuda"])
def test_plan_configs_are_valid_and_named_apart(plan):
    names = [cell_name(c, o) for c, o in plan]
    assert len(set(names)) == len(names)
    for cfg, opts in plan:
        Case(cfg, Workload((RequestSpec((1,), 1),))).validate()
        assert cfg.max_model_len <= (cfg.num_gpu_blocks - 1) * cfg.block_size
    default = CBOptions()
    for field in ("attn", "kv_blocks", "scheduler", "cuda_graph", "async_batching", "block_sharing", "cpu_offload"):
        assert any(getattr(o, field) != getattr(default, field) for _, o in plan), field


def test_the_cpu_plan_plans_a_refused_config():
    assert any(o.async_batching for _, o in cpu_plan())


def test_every_plan_checks_bf16_and_the_cpu_plan_fp32_too():
    assert {c.dtype for c, _ in cpu_plan()} == {"float32", "bfloat16"}
    assert {c.dtype for c, _ in cuda_plan(CB_MODEL, flash=False)} == {"bfloat16"}


def test_options_round_trip_through_a_case_and_its_json():
    opts = CBOptions(attn="paged|eager", kv_blocks=9, scheduler="prefill_first", block_sharing=False)
    case = opts.on(Case(CB_MODEL, Workload((RequestSpec((1, 2), 3),))))
    back = Case.from_json(case.to_json())
    assert back.target == "transformers-cb" and CBOptions.of(back) == opts
    assert CBOptions().to_dict() == {}  # a default config has one form
    assert cb_config(CB_MODEL, opts)["num_blocks"] == 9 and cb_config(CB_MODEL, CBOptions())["num_blocks"] == CB_MODEL.num_gpu_blocks
    with pytest.raises(ValueError, match="unknown field 'x'"):
        CBOptions.from_dict({"x": 1})


@pytest.mark.parametrize("argv, message", [
    (["--cells", "sdpa-p4-b128-s8"], "--cells: applies to --target vllm only"),
    (["--configs", "0"], "--configs: 0 is not a positive number of configs"),
    (["--fault", "x"], "--fault: registry faults exist in the reference engine only"),
])
def test_bad_options_are_one_line_bad_input(capsys, argv, message):
    assert main(["run", "--target", "transformers-cb", "--budget", "5", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.slow
def test_a_short_campaign_runs_and_counts_a_refused_config_unsupported(capsys, tmp_path, monkeypatch):
    """End to end: `llmfuzz run --target transformers-cb` over the first two planned configs
    (the default one, then async batching, which the library refuses on the CPU). The
    campaign runs on a clock each check moves by 4 s: its 25 s budget is a few examples of the
    first config, then the second, however long the worker's start and the examples take
    (a loaded machine spent the whole budget on the first)."""
    import importlib.util
    import json

    from fuzz_testutil import FakeClock, campaigns_on

    from fuzz.targets.transformers_cb.target import CBTarget

    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    clock, check = FakeClock(), CBTarget.check

    def timed_check(self, case):
        clock.sleep(4.0)
        return check(self, case)

    campaigns_on(monkeypatch, clock)
    monkeypatch.setattr(CBTarget, "check", timed_check)
    code = main(["run", "--target", "transformers-cb", "--budget", "25", "--configs", "2", "--json",
                 "--out", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["failures"] == 0 and doc["examples"] > 0
    default, refused = doc["per_config"].values()
    assert default["examples"] > 0 and default["max_error_over_tolerance"] < 1
    assert refused["examples"] == 0 and "Async batching requires a device type" in refused["unsupported"]
