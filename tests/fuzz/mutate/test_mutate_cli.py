"""`llmfuzz mutate`'s input checks and its scratch copies (fast: no mutant process runs)."""
from __future__ import annotations

import hashlib
import os

import pytest

import fuzz.mutate.run as mutate_run
from fuzz.cli.main import main
from fuzz.mutate.points import points
from fuzz.mutate.sources import Source, find_source, scratch_copy


@pytest.fixture
def no_process(monkeypatch):
    """Bad input must be refused before any process starts: starting one fails the test."""
    def refuse(*a, **k):
        raise AssertionError("a mutant process was started")
    monkeypatch.setattr(mutate_run, "run_worker", refuse)
    monkeypatch.setattr(mutate_run, "draw_cases", refuse)


@pytest.mark.parametrize("argv, words", [
    (["--target", "nope"], "unknown target 'nope'"),
    (["--paths", "engine/no_such_*.py"], "matches no .py file"),
    (["--paths", "fuzz/cases/case.py"], "outside the engine package"),
    (["--n", "0"], "--n: 0 mutants"),
    (["--budget-per-mutant", "-1"], "--budget-per-mutant"),
    (["--jobs", "0"], "--jobs"),
    (["--cases", "0"], "--cases"),
    (["--layouts", "tp3pp1"], "--layouts"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_process(no_process, capsys, argv, words) -> None:
    assert main(["mutate", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def _tree_state(root: str) -> dict:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[p] = (os.stat(p).st_mtime_ns, hashlib.sha256(fh.read()).hexdigest())
    return out


def test_applying_a_mutant_writes_only_the_scratch_copy(tmp_path) -> None:
    src = find_source("reference")
    rel = "engine/scheduler.py"
    m = points(src.read(rel), rel, ("cmp_flip",))[0]
    before = _tree_state(os.path.join(src.root, "engine"))
    into = scratch_copy(src, m, str(tmp_path))
    assert _tree_state(os.path.join(src.root, "engine")) == before
    with open(os.path.join(into, rel)) as f:
        copied = f.read()
    assert copied != src.read(rel) and copied.count("\n") == src.read(rel).count("\n")
    # The rest of the package is there, unchanged, for `import engine` to load from the copy.
    with open(os.path.join(into, "engine/kv_cache.py")) as f:
        assert f.read() == src.read("engine/kv_cache.py")


def test_a_package_under_any_source_root_is_found_and_copied(tmp_path) -> None:
    """The generic path handling --target vllm uses: a package under a source root."""
    pkg = tmp_path / "site" / "toy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("def f(a, b):\n    return a < b\n")
    src = Source("toy", str(tmp_path / "site"), "toy")
    assert src.files(("toy/*.py",)) == ["toy/__init__.py", "toy/core.py"]
    m = points(src.read("toy/core.py"), "toy/core.py", ("cmp_flip",))[0]
    out = scratch_copy(src, m, str(tmp_path / "scratch"))
    assert (tmp_path / "scratch" / "toy" / "core.py").read_text() == "def f(a, b):\n    return a <= b\n"
    assert (pkg / "core.py").read_text() == "def f(a, b):\n    return a < b\n" and out == str(tmp_path / "scratch")
