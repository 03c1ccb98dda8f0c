"""The house's structure, drawn from its imports (ast; function-local imports count): the
engine imports nothing from the harness, and no module of engine/ or fuzz/ imports itself
back through others. The FA contract is a leaf: torch and the standard library only."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("engine", "fuzz"):
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


def _targets(mods: dict, cur: str, node) -> set[str]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = cur.split(".") if mods[cur].name == "__init__.py" else cur.split(".")[:-1]
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from fuzz import guard`
    out = set()
    for n in names:
        parts = n.split(".")
        for i in range(len(parts), 0, -1):  # the longest module the name starts with
            if ".".join(parts[:i]) in mods:
                out.add(".".join(parts[:i]))
                break
    return out - {cur}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                g[m] |= _targets(mods, m, node)
    # Importing a.b runs a/__init__ first; that is not an edge of a's design.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in g.items()}


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    sys.setrecursionlimit(10000)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_engine_imports_nothing_from_the_harness() -> None:
    g = _graph()
    bad = sorted((a, b) for a in g for b in g[a] if a.startswith("engine") and b.startswith("fuzz"))
    assert not bad, bad


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_fa_contract_is_a_leaf() -> None:
    g = _graph()
    for leaf in ("engine.attention.fa_contract", "engine.attention.fa_shapes"):
        assert g[leaf] <= {"engine.attention.fa_shapes"}, (leaf, g[leaf])
