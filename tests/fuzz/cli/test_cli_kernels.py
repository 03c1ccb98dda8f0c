"""The GPU leg's defaults and the flash_attn backend's CLI behaviour, on the CPU:
`--attention-backend flash_attn` without the package exits 2 with one line naming what to
install (before any rank starts, and before CUDA is even looked at); `--device cuda` defaults
to bf16 on the real kernels; kernels are cells whose summary names them."""
from __future__ import annotations

import argparse

import pytest
import torch

from engine.attention import flash_attn_backend
from fuzz.cli import main as cli
from fuzz.cli import common as cli_common
from fuzz.errors import BadInput
from fuzz.targets.kernels import KernelCells
from fuzz.cases.strategies import FUZZ_MODEL
from fuzz.campaign.summary import CellStats, Failure, Summary

needs_no_package = pytest.mark.skipif(flash_attn_backend.probe() is not None,
                                      reason="flash-attn is installed here")


@needs_no_package
@pytest.mark.parametrize("argv", [
    ["run", "--attention-backend", "flash_attn", "--budget", "5"],
    ["run", "--device", "cuda", "--attention-backend", "flash_attn", "--budget", "5"],
    ["run", "--device", "cuda", "--attention-backend", "torch_flash,flash_attn", "--budget", "5"],
    ["selftest", "--device", "cuda", "--dtype", "bfloat16", "--attention-backend", "flash_attn"],
])
def test_flash_attn_without_the_package_exits_2_with_one_line(argv, capsys, monkeypatch):
    looked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: looked.append(1) or False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "pip install flash-attn-4" in err[0] and "pip install flash-attn " in err[0], err[0]
    assert not looked  # said before CUDA was looked at: the same line on a GPU machine


def _args(**kw):
    d = dict(device="cuda", world="inproc", dtype=None, attention_backend=None)
    d.update(kw)
    return argparse.Namespace(**d)


FOUND = flash_attn_backend.Found("fa4", "flash_attn.cute", "flash-attn-4", "4.0.0b36")


@pytest.mark.parametrize("found,kw,several,want", [
    (None, {}, True, (["torch_flash"], "bfloat16")),
    (FOUND, {}, True, (["torch_flash", "flash_attn"], "bfloat16")),
    (FOUND, {}, False, (["torch_flash"], "bfloat16")),  # selftest: one kernel
    (FOUND, {"dtype": "float32"}, True, (["reference"], "float32")),  # the old fp32 leg
    (FOUND, {"attention_backend": "reference"}, True, (["reference"], "float32")),
    (FOUND, {"attention_backend": "flash_attn", "dtype": "float16"}, True, (["flash_attn"], "float16")),
    (None, {"device": "cpu"}, True, (["reference"], "float32")),
])
def test_gpu_defaults_are_what_users_run(found, kw, several, want, monkeypatch, capsys):
    monkeypatch.setattr(flash_attn_backend, "probe", lambda: found)
    assert cli_common._kernels_and_dtype(_args(**kw), several) == want
    err = capsys.readouterr().err
    assert ("not importable" in err) == (found is None and several and kw.get("device", "cuda") == "cuda"
                                        and not kw)


def test_one_line_names_the_entry_point_found(monkeypatch, capsys):
    monkeypatch.setattr(flash_attn_backend, "probe", lambda: FOUND)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bases = cli_common.base_configs(_args())
    assert [(b.attention_backend, b.dtype) for b in bases] == [("torch_flash", "bfloat16"), ("flash_attn", "bfloat16")]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["llmfuzz: attention backend flash_attn: flash-attn-4 4.0.0b36 "
                   "(flash_attn.cute.flash_attn_varlen_func, paged KV through page_table)"]


def test_selftest_takes_one_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BadInput, match="one kernel"):
        cli_common.base_config(_args(attention_backend="torch_flash,reference"))


def test_kernel_cells_summary_names_each_kernel():
    bases = [FUZZ_MODEL.replace(device="cuda", dtype="bfloat16", attention_backend="torch_flash"),
             FUZZ_MODEL.replace(device="cuda", dtype="bfloat16", attention_backend="reference")]
    t = KernelCells(harness=None, layouts=("tp1pp1", "tp1pp2"), modes=("eager", "graph"), bases=bases)
    cells = t.cells()
    assert [c.data for c in cells] == ["tp1pp1", "tp1pp1", "tp1pp2", "tp1pp2"]  # kernels alternate per layout
    assert len({c.name for c in cells}) == 4
    s = Summary(planned=[c.name for c in cells], budget_s=10, target=t)
    s.cells[("tp1pp1", "graph", "torch_flash")] = CellStats(examples=3, seconds=1.5, failures=1)
    s.cells[("tp1pp1", "graph", "reference")] = CellStats(examples=2, seconds=1.0)
    s.examples, s.seconds = 5, 2.5
    s.failures.append(Failure("logits", "too far", "case", "r.json", 2.0, "reference", None, cells[0].name))
    j = s.to_json()
    assert j["per_cell"]["tp1pp1/graph/torch_flash"] == {"examples": 3, "failures": 1, "kernel": "torch_flash",
                                                         "examples_per_s": 2.0}
    assert j["per_kernel"]["reference"]["examples"] == 2 and j["kernels"] == ["torch_flash", "reference"]
    assert j["failure_details"][0]["kernel"] == "torch_flash" and j["dtype"] == "bfloat16"
    table = s.table()
    assert "kernel" in table.splitlines()[0] and "torch_flash" in table and "reference" in table
