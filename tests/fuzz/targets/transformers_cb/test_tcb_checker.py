"""The transformers-cb target is checked by the generic black-box checker (CBChecker): a clean
mixed batch passes every property a black box allows (vs the reference, vs transformers
teacher-forced without prompt logprobs, each request alone vs in the batch), under the
target's own property names; a request whose output changes when it runs alone (a runner
that plants it) is a `transformers_cb_batch_invariance` failure, which the other oracles,
comparing the batch run only, cannot see."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
              pytest.mark.slow]

CASE = CBOptions(kv_blocks=12).on(Case(CB_MODEL.replace(max_num_batched_tokens=16), Workload((
    RequestSpec(tuple(range(1, 30)), 5), RequestSpec((5, 6), 6, arrival_step=2),
    RequestSpec(tuple(range(40, 80)), 4, arrival_step=1)))))


class SoloShifted:
    """A CBRunner whose solo runs (one request) return request r1's last logprob shifted by
    `shift` nats: the batch-invariance bug class (a request's numbers depend on its batch)."""

    def __init__(self, runner, shift: float) -> None:
        self.inner, self.shift = runner, shift
        self.supports_sampling = self.supports_prompt_logprobs = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, case, items=None, prompt_logprobs=False):
        out = self.inner.run(case, items, prompt_logprobs=prompt_logprobs)
        r = out.results.get("r1")
        if items is not None and len(items) == 1 and r is not None:
            last = tuple((t, lp - self.shift if i else lp) for i, (t, lp) in enumerate(r.logprobs[-1]))
            out.results["r1"] = replace(r, logprobs=r.logprobs[:-1] + (last,))
        return out


@pytest.fixture(scope="module")
def runner():
    from fuzz.targets.transformers_cb.runner import CBRunner

    r = CBRunner(hang_s=60.0)
    yield r
    r.close()


def test_a_clean_batch_passes_every_property(runner):
    from fuzz.targets.transformers_cb.target import CBChecker

    chk = CBChecker(runner, transformers=True)
    try:
        v = chk.check(CASE)
    finally:
        chk.reference.close()
    assert set(v.oracles) == {"reference", "transformers", "transformers_cb-solo"}
    n = sum(r.max_tokens for r in CASE.workload.requests)
    assert v.vs_reference.positions == n and v.vs_transformers.positions == n
    assert v.vs_transformers.prompt_positions == 0  # the library returns no prompt logprobs
    assert v.batch.positions == n
    for rep in v.oracles.values():
        assert rep.max_lp_error < v.lp_tol
    assert chk.batch_extras["offloads"] > 0  # the batch run's evictions, kept past the solo runs


def test_a_request_that_changes_alone_is_a_batch_invariance_failure(runner):
    from fuzz.targets.transformers_cb.target import PROPERTIES, CBChecker

    chk = CBChecker(SoloShifted(runner, shift=0.05), transformers=True)
    try:
        with pytest.raises(PROPERTIES.batch_invariance) as e:
            chk.check(CASE)
    finally:
        chk.reference.close()
    assert e.value.property == "transformers_cb_batch_invariance" and "r1" in str(e.value)
