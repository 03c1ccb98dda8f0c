"""Every committed transformers-cb reproducer (reproducers/transformers_cb/) still fails as
recorded on the installed transformers (`llmfuzz replay`: exit 1, the same crash signature).
When the library fixes one, this test says so: drop the file and its entry in
docs/transformers_cb.md. A reproducer recorded on CUDA is a `gpu` test (`pytest -m gpu` on a
GPU host); its recorded transformers version is in the file. Findings that did not reproduce
when triaged (reproducers/transformers_cb/unreproduced/: wrong tokens seen only on a GPU shared
with other processes, docs/findings/transformers_cb_cuda_wrong_tokens_triage.md) are kept as
evidence, not asserted to fail; test_reproducer_file_layout still loads them."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fuzz.cli.main import main

ROOT = Path(__file__).resolve().parents[4]
FILES = sorted(p for p in (ROOT / "reproducers" / "transformers_cb").glob("**/*.json") if "unreproduced" not in p.parts)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
              pytest.mark.slow]


def _device(path: Path) -> str:
    return json.loads(path.read_text())["case"]["config"].get("device", "cpu")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


PARAMS = [pytest.param(p, id=p.name, marks=[pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs CUDA")])
          if _device(p) != "cpu" else pytest.param(p, id=p.name) for p in FILES]


@pytest.mark.parametrize("path", PARAMS)
def test_reproducer_still_fails_as_recorded(capsys, path):
    assert json.loads(path.read_text())["target"] == "transformers-cb"
    assert main(["replay", "--json", str(path)]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["reproduces"] and out["property"] == json.loads(path.read_text())["property"]


def test_there_is_a_committed_reproducer():
    assert FILES  # the finding in docs/transformers_cb.md ("What it found")
