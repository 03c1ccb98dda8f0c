"""The fault registry is honest about where each fault lives.

Every fault names its seam (`Fault.where`: "path: Class.method"), engine code checks it
through its module constant exactly once, inside that seam, and nowhere names a fault by a
string (a typo would then silently disable it instead of failing at import).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import engine.faults as faults_mod
from engine.faults import CAPTURE_FAULTS, FAULTS, FaultSet, register

ROOT = Path(__file__).resolve().parents[2]
ENGINE_FILES = sorted(p for p in (ROOT / "engine").rglob("*.py") if p.name != "faults.py")
CONSTANTS = {k: v for k, v in vars(faults_mod).items() if k.isupper() and isinstance(v, str) and v in FAULTS}


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """Every function of a module by qualified name (Class.method, outer.inner)."""
    out: dict[str, ast.AST] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    out[name] = child
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def _seam(name: str) -> tuple[str, str]:
    path, _, qualname = FAULTS[name].where.partition(": ")
    return path, qualname


def _uses() -> dict[str, list[tuple[str, str, ast.AST]]]:
    """Per fault constant: (file, enclosing function, node) of each use in engine code
    outside the registry, imports excluded."""
    uses: dict[str, list] = {c: [] for c in CONSTANTS}
    for path in ENGINE_FILES:
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(ROOT))
        owner = {}
        for qual, fn in _functions(tree).items():
            for node in ast.walk(fn):
                owner[id(node)] = qual  # inner functions come later and win
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in CONSTANTS:
                uses[name].append((rel, owner.get(id(node), "<module>"), node))
    return uses


def test_every_fault_has_one_constant_named_after_it():
    assert sorted(CONSTANTS.values()) == sorted(FAULTS)
    for const, name in CONSTANTS.items():
        assert const == name.upper(), (const, name)
    assert CAPTURE_FAULTS <= set(FAULTS)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_where_names_an_existing_function(name):
    path, qualname = _seam(name)
    assert path and qualname, f"{name}: where={FAULTS[name].where!r} is not 'path: Class.method'"
    file = ROOT / path
    assert file.is_file(), f"{name}: {path} does not exist"
    funcs = _functions(ast.parse(file.read_text()))
    assert qualname in funcs, f"{name}: no function {qualname} in {path}"


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_is_checked_once_exactly_at_its_seam(name):
    const = name.upper()
    uses = _uses()[const]
    path, qualname = _seam(name)
    assert [(f, q) for f, q, _ in uses] == [(path, qualname)], \
        f"{const} is used at {[(f, q) for f, q, _ in uses]}, its seam is {path}: {qualname}"
    seam = _functions(ast.parse((ROOT / path).read_text()))[qualname]
    checks = [n for n in ast.walk(seam)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "on"]
    assert len(checks) == 1, f"{path}: {qualname} holds {len(checks)} fault checks, not one"
    (arg,) = checks[0].args
    use = uses[0][2]
    assert (arg.lineno, arg.col_offset) == (use.lineno, use.col_offset), \
        f"{path}: {qualname} checks something other than {const}"


def test_engine_code_never_names_a_fault_by_string():
    for path in ENGINE_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in FAULTS, f"{path.relative_to(ROOT)}: string {node.value!r}; use its constant"


def test_typos_fail():
    with pytest.raises(ValueError, match="unknown fault"):
        FaultSet(["pp_everything_wrong"])
    with pytest.raises(AssertionError):
        FaultSet().on("pp_everything_wrong")
    with pytest.raises(ValueError, match="registered twice"):
        register("sp_residual_copy_len", where="x: y", doc="")
    with pytest.raises(ImportError):
        from engine.faults import SP_RESIDUAL_COPY_LENGTH  # noqa: F401
