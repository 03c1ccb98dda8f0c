"""The stand-alone continuous-batching check (scripts/cb_greedy_check.py) on the CPU, on the
model and requests scripts/tcb_export.py writes from a committed reproducer
(docs/findings/transformers_cb_cuda_wrong_tokens_triage.md): it reports agreement where the
library agrees, a disagreement planted between the batched run and the others, and it imports
nothing of llmfuzz (a difference it shows is the library's, not the harness's)."""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
SCRIPTS = ROOT / "scripts"
REPRO = ROOT / "reproducers" / "transformers_cb" / "unreproduced" / "transformers_cb_batch_invariance" / "401dff3151eb.json"

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
slow = pytest.mark.slow


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def check():
    """The check's module, loaded once (its import of transformers is most of a test's time)."""
    return _script("cb_greedy_check")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The reproducer's model and requests, its checkpoint written into a cache of the test's own."""
    out = tmp_path_factory.mktemp("tcb-export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMFUZZ_CACHE", str(out / "cache"))
        case_json = Path(_script("tcb_export").export(str(REPRO), str(out / "case")))
    return case_json.parent / "model", case_json


def _check(capsys, check, exported, *flags: str) -> tuple[int, list[dict], dict]:
    model, case_json = exported
    rc = check.main([str(model), str(case_json), "--device", "cpu", *flags])
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    return rc, lines[:-1], lines[-1]


@needs_transformers
def test_export_writes_the_cases_requests_and_config(exported):
    from fuzz.campaign.reproduce import load_reproducer
    from fuzz.targets.transformers_cb.configs import CBOptions, cb_config

    model, case_json = exported
    doc, case = json.loads(case_json.read_text()), load_reproducer(str(REPRO)).case
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    assert doc["cb"] == cb_config(case.config, CBOptions.of(case))
    assert (doc["cb"]["use_cuda_graph"], doc["cb"]["use_async_batching"], doc["cb"]["num_blocks"]) == (True, True, 17)
    assert [(r["id"], r["prompt_token_ids"], r["max_tokens"]) for r in doc["requests"]] == \
        [(f"r{i}", list(r.prompt_token_ids), r.max_tokens) for i, r in enumerate(case.workload.requests)]
    assert (doc["attn"], doc["dtype"], doc["device"]) == ("sdpa", "bfloat16", "cuda")


@slow
@needs_transformers
def test_agreement_on_the_cpu(capsys, check, exported):
    """The reproducer's requests, batched, alone and plain, agree on the CPU (graphs and async
    batching are CUDA's: turned off, and the verdict says so)."""
    rc, lines, verdict = _check(capsys, check, exported)
    assert (rc, verdict["verdict"], verdict["replay_rate"]) == (0, "agree", "0/1"), verdict
    assert verdict["forced_off"] == ["use_cuda_graph", "use_async_batching"]
    assert verdict["config"]["num_blocks"] == 17 and verdict["runs"][0]["batches"] > 0
    batch = [ln for ln in lines if "repeat" in ln]
    assert [ln["id"] for ln in batch] == ["r0", "r1"] and all(ln["status"] == "agree" for ln in batch)
    assert all(ln["tokens"] == ln["solo"] and len(ln["tokens"]) == ln["max_tokens"] for ln in batch)


@slow
@needs_transformers
def test_a_planted_disagreement_is_reported(capsys, check, exported):
    """Noise added to the LM head for the batched run only: its tokens leave the plain forward's
    argmax and the run alone, and the check says where, with the token's rank and gap."""
    rc, lines, verdict = _check(capsys, check, exported, "--dtype", "float32", "--test-perturb-batched", "lm_head.weight=0.5")
    assert (rc, verdict["verdict"], verdict["replay_rate"]) == (1, "differs", "1/1"), verdict
    against = {d["against"] for d in verdict["differing"]}
    assert against == {"solo", "plain"}
    plain = next(d for d in verdict["differing"] if d["against"] == "plain")
    assert plain["rank"] > 1 and plain["gap"] > verdict["tie_tol"] and plain["token"] != plain["top1"]
    # The runs alone were not perturbed: they still agree with the plain forward.
    assert all(ln["status"] == "agree" for ln in lines if "solo_repeat" in ln)


def test_the_check_imports_nothing_of_llmfuzz():
    allowed = {"argparse", "inspect", "json", "sys", "threading", "time", "torch", "transformers", "__future__"}
    tree = ast.parse((SCRIPTS / "cb_greedy_check.py").read_text())
    roots = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert roots <= allowed, roots - allowed


def test_the_triage_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPTS / "tcb_cuda_triage.sh")]).returncode == 0
