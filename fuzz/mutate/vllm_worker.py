"""One vLLM mutant's process: `python -m fuzz.mutate.vllm_worker SPEC RESULT`.

Started by fuzz.mutate.run with the scratch copy of vLLM first on PYTHONPATH (the baseline:
an unmutated copy). This process never imports vLLM: it drives vLLM through
fuzz.targets.vllm.runner.VLLMRunner, whose engine process inherits that PYTHONPATH (after the
target's site directory: fuzz.targets.vllm.launch.worker_env). Each engine reports the
`vllm/__init__.py` it imported; one outside the scratch copy is `wrong_tree` (the harness is
wrong, not the mutant: it is never scored). Stages, each saved in RESULT as in
fuzz.mutate.worker:
1. import: vllm is found (not imported) under the scratch copy;
2. startup: the first fixed Case's engine starts (a failure: stillborn; the mutated module
   is imported here, when vLLM builds its engine);
3. cases: the fixed Cases run (fuzz.mutate.vllm.run_digest: tokens, logprobs, the steps),
   each engine first warmed up by a one-token request;
4. campaign: `llmfuzz run --target vllm`'s campaign (fuzz.campaign.loop.Campaign on
   fuzz.targets.vllm.target.VLLMTarget, known crashes counted as the target counts them) on
   the same runner, for the budget, stopping at its first failure, shrinking nothing; its
   first config is the last Case's, whose engine is up (fuzz.mutate.vllm.campaign_configs).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

from fuzz.mutate.worker import Result, campaign_record


def _under(path: str | None, root: str) -> bool:
    return bool(path) and os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def wrong_tree(runner, scratch: str) -> str | None:
    """The vLLM trees an engine of `runner` imported that are not the scratch copy, if any."""
    bad = sorted(str(f) for f in runner.vllm_files if not _under(f, scratch))
    return f"vllm loaded from {', '.join(bad)}" if bad else None


def warm_up(runner, case, warmed: set) -> None:
    """A one-token request on the Case's engine, started if need be, before the Case itself:
    vLLM compiles some kernels (torch.compile, e.g. the sampler's logprobs) on their first call,
    which on a loaded machine can outlast the runner's no-progress watchdog. Their cache
    (torch's, shared by every process) makes it quick after the first process."""
    from dataclasses import replace

    from fuzz.cases.case import RequestSpec, Workload
    from fuzz.targets.vllm.configs import VLLMOptions

    key = runner.engine_key(case)
    if key in warmed and runner.is_live(case.config, VLLMOptions.of(case)):
        return
    runner.run(replace(case, workload=Workload((RequestSpec((1,), 1),))))
    warmed.add(key)


def _campaign(spec: dict, runner, res: Result) -> None:
    from fuzz import profiles
    from fuzz.campaign.loop import Campaign
    from fuzz.mutate.vllm import campaign_configs
    from fuzz.targets.vllm.checker import VLLMChecker
    from fuzz.targets.vllm.known import default_known
    from fuzz.targets.vllm.target import VLLMTarget

    profiles.load()
    configs, plan = campaign_configs(spec["budget_s"], spec["seed"], tuple(spec.get("layouts") or ()))
    checker = VLLMChecker(runner=runner)
    target = VLLMTarget(configs, checker=checker, known=default_known(), plan=plan)
    try:
        s = Campaign(target=target, budget_s=spec["budget_s"], out_dir=spec["out_dir"], seed=spec["seed"],
                     shrink_s=0.0, shrink_budget_s=0.0, stop_on_failure=True, progress=False).run()
    finally:
        checker.close()
    bad = wrong_tree(runner, spec["scratch"])
    if bad:
        res.save(stage="wrong_tree", error=bad)
        return
    res.save(stage="done", campaign=campaign_record(s, configs=[c.name for c in target.cells()],
                                                    engine_starts=len(runner.starts)))


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from fuzz.campaign.jobs_worker import _die_with

    _die_with(spec["parent_pid"])  # no mutant runs on after `llmfuzz mutate` is gone
    res = Result(result_path)
    res.save()
    found = importlib.util.find_spec("vllm")
    if found is None or not _under(found.origin, spec["scratch"]):
        res.save(stage="wrong_tree", error=f"vllm found at {found and found.origin}")
        return 3
    from fuzz.cases.case import Case
    from fuzz.mutate.vllm import campaign_configs, failure_digest, run_digest
    from fuzz.targets.runs import TargetFailure
    from fuzz.targets.vllm.configs import VLLMOptions
    from fuzz.targets.vllm.runner import VLLMRunner

    cases = [Case.from_dict(d) for d in spec["cases"]]
    runner = VLLMRunner(log_dir=os.path.join(spec["scratch"], "vllm-logs"))
    try:
        res.save(stage="startup")
        t0 = time.monotonic()
        try:
            runner.ensure(cases[0].config, VLLMOptions.of(cases[0]))
        except TargetFailure as f:  # the mutated vLLM does not import, or its first engine does not start
            res.save(stillborn=f"{f}\n{f.detail}"[-1500:])
            return 0
        bad = wrong_tree(runner, spec["scratch"])
        if bad:  # never score the original tree
            res.save(stage="wrong_tree", error=bad)
            return 3
        res.save(stage="cases", startup_seconds=round(time.monotonic() - t0, 2))
        # The spare worker the first start spawned serves the Cases' second config; another
        # spare (a vLLM import, ~40 s of a core here) only pays if the campaign starts engines.
        runner.spare = bool(spec.get("budget_s")) and len(
            campaign_configs(spec["budget_s"], spec["seed"], tuple(spec.get("layouts") or ()))[0]) > 1
        t0, warmed = time.monotonic(), set()  # the engine keys warmed up
        for case in cases:
            try:
                warm_up(runner, case, warmed)
                d = run_digest(runner.run(case))
            except TargetFailure as f:  # a crash, a hang, a failed start: an output like any other
                d = failure_digest(f)
            res.doc["digests"].append(d)
            res.save()
        res.save(stage="campaign", cases_seconds=round(time.monotonic() - t0, 2))
        if spec.get("budget_s"):
            _campaign(spec, runner, res)
        else:
            bad = wrong_tree(runner, spec["scratch"])
            res.save(stage="wrong_tree", error=bad) if bad else res.save(stage="done")
    except Exception:  # noqa: BLE001 - the harness's own failure: an error, with its traceback
        res.save(harness_error=traceback.format_exc(limit=6)[-1500:])
        raise
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
