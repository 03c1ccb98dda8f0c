"""How a mutant's worker result becomes its status, and the per-mutant timeout's kill."""
from __future__ import annotations

import os
import tempfile
import time

from fuzz.mutate.run import classify, run_worker
from fuzz.mutate.sources import find_source

BASE = {"digests": [{"outputs": "a", "fa": "x"}, {"outputs": "b", "fa": "y"}]}


def _res(stage="done", digests=None, campaign=None, timed_out=False, rc=0, **kw) -> dict:
    return {"stage": stage, "digests": BASE["digests"] if digests is None else digests,
            "campaign": {"failures": [], "examples": 3} if campaign is None else campaign,
            "timed_out": timed_out, "rc": rc, "log_tail": "log", **kw}


def test_same_digests_and_a_passing_campaign_is_unobserved() -> None:
    r = classify(_res(), BASE)
    assert r["status"] == "unobserved" and r["observed_by"] is None


def test_other_outputs_and_a_passing_campaign_is_a_silent_survivor() -> None:
    r = classify(_res(digests=[{"outputs": "a", "fa": "x"}, {"outputs": "B", "fa": "Y"}]), BASE)
    assert r["status"] == "silent" and r["observed_by"] == "outputs" and r["differing_cases"] == [1]
    assert r["raised_on_cases"] is None
    raised = {"outputs": "C", "fa": "", "raised": "raised EngineViolation: block 3 leaked"}
    r = classify(_res(digests=[{"outputs": "a", "fa": "x"}, raised]), BASE)
    assert r["status"] == "silent" and r["raised_on_cases"] == raised["raised"]  # the check that would see it


def test_fa_records_alone_differing_is_observable_as_such() -> None:
    r = classify(_res(digests=[{"outputs": "a", "fa": "X"}, {"outputs": "b", "fa": "y"}]), BASE)
    assert r["status"] == "silent" and r["observed_by"] == "fa_records" and r["fa_only_cases"] == [0]


def test_a_campaign_failure_is_caught_and_names_its_property() -> None:
    fail = {"property": "logits", "message": "max |logits - ref| 3.0", "case": "c", "path": "p", "oracle": "solo"}
    r = classify(_res(campaign={"failures": [fail], "examples": 2}), BASE)
    assert r["status"] == "caught" and r["caught_by"].startswith("logits: max")


def test_a_hang_after_start_up_is_caught_by_timeout_and_a_hang_before_is_stillborn() -> None:
    r = classify(_res(stage="campaign", campaign=None, timed_out=True, rc=-9), BASE)
    assert r["status"] == "caught" and r["caught_by"].startswith("timeout")
    r = classify(_res(stage="startup", digests=[], campaign=None, timed_out=True, rc=-9), BASE)
    assert r["status"] == "stillborn" and r["detail"].startswith("hung at start-up")


def test_an_import_error_is_stillborn_and_a_worker_crash_after_start_up_an_error() -> None:
    r = classify(_res(stage="import", digests=[], campaign=None, stillborn="ImportError: no module x"), BASE)
    assert r["status"] == "stillborn" and "ImportError" in r["detail"]
    r = classify(_res(stage="campaign", campaign=None, rc=1), BASE)
    assert r["status"] == "error"


def test_the_timeout_kills_the_mutant_process_and_leaves_no_scratch_copy(tmp_path) -> None:
    before = set(os.listdir(tempfile.gettempdir()))
    t0 = time.monotonic()
    spec = {"module": None, "cases": [], "seed": 0, "budget_s": 0, "layouts": []}
    res = run_worker(find_source("reference"), None, spec, timeout_s=0.5)  # killed while importing torch
    assert res["timed_out"] and res["rc"] != 0 and time.monotonic() - t0 < 30
    assert not {d for d in set(os.listdir(tempfile.gettempdir())) - before if d.startswith("llmfuzz-mutant-")}
