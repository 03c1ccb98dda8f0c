"""`llmfuzz mutate --target vllm` end to end on two hand-picked mutants of vLLM's scheduler
(markers `vllm` and `slow`: a baseline and two mutant processes, each starting vLLM engines;
several minutes on two cores). Skips cleanly without vLLM. Run with the venv that has it:

    /work/vllm-venv/bin/python -m pytest -q tests/fuzz/mutate/test_mutate_vllm_run.py -m vllm
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")

import fuzz.mutate.run as mutate_run  # noqa: E402
from fuzz.cli.main import main  # noqa: E402
from fuzz.mutate.points import points  # noqa: E402
from fuzz.mutate.sources import find_source  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FILE = "vllm/v1/core/sched/scheduler.py"
# The scheduler never advances a request past what it computed: it reschedules it forever.
STALLS = ("drop_stmt", "request.num_computed_tokens += num_scheduled_token")
# The scheduler without its KV cache manager: the first engine cannot start.
NO_KV = ("drop_stmt", "self.kv_cache_manager = KVCacheManager(")


def _pick(operator: str, start: str):
    src = find_source("vllm")
    hits = [m for m in points(src.read(FILE), FILE, (operator,)) if m.original.startswith(start)]
    assert len(hits) == 1, (operator, start, hits)
    return hits[0]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mutate-vllm")
    chosen = [_pick(*STALLS), _pick(*NO_KV)]
    installed = os.path.join(find_source("vllm").root, FILE)
    before = os.stat(installed).st_mtime_ns
    saved = mutate_run.sample
    mutate_run.sample = lambda pts, n, seed: [m for m in chosen if m in pts]
    try:
        rc = main(["mutate", "--target", "vllm", "--paths", FILE, "--n", "2", "--budget-per-mutant", "15",
                   "--cases", "2", "--json", "--out", str(out)])
    finally:
        mutate_run.sample = saved
    assert rc == 0 and os.stat(installed).st_mtime_ns == before, "the installed vLLM is never written"
    with open(out / "mutate.json") as f:
        doc = json.load(f)
    return doc, {e["original"][:40]: e for e in doc["mutants"]}


def _entry(report, start: str) -> dict:
    return next(e for k, e in report[1].items() if start.startswith(k) or k.startswith(start[:40]))


def _leftovers() -> list[int]:
    """Processes of a mutant whose scratch directory is gone: nothing a mutant started outlives it."""
    from fuzz.mutate.run import TAG_ENV

    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        tag = env.get(TAG_ENV.encode())
        if tag and not os.path.isdir(tag):
            out.append(int(d))
    return out


def test_a_mutant_that_stalls_requests_is_caught_and_leaves_no_process(report) -> None:
    # Its engine steps on without advancing (the no-progress watchdog sees steps): the first
    # Case outlasts the mutant's timeout, and the hang is caught by it (measured: killed in
    # stage "cases"), vLLM's engine processes with it.
    e = _entry(report, STALLS[1])
    assert e["status"] == "caught" and e["caught_by"], e
    assert _leftovers() == []


def test_a_scheduler_without_its_kv_cache_is_stillborn(report) -> None:
    e = _entry(report, NO_KV[1])
    assert e["status"] == "stillborn" and "kv_cache_manager" in e["detail"], e


def test_the_vllm_report_has_the_baseline_and_its_settings(report) -> None:
    doc = report[0]
    assert doc["target"] == "vllm" and doc["num_cases"] == 2 and doc["baseline"]["green"]
    assert doc["baseline"]["campaign_configs"] and all("-eager" in c for c in doc["baseline"]["campaign_configs"])
    assert doc["counts"]["error"] == 0 and doc["score"] == 1.0
