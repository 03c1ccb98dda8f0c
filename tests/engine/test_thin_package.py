"""Importing one engine module loads that module and what it imports, nothing more: the
`engine` package exports its names lazily, and the FA contract (which the FA guard loads into
other engines' processes) needs torch and the standard library alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str):
    """Run `code` in a new interpreter; it prints one JSON value, returned here."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_importing_the_fa_contract_loads_only_the_contract():
    loaded = _fresh("import json, sys, engine.attention.fa_contract\n"
                    "print(json.dumps(sorted(m for m in sys.modules if m.startswith('engine'))))")
    assert loaded == ["engine", "engine.attention", "engine.attention.fa_contract",
                      "engine.attention.fa_contract.shapes"]


def test_the_fa_contract_needs_torch_and_the_standard_library_only():
    new = _fresh("import json, sys\n"
                 "import torch\n"
                 "before = set(sys.modules)\n"
                 "import engine.attention.fa_contract\n"
                 "print(json.dumps(sorted(set(sys.modules) - before)))")
    roots = {m.split(".")[0] for m in new}
    assert roots <= {"engine", "torch"} | set(sys.stdlib_module_names), sorted(roots)


def test_the_config_imports_no_backend():
    loaded = _fresh("import json, sys, engine.config\n"
                    "print(json.dumps(sorted(m for m in sys.modules if m.startswith('engine'))))")
    assert loaded == ["engine", "engine.config"]


def test_the_public_names_load_on_first_use():
    import engine

    for name in engine.__all__:
        assert getattr(engine, name).__name__ == name
    assert set(engine.__all__) <= set(dir(engine))
    from engine import cpu_graph  # a submodule, not an export: imported as one

    assert cpu_graph.__name__ == "engine.cpu_graph"
    with pytest.raises(AttributeError, match="no_such_name"):
        engine.no_such_name  # noqa: B018
