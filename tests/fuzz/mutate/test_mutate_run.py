"""`llmfuzz mutate` end to end on hand-picked mutants of the reference engine (slow: a baseline
and three mutant processes, each a short campaign on one layout): a mutant that breaks the
scheduler is caught, one in CUDA-only code is not observable on the CPU, one that breaks
engine construction is stillborn; the JSON report has its schema."""
from __future__ import annotations

import json

import pytest

import fuzz.mutate.run as mutate_run
from fuzz.cli.main import main
from fuzz.mutate.points import points
from fuzz.mutate.report import REPORT_VERSION
from fuzz.mutate.sources import find_source

FILES = ["engine/scheduler.py", "engine/cuda_graph.py", "engine/llm_engine.py"]


def _pick(file: str, operator: str, original: str):
    src = find_source("reference")
    hits = [m for m in points(src.read(file), file, (operator,)) if m.original == original]
    assert len(hits) == 1, (file, operator, original, hits)
    return hits[0]


CAUGHT = ("engine/scheduler.py", "drop_stmt", "req.num_computed_tokens += num_sched[rid]")
DEAD = ("engine/cuda_graph.py", "drop_stmt", "side.wait_stream(torch.cuda.current_stream())")  # GPU capture only
STILLBORN = ("engine/llm_engine.py", "drop_stmt", "self.executor = InlineExecutor(cfg, record_fa)")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mutate")
    chosen = [_pick(*CAUGHT), _pick(*DEAD), _pick(*STILLBORN)]
    saved = mutate_run.sample
    mutate_run.sample = lambda pts, n, seed: [m for m in chosen if m in pts]
    try:
        rc = main(["mutate", "--paths", *FILES, "--n", "3", "--budget-per-mutant", "2", "--cases", "2", "--jobs", "2",
                   "--layouts", "tp1pp1", "--json", "--out", str(out)])
    finally:
        mutate_run.sample = saved
    assert rc == 0
    with open(out / "mutate.json") as f:
        doc = json.load(f)
    return doc, {(e["file"], e["operator"], e["original"]): e for e in doc["mutants"]}


@pytest.mark.slow
def test_a_mutant_that_stalls_the_scheduler_is_caught(report) -> None:
    e = report[1][CAUGHT]
    assert e["status"] == "caught" and e["caught_by"], e
    assert e["differing_cases"] and e["observed_by"] == "outputs", "caught, and observable on the fixed Cases too"


@pytest.mark.slow
def test_a_mutant_in_gpu_only_code_is_not_observable_on_the_cpu(report) -> None:
    e = report[1][DEAD]
    assert e["status"] == "unobserved", e
    assert e["differing_cases"] == [] and e["fa_only_cases"] == [] and e["observed_by"] is None


@pytest.mark.slow
def test_a_mutant_that_breaks_engine_construction_is_stillborn_and_not_scored(report) -> None:
    e = report[1][STILLBORN]
    assert e["status"] == "stillborn", e
    assert "AttributeError" in e["detail"] and "executor" in e["detail"]
    c = report[0]["counts"]
    assert c == {"mutants": 3, "caught": 1, "caught_by_timeout": 0, "silent": 0, "silent_fa_only": 0,
                 "unobserved": 1, "stillborn": 1, "error": 0, "observable": 1}
    assert report[0]["score"] == report[0]["score_outputs"] == 1.0


@pytest.mark.slow
def test_the_json_report_has_its_schema(report) -> None:
    doc = report[0]
    assert doc["version"] == REPORT_VERSION
    assert {"target", "paths", "seed", "n", "budget_per_mutant_s", "timeout_s", "jobs", "num_cases", "points_total",
            "points_by_operator", "baseline", "counts", "score", "score_outputs", "wall_s", "mutants"} <= set(doc)
    assert doc["baseline"]["green"] and doc["num_cases"] == 2 and doc["jobs"] == 2 and doc["paths"] == sorted(FILES)
    for e in doc["mutants"]:
        assert {"id", "file", "line", "col", "end_line", "end_col", "operator", "original", "mutated", "status",
                "caught_by", "observed_by", "differing_cases", "fa_only_cases", "diff", "seconds"} <= set(e)
        assert e["diff"].startswith(f"--- a/{e['file']}\n+++ b/{e['file']}\n")
